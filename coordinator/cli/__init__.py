"""Command-line front ends of the coordinator: ``tp`` (researchers) and ``tuneplane-coordinator`` (admins)."""

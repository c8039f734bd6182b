"""Command-line front ends of the coordinator.

``tp`` is for researchers; ``tuneplane-coordinator`` is for the people who run the coordinator.
"""

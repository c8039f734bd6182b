"""Tests of the per-member runner and the agent's supervision of it (real processes)."""

"""Tests of the ``tuneplane.report`` SDK, run in real workload processes."""

"""Tests of the telemetry readers, the tailer and ``tuneplane-collector``."""

"""``tuneplane.report``: the metrics SDK a workload imports (``init``, ``log``, ``finish``)."""

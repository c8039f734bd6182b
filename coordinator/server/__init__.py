"""``serve``, the coordinator process, and what it stands on: its state directory and lock,
TLS, the addresses it hands out, the scheduler task and its Prometheus metrics.
"""

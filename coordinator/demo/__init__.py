"""``tuneplane demo``: a real coordinator and real agents on loopback running a bundled example."""

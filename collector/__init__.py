"""``tuneplane-collector``: TensorBoard and JSONL readers, tailer, spool and shipper."""

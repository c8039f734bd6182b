"""``tuneplane-node``: the Trio daemon on every GPU machine (journal, control session,
prepare/commit, supervision, inventory, local CLI)."""

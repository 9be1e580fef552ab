"""Parameter servers: the shard state machine (exactly-once ledger), its process, client, layout."""

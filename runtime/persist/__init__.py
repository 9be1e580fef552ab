"""What a run keeps on disk: checkpoints, committed snapshots, the run directory and its lock."""

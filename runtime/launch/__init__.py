"""Starting, watching and stopping the processes of a run (one host or torchrun)."""

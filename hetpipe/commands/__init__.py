"""One module per CLI sub-command."""

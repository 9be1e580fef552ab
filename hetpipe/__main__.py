"""``python -m hetpipe``: the same command line as the ``hetpipe`` script."""

from hetpipe.cli import main

main()

"""`python -m specpipe` runs the CLI."""

from specpipe.cli import main

main()

"""`python -m quantgate.cli`: the same as the `quantgate` command."""

from quantgate.cli import main

main()

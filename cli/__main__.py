"""`python -m cli ...` is the `crucible` command (for an environment without its console script)."""
from cli.main import main

main()

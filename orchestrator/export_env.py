"""`python -m orchestrator.export_env`: the tool is orchestrator.cli.export_env."""

from .cli.export_env import main

if __name__ == "__main__":
    raise SystemExit(main())

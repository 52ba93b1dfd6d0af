"""`python -m orchestrator.replay`: the tool is orchestrator.cli.replay."""

from .cli.replay import main

if __name__ == "__main__":
    raise SystemExit(main())

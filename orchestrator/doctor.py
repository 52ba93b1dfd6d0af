"""`python -m orchestrator.doctor`: the tool is orchestrator.cli.doctor."""

from .cli.doctor import main

if __name__ == "__main__":
    raise SystemExit(main())

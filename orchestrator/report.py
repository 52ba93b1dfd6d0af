"""`python -m orchestrator.report`: the tool is orchestrator.cli.report (the library that
builds and formats a job's results is orchestrator.reporting)."""

from .cli.report import main

if __name__ == "__main__":
    raise SystemExit(main())

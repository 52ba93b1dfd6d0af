"""`python -m orchestrator.report`: the tool is orchestrator.sweep.report (the library that
builds and formats a job's results is orchestrator.results.reporting)."""

from orchestrator.sweep.report import main

if __name__ == "__main__":
    raise SystemExit(main())

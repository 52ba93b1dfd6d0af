"""`python -m orchestrator.doctor`: the tool is orchestrator.preflight.doctor."""

from orchestrator.preflight.doctor import main

if __name__ == "__main__":
    raise SystemExit(main())

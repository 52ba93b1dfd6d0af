"""`python -m orchestrator.replay`: the tool is orchestrator.sweep.replay."""

from orchestrator.sweep.replay import main

if __name__ == "__main__":
    raise SystemExit(main())

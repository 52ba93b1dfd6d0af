"""`python -m orchestrator.export_env`: the tool is orchestrator.preflight.export_env."""

from orchestrator.preflight.export_env import main

if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m orchestrator.bench`: the tool is orchestrator.sweep.bench."""

from orchestrator.sweep.bench import main

if __name__ == "__main__":
    main()

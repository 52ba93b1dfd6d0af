"""`python -m orchestrator.bench`: the tool is orchestrator.cli.bench."""

from .cli.bench import main

if __name__ == "__main__":
    main()

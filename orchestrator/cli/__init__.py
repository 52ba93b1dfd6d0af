"""The command-line tools besides the run itself (`python -m orchestrator`): each is thin,
reads the library below it, and imports no other tool. Their module paths stay
`python -m orchestrator.bench`, `.doctor`, `.export_env`, `.replay`, `.report`."""

"""Imported last by the forkserver (warmstart.PRELOAD): its imports are done. Creates the file
ORCHESTRATOR_FORKSERVER_READY names, which the runner waits for (bounded) before it asks the
forkserver for a child."""

import os

_path = os.environ.get("ORCHESTRATOR_FORKSERVER_READY")
if _path:
    with open(_path, "w"):
        pass

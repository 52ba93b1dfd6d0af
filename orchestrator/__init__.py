"""Declarative orchestrator for the aux-metadata path of PD-disaggregated serving.

Data path: conf/ -> config (schema) -> plan (pure rules) -> buffers + transport ->
endpoints (prefill sender, decode receiver) -> runner -> report.

`MetadataBuffers` is imported on first use (it needs torch): `python -m orchestrator`
installs its signal handlers before anything heavy is imported, so a Ctrl-C in the first
second ends with one line, not a traceback from inside torch's import.
"""

__all__ = ["MetadataBuffers"]


def __getattr__(name: str):
    if name == "MetadataBuffers":
        from .buffers import MetadataBuffers

        return MetadataBuffers
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")

"""Declarative orchestrator for the aux-metadata path of PD-disaggregated serving.

Data path, one folder a stage: conf/ -> profile (schema, rule book, pure plan) -> handoff
(buffers, transports, endpoints, runner) -> results (records, results.json, reports); preflight
(doctor, export_env) and sweep (multirun summaries, bench, replay, report) beside them.

`MetadataBuffers` is imported on first use (it needs torch): `python -m orchestrator`
installs its signal handlers before anything heavy is imported, so a Ctrl-C in the first
second ends with one line, not a traceback from inside torch's import.
"""
__all__ = ["MetadataBuffers"]


def __getattr__(name: str) -> type:
    if name == "MetadataBuffers":
        from orchestrator.handoff.buffers import MetadataBuffers

        return MetadataBuffers
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")

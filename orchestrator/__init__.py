"""Declarative orchestrator for the aux-metadata path of PD-disaggregated serving.

Data path: conf/ -> config (schema) -> plan (pure rules) -> buffers + transport ->
endpoints (prefill sender, decode receiver) -> runner -> report.
"""

from .buffers import MetadataBuffers

__all__ = ["MetadataBuffers"]

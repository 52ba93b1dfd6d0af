"""The report's spec, built once by the job from the checked config: what results.json, the
summary, latency.png and the accounting of a lost rank read of it (orchestrator.results.
report_spec.ReportSpec, whose module says why it holds values, never config sections)."""

from __future__ import annotations

from orchestrator.profile.config import OrchestratorConfig
from orchestrator.results.report_spec import (
    ReportGate,
    ReportLoad,
    ReportRanks,
    ReportRows,
    ReportSend,
    ReportSpec,
)


def report_spec(cfg: OrchestratorConfig) -> ReportSpec:
    """The values the report reads of `cfg` (a validated config; its seed as the run uses it)."""
    from orchestrator.profile.layout import profile_layout

    w, t, e, g, f = cfg.workload, cfg.transport, cfg.endpoints, cfg.gate, cfg.faults
    fields = profile_layout(cfg.buffers, cfg.layout)
    return ReportSpec(
        role=cfg.role,
        load=ReportLoad(w.requests, w.concurrency, w.rate, w.batch_size, w.fill, w.duplicate_rooms, w.seed,
                        w.duration_s, w.burstiness),
        ranks=ReportRanks(e.prefill_ranks, e.decode_ranks, e.decode_tp),
        rows=ReportRows(cfg.buffers.size, sum(f[2] for f in fields), len(fields), cfg.layout.name,
                        cfg.verify.digest),
        send=ReportSend(t.coalesce, t.status, t.max_inflight_blocks, t.secret_env),
        gate=ReportGate(g.read, g.readiness, g.zero_room_on_free, g.settle_ms),
        fault=f.kind, fault_at=f.at_request, fault_every=f.every,
        percentiles=tuple(cfg.report.percentiles))

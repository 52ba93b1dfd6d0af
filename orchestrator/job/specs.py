"""The checked config and its plan, turned once into a job's frozen specs (`build_specs`):
the endpoints' (orchestrator.handoff.specs, which cross into the endpoint processes), the
report's (orchestrator.results.report_spec) and what the runner itself reads. The one place
that reads the config for a job: the app, the bench and the ladder build the specs here, and
the runner (orchestrator.job.runner) is handed them, never the config. A spec copies the
values its component reads, never a config section (the runner's own reads keep its
transport, endpoints and faults sections: `JobSpecs`; its bootstrap reads a BootstrapSpec)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from orchestrator.handoff.specs import (
    BootstrapSpec,
    BufferSpec,
    DecodeLoadSpec,
    DecodeSpec,
    EngineSpec,
    FaultSpec,
    GateSpec,
    LayoutField,
    LayoutSpec,
    PrefillSpec,
    SideSpec,
    WorkloadSpec,
)
from orchestrator.profile import rules
from orchestrator.profile.config import (
    BuffersConfig,
    DecodeLoadConfig,
    EndpointsConfig,
    FaultsConfig,
    GateConfig,
    LayoutConfig,
    LoggingConfig,
    OrchestratorConfig,
    TransportConfig,
    VerifyConfig,
    WorkloadConfig,
    draw_seed,
)
from orchestrator.profile.kinds import Role
from orchestrator.profile.plan import Plan, Platform
from orchestrator.results.report_spec import (
    ReportConsole,
    ReportGate,
    ReportLoad,
    ReportRanks,
    ReportRows,
    ReportSend,
    ReportSpec,
)
from orchestrator.results.schema import PlanInfo


@dataclass(frozen=True)
class JobSpecs:
    """One job, as the runner reads it: its plan, every prefill rank's and every decode
    process's spec, the report's, and the runner's own reads (its role; the transport and
    endpoints sections; its bootstrap's spec; the fault it carries out; the run's secret)."""

    plan: Plan
    prefill: PrefillSpec
    decode: DecodeSpec
    report: ReportSpec
    role: Role
    transport: TransportConfig  # the runner's metadata server, hosts and watchdog
    endpoints: EndpointsConfig  # ranks, TP and start-up bounds
    bootstrap: BootstrapSpec  # a split run's bootstrap (role=decode's server, role=prefill's lookup)
    faults: FaultsConfig  # the process fault the runner carries out
    secret: bytes = dataclasses.field(repr=False)  # the run's (rules.Checked.secret): its children's too

    def seeded(self) -> JobSpecs:
        """workload.seed=null: these specs with this run's seed drawn (profile.config.
        draw_seed), in the prefills' workload and the report alike; a pinned seed: these."""
        if self.prefill.workload.seed is not None:
            return self
        seed = draw_seed()
        load = dataclasses.replace(self.report.load, seed=seed)
        return dataclasses.replace(
            self, prefill=dataclasses.replace(self.prefill, workload=dataclasses.replace(
                self.prefill.workload, seed=seed)), report=dataclasses.replace(self.report, load=load))


def build_specs(cfg: OrchestratorConfig, plan: Plan | Platform) -> JobSpecs:
    """A job's specs, from its validated config and its plan: a Platform to plan on through
    the rule book (the run's: ConfigError naming the first rule broken), or a Plan made
    beforehand, taken as given (the bench's paths, a test's). What the specs read of the plan
    comes with it, in one call: rules.Checked. workload.seed as configured: a null one is
    drawn when the job starts (JobSpecs.seeded)."""
    t, e = cfg.transport, cfg.endpoints
    if isinstance(plan, Platform):
        checked = rules.check_job(transport=t, workload=cfg.workload, endpoints=e, gate=cfg.gate,
                                  mem_pool=cfg.mem_pool, role=cfg.role, faults=cfg.faults, digest=cfg.verify.digest,
                                  buffers=cfg.buffers, layout=cfg.layout, platform=plan)
    else:
        checked = rules.checked(plan, cfg.buffers, cfg.layout, t.secret_env)
    plan = checked.plan
    side, faults = side_spec(cfg.buffers, cfg.layout, t), fault_spec(cfg.faults)
    prefill = PrefillSpec(
        plan=plan, ranks=e.prefill_ranks, side=side, workload=workload_spec(cfg.workload), faults=faults,
        digest=cfg.verify.digest, poll=e.poll, timeout_s=t.timeout_s, coalesce=t.coalesce, status=t.status,
        set_buf=cfg.buffers.set_buf, max_inflight_sends=t.max_inflight_sends,
        max_inflight_blocks=t.max_inflight_blocks, nap_us=t.mooncake.nap_us, address_check=t.address_check,
        max_batch=max(cfg.workload.batch_size, cfg.bench.batch_size), console=cfg.logging.console)
    decode = DecodeSpec(
        plan=plan, ranks=e.decode_ranks, tp=e.decode_tp, side=side, gate=gate_spec(cfg.gate), faults=faults,
        load=load_spec(e.decode_load, e), digest=cfg.verify.digest, poll=e.poll, host=t.host, timeout_s=t.timeout_s,
        startup_timeout_s=e.startup_timeout_s, watch_prefills=cfg.role is Role.decode,
        console=cfg.logging.console)
    report = ReportSpec(
        role=cfg.role, rows=report_rows(cfg.buffers.size, checked.fields, cfg.layout, cfg.verify),
        plan=PlanInfo(checked.record),
        load=report_load(cfg.workload), ranks=ReportRanks(e.prefill_ranks, e.decode_ranks, e.decode_tp),
        send=report_send(t), gate=report_gate(cfg.gate),
        fault=cfg.faults.kind, fault_at=cfg.faults.at_request, fault_every=cfg.faults.every,
        percentiles=tuple(cfg.report.percentiles), console=report_console(cfg.logging))
    return JobSpecs(plan, prefill, decode, report, cfg.role, t, e, bootstrap_spec(t, e, cfg.layout.name, cfg.peer),
                    cfg.faults, checked.secret)


def bootstrap_spec(t: TransportConfig, e: EndpointsConfig, layout: str, peer: Optional[str]) -> BootstrapSpec:
    """What a split run's bootstrap reads (`layout`: layout.name; `peer`: role=prefill's)."""
    return BootstrapSpec(t.host, t.bootstrap_port, t.bootstrap_file, t.secret_env, t.timeout_s, t.address_check,
                         e.prefill_ranks, e.startup_timeout_s, layout, peer)


def layout_spec(layout: LayoutConfig) -> LayoutSpec:
    """The layout declaration, frozen."""
    return LayoutSpec(layout.name, tuple(LayoutField(f.name, f.dtype, f.width, f.present, f.fill, f.role, f.get_buf)
                                         for f in layout.fields))


def buffer_spec(b: BuffersConfig) -> BufferSpec:
    return BufferSpec(b.size, b.hidden_size, b.hidden_states_dtype, b.max_top_logprobs_num,
                      b.output_dsa_topk_indices_dim, b.max_sampling_mask_tokens, b.enable_sampling_mask,
                      b.kv_checksum_enabled)


def side_spec(b: BuffersConfig, layout: LayoutConfig, t: TransportConfig) -> SideSpec:
    """What a process's buffers and engine are built from (endpoints.common.build_side)."""
    mc = t.mooncake
    return SideSpec(buffer_spec(b), layout_spec(layout),
                    EngineSpec(t.host, mc.metadata_server, mc.device_name, mc.max_blocks_per_batch))


def workload_spec(w: WorkloadConfig) -> WorkloadSpec:
    return WorkloadSpec(w.requests, w.concurrency, w.rate, w.batch_size, w.fill, w.duplicate_rooms,
                        w.return_logprob, w.top_logprobs_num, w.hidden_states, w.sampling_mask, w.multimodal,
                        w.dsa_indices, w.seed, w.duration_s, w.burstiness)


def gate_spec(g: GateConfig) -> GateSpec:
    return GateSpec(g.readiness, g.zero_room_on_free, g.settle_ms, g.read, g.never_landed_s)


def fault_spec(f: FaultsConfig) -> FaultSpec:
    return FaultSpec(f.kind, f.at_request, f.every, f.margin_us, f.rank)


def load_spec(d: DecodeLoadConfig, e: EndpointsConfig) -> DecodeLoadSpec:
    return DecodeLoadSpec(d.step_ms, d.idle_s, tuple(e.decode_gpus or [0]))


def report_load(w: WorkloadConfig) -> ReportLoad:
    """The load each prefill rank offered, as the report reads it."""
    return ReportLoad(w.requests, w.concurrency, w.rate, w.batch_size, w.fill, w.duplicate_rooms, w.seed,
                      w.duration_s, w.burstiness)


def report_rows(slots: int, fields: list[list[Any]], layout: LayoutConfig, verify: VerifyConfig) -> ReportRows:
    """The rows the report reads: slots, their bytes and fields (`fields`: a row's present
    ones, rules.Checked.fields), the layout, the digest."""
    return ReportRows(slots, sum(f[2] for f in fields), len(fields), layout.name, verify.digest)


def report_send(t: TransportConfig) -> ReportSend:
    return ReportSend(t.coalesce, t.status, t.max_inflight_blocks, t.secret_env)


def report_gate(g: GateConfig) -> ReportGate:
    return ReportGate(g.read, g.readiness, g.zero_room_on_free, g.settle_ms)


def report_console(lg: LoggingConfig) -> ReportConsole:
    return ReportConsole(lg.console, lg.progress, lg.progress_every_s)

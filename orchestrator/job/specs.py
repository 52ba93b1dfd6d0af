"""The checked config and its plan, turned once into the frozen specs that cross into the
endpoint processes (orchestrator.handoff.specs): the one place that reads the config for
them. A spec copies the values its component reads, never a config section; the runner
builds them when a job starts (`endpoint_specs`) and hands each child its own."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.handoff.specs import (
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
from orchestrator.profile.config import (
    BuffersConfig,
    DecodeLoadConfig,
    EndpointsConfig,
    FaultsConfig,
    GateConfig,
    LayoutConfig,
    OrchestratorConfig,
    TransportConfig,
    WorkloadConfig,
)
from orchestrator.profile.kinds import Role
from orchestrator.profile.plan import Plan


@dataclass(frozen=True)
class EndpointSpecs:
    """A job's two specs: every prefill rank's and every decode process's."""

    prefill: PrefillSpec
    decode: DecodeSpec


def endpoint_specs(cfg: OrchestratorConfig, plan: Plan) -> EndpointSpecs:
    """The specs of a job's endpoints, from its checked config (workload.seed resolved) and plan."""
    t, e = cfg.transport, cfg.endpoints
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
    return EndpointSpecs(prefill, decode)


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

"""`python -m orchestrator.bench [overrides]`: the bench's entry. It composes and checks the
profile as the main command does, builds the tool's spec from it once, and runs the tool, which
sees only that spec: every aux route side by side (orchestrator.sweep.bench, BenchSpec), or with
bench.phases=ladder the cost ladder (orchestrator.sweep.ladder, LadderSpec)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from orchestrator.job import failure
from orchestrator.job.check import check_profile
from orchestrator.job.specs import build_specs
from orchestrator.profile.config import (
    CONF_DIR,
    BenchPhases,
    ConfigError,
    EngineTransportSetting,
    FillMode,
    MemPoolType,
    MpsMode,
    OrchestratorConfig,
    RouteSetting,
    register_configs,
    validate,
)
from orchestrator.profile.plan import Device, Plan, Platform, Route
from orchestrator.profile.platform import detect
from orchestrator.sweep.bench import NO_MPS_PHASES, BenchSpec, Path_, run_bench

if TYPE_CHECKING:
    from orchestrator.sweep.ladder import LadderSpec


def _label(p: Plan) -> str:
    """A path's name in the tables: its route, rows and MPS."""
    where = p.buffer_device.value
    mps = (", MPS" if p.sharing.mps else ", no MPS") if p.sharing.shared else ""
    if p.route is Route.tcp:
        return f"tcp route (ZMQ), {where}->{where}{mps}"
    assert p.engine_transport is not None  # (the engine route)
    return f"engine {p.engine_transport.value}, {where}->{where}{mps}"


def bench_spec(cfg: OrchestratorConfig, platform: Platform) -> BenchSpec:
    """The bench's spec: the profile's plan, the bench's sizes, and the aux paths measured side
    by side, each a new config with the bench's sizes, checked on `platform`: the profile's
    engine path, its engine over tcp, host buffers over the engine, the tcp route (and a path's
    twin without MPS where it shares GPUs under MPS)."""
    b = cfg.bench
    selected = check_profile(cfg, platform)
    base = validate(replace(
        cfg, buffers=replace(cfg.buffers, size=max(cfg.buffers.size, 4 * b.batch_size + b.batch_size)),
        workload=replace(cfg.workload, requests=b.handoffs + 3 * b.requests + 2 * b.batched_requests),
        transport=replace(cfg.transport, timeout_s=max(cfg.transport.timeout_s, 10.0))))
    plan = check_profile(base, platform)
    t = base.transport
    engine_tcp = replace(t.mooncake, transport=EngineTransportSetting.tcp)
    host = replace(base.mem_pool, type=MemPoolType.NONE)
    todo: list[OrchestratorConfig] = []
    if plan.route is Route.engine:
        assert plan.engine_transport is not None  # (the engine route)
        todo.append(base)
        if plan.engine_transport.value != "tcp":
            todo.append(replace(base, transport=replace(t, mooncake=engine_tcp)))
        if plan.buffer_device is not Device.cpu:
            todo.append(replace(base, mem_pool=host,
                                transport=replace(t, route=RouteSetting.auto, mooncake=engine_tcp)))
    todo.append(replace(base, mem_pool=host, transport=replace(t, route=RouteSetting.tcp)))
    out: list[Path_] = []
    for c in todo:
        p = check_profile(c, platform)
        out.append(Path_(_label(p), build_specs(c, p)))
        if p.sharing.shared and p.sharing.mps:  # its twin without MPS: what time-slicing costs
            twin = replace(c, endpoints=replace(c.endpoints, mps=MpsMode.off))
            q = check_profile(twin, platform)
            if not q.sharing.mps:
                out.append(Path_(_label(q), build_specs(twin, q), NO_MPS_PHASES))
    return BenchSpec(selected, b.handoffs, b.requests, b.batched_requests, b.batch_size, b.iters, b.bulk_mib,
                     tuple(out))


def ladder_spec(cfg: OrchestratorConfig, platform: Platform, overrides: Sequence[str] = ()) -> LadderSpec:
    """The cost ladder's spec: the profile as every rung runs it (one in flight, rows filled
    ahead, bench.ladder_handoffs requests), checked on `platform`; `overrides`: the command
    line's (R7 runs the main command with them)."""
    from orchestrator.job.specs import gate_spec, side_spec, workload_spec
    from orchestrator.sweep.ladder import LadderSpec
    from orchestrator.sweep.ladder_pair import PairSpec

    b = cfg.bench
    w = replace(cfg.workload, concurrency=1, batch_size=1, fill=FillMode.ahead, rate=None,
                requests=b.ladder_handoffs, duration_s=None)
    job = validate(replace(cfg, workload=w))
    plan = check_profile(job, platform)
    pair = PairSpec(plan, side_spec(job.buffers, job.layout, job.transport), job.transport,
                    workload_spec(job.workload), gate_spec(job.gate), job.verify.digest, job.endpoints.poll,
                    b.ladder_handoffs)
    return LadderSpec(pair, build_specs(job, plan), job.transport.route, b.ladder_rounds, b.yardstick, tuple(overrides),
                      tuple(b.ladder_rungs) if b.ladder_rungs is not None else None)


register_configs()


def _bench(cfg: DictConfig) -> None:
    try:  # checked before Hydra started (compose.precheck); a sweep's jobs are checked here
        obj = validate(cfg)
        check_profile(obj, detect())
    except ConfigError as exc:
        failure.leave(exc)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if obj.bench.phases is BenchPhases.ladder:  # the cost ladder (orchestrator.sweep.ladder)
        from orchestrator.sweep.ladder import run_ladder

        try:
            run_ladder(ladder_spec(obj, detect(), list(HydraConfig.get().overrides.task)), run_dir)
        except ConfigError as exc:
            failure.leave(exc)
        return
    run_bench(bench_spec(obj, detect()), run_dir)


def _app(started: list[bool]) -> Callable[[], Any]:
    """Hydra's task function for this command: `started` says Hydra called it."""

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def bench(cfg: DictConfig) -> None:
        started.append(True)
        _bench(cfg)

    return bench


def main() -> None:
    """`python -m orchestrator.bench [overrides]`: refused as the main command refuses (one
    `error:` line, exit 2, no run dir), then Hydra runs the bench."""
    from orchestrator.preflight.compose import hydra_command

    # `phases=X` is short for bench.phases=X (phases=ladder: the cost ladder)
    sys.argv[1:] = [f"bench.{a}" if a.startswith("phases=") else a for a in sys.argv[1:]]
    started: list[bool] = []
    hydra_command(_app(started), sys.argv[1:], started=lambda: bool(started))

if __name__ == "__main__":
    main()

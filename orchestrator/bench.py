"""`python -m orchestrator.bench [overrides]`: the aux paths side by side, in one run.

For the selected profile it measures, on the same buffer shapes:
  (a) our send_aux on the engine route (AuxRouter.send_aux, the call the endpoints make),
  (b) the raw Mooncake batch_transfer_sync_write of exactly the same blocks, interleaved with
      (a) in chunks so drift hits both alike,
  (c) our tcp route (ZMQ AUX_DATA frames) on host buffers,
  (d) the engine over Mooncake's TCP transport (same buffers' device; plus host->host when
      the profile's buffers live on a GPU),
each with p50/p99/p999 and handoffs/s, the full-protocol handoff (send_aux -> status ->
decode verifies -> verdict back) per path, and a one-block bulk bandwidth point per engine
path. Every path runs in its own pair of processes, because Mooncake picks its transport
once per process from the MC_* environment. Results: bench.json and bench.md in the run dir.
"""

from __future__ import annotations

import copy
import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from .app import user_error
from .config import (ConfigError, EngineTransportSetting, MemPoolType, OrchestratorConfig,
                     RouteSetting, register_configs, validate)
from .logs import configure
from .plan import Device, Plan, Route, make_plan
from .platform import detect
from .stats import LatencyHistogram, percentile
from .runner import run_handoffs

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
CHUNK = 100


def _stats(samples_us: list[float]) -> dict[str, Any]:
    """Exact percentiles of back-to-back calls (one in flight); handoffs/s = n / sum."""
    if not samples_us:
        return {"n": 0}
    return {"n": len(samples_us), "p50": percentile(samples_us, 50),
            "p99": percentile(samples_us, 99), "p999": percentile(samples_us, 99.9),
            "mean": round(statistics.fmean(samples_us), 2),
            "handoffs_per_s": round(len(samples_us) / (sum(samples_us) / 1e6), 1)}


def _hist_stats(hist: dict) -> dict[str, Any]:
    """The same from a run's latency histogram (percentiles within 0.25%)."""
    h = LatencyHistogram.from_dict(hist)
    if not h.n:
        return {"n": 0}
    return {"n": h.n, **h.summary(), "mean": h.mean,
            "handoffs_per_s": round(h.n / (h.total / 1e6), 1)}


# ---- drivers: run inside the prefill process, after bootstrap ---------------------------------
def engine_driver(endpoint, conn, decode_info: dict) -> dict:
    """Protocol handoffs, then ours vs raw interleaved, then the bulk point."""
    import torch

    cfg: OrchestratorConfig = endpoint.cfg
    out: dict[str, Any] = {}
    out.update(_handoffs(endpoint, conn))

    router = endpoint.router
    raw = endpoint.side.engine.raw
    session = router.peer.session_id
    size = cfg.buffers.size
    for slot in range(size):  # rows hold real request data (from the run above or fresh)
        router.blocks(slot, slot)
    ours, rawt = [], []
    pc = time.perf_counter
    for start in range(0, cfg.bench.iters, CHUNK):
        n = min(CHUNK, cfg.bench.iters - start)
        for i in range(start, start + n):
            slot = i % size
            t0 = pc()
            d = router.send_aux(0, slot, slot)
            ours.append((pc() - t0) * 1e6)
            if d.outcome != "ok":
                raise RuntimeError(f"send_aux failed: {d.error}")
        for i in range(start, start + n):
            slot = i % size
            srcs, dsts, lens = router.blocks(slot, slot)
            t0 = pc()
            rc = raw.batch_transfer_sync_write(session, srcs, dsts, lens)
            rawt.append((pc() - t0) * 1e6)
            if rc != 0:
                raise RuntimeError(f"raw batch write returned {rc}")
    out["ours_us"], out["raw_us"] = ours, rawt

    bulk_ptr = decode_info.get("bulk_ptr")
    if bulk_ptr and cfg.bench.bulk_mib:
        nbytes = cfg.bench.bulk_mib << 20
        src = torch.ones(nbytes, dtype=torch.uint8, device=endpoint.buffers.device)
        endpoint.side.engine.register(src.data_ptr(), nbytes)
        raw.transfer_sync_write(session, src.data_ptr(), bulk_ptr, nbytes)  # warm-up
        times = []
        for _ in range(cfg.bench.bulk_reps):
            t0 = pc()
            rc = raw.transfer_sync_write(session, src.data_ptr(), bulk_ptr, nbytes)
            times.append(pc() - t0)
            if rc != 0:
                raise RuntimeError(f"bulk write returned {rc}")
        out["bulk"] = {"bytes": nbytes, "median_s": statistics.median(times),
                       "gb_per_s": round(nbytes / statistics.median(times) / 1e9, 2)}
    out["row_bytes"] = endpoint.buffers.row_bytes
    out["blocks"] = len(endpoint.buffers.item_lens)
    return out


def _handoffs(endpoint, conn) -> dict:
    """The configured handoffs through the full protocol (one in flight in the bench)."""
    wall = endpoint.run(conn)
    t = endpoint.tally
    return {"handoff_verified": t.outcomes.get("verified", 0), "handoff_total": t.count,
            "deliver_us": t.deliver_us.to_dict(), "handoff_wall_s": wall,
            "row_bytes": endpoint.buffers.row_bytes}


def tcp_route_driver(endpoint, conn, decode_info: dict) -> dict:
    out = _handoffs(endpoint, conn)
    out["send_us"] = endpoint.tally.send_us.to_dict()
    out["blocks"] = len(endpoint.buffers.item_lens)
    return out


# ---- phases -----------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    cfg: OrchestratorConfig
    plan: Plan
    driver: Any


def phases(cfg: OrchestratorConfig, platform) -> list[Phase]:
    base = copy.deepcopy(cfg)
    base.workload.requests = cfg.bench.handoffs
    base.workload.concurrency = 1
    plan = make_plan(base, platform)
    out: list[Phase] = []

    def variant(**changes) -> OrchestratorConfig:
        c = copy.deepcopy(base)
        for dotted, value in changes.items():
            obj = c
            *parents, leaf = dotted.split("__")
            for part in parents:
                obj = getattr(obj, part)
            setattr(obj, leaf, value)
        return c

    def label(p: Plan) -> str:
        where = p.buffer_device.value
        if p.route is Route.tcp:
            return f"tcp route (ZMQ), {where}->{where}"
        return f"engine {p.engine_transport.value}, {where}->{where}"

    if plan.route is Route.engine:
        out.append(Phase(label(plan), base, plan, engine_driver))
        if plan.engine_transport.value != "tcp":
            c = variant(transport__mooncake__transport=EngineTransportSetting.tcp)
            p = make_plan(c, platform)
            out.append(Phase(label(p), c, p, engine_driver))
        if plan.buffer_device is not Device.cpu:
            c = variant(mem_pool__type=MemPoolType.NONE, transport__route=RouteSetting.auto,
                        transport__mooncake__transport=EngineTransportSetting.tcp)
            p = make_plan(c, platform)
            out.append(Phase(label(p), c, p, engine_driver))
    c = variant(mem_pool__type=MemPoolType.NONE, transport__route=RouteSetting.tcp)
    p = make_plan(c, platform)
    out.append(Phase(label(p), c, p, tcp_route_driver))
    return out


def run_bench(cfg: OrchestratorConfig, run_dir: Path) -> dict[str, Any]:
    log = configure(run_dir, "bench", keep_root_handlers=True)
    platform = detect()
    results: dict[str, Any] = {"profile": make_plan(cfg, platform).as_dict(), "paths": []}
    for ph in phases(cfg, platform):
        phase_dir = run_dir / re.sub(r"[^A-Za-z0-9_.]+", "_", ph.name).strip("_")
        phase_dir.mkdir(parents=True, exist_ok=True)
        log.info("bench_phase", phase=ph.name, plan=ph.plan.as_dict())
        bulk = (cfg.bench.bulk_mib << 20) if ph.driver is engine_driver else 0
        out = run_handoffs(ph.cfg, ph.plan, phase_dir, driver=ph.driver, bulk_bytes=bulk)
        if out.error:
            results["paths"].append({"path": ph.name, "error": out.error})
            log.error("bench_phase_failed", phase=ph.name, error=out.error)
            continue
        x = out.tally
        entry: dict[str, Any] = {
            "path": ph.name, "transport": out.transports.get("prefill"),
            "row_bytes": out.row_bytes, "blocks": x["blocks"],
            "handoffs_verified": x["handoff_verified"], "handoffs_total": x["handoff_total"],
            "handoff": _hist_stats(x["deliver_us"]),
            "handoff_protocol_per_s": round(x["handoff_verified"] / x["handoff_wall_s"], 1),
            "decode_verify_us": out.decode_stats.get("verify_us"),
        }
        if "ours_us" in x:
            entry["ours_send_aux"] = _stats(x["ours_us"])
            entry["raw_batch_write"] = _stats(x["raw_us"])
            entry["ours_over_raw_p50"] = round(entry["ours_send_aux"]["p50"] / entry["raw_batch_write"]["p50"], 3)
        if "send_us" in x:
            entry["ours_send_aux"] = _hist_stats(x["send_us"])
        if "bulk" in x:
            entry["bulk"] = x["bulk"]
        results["paths"].append(entry)
    results["ratios"] = ratios(results["paths"])
    (run_dir / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (run_dir / "bench.md").write_text(table + "\n")
    print(table, flush=True)
    return results


def ratios(paths: list[dict]) -> dict[str, float]:
    ok = [p for p in paths if "error" not in p]
    first_engine = next((p for p in ok if "raw_batch_write" in p), None)
    tcp_route = next((p for p in ok if p["path"].startswith("tcp route")), None)
    out: dict[str, float] = {}
    for p in ok:
        if "ours_over_raw_p50" in p:
            out[f"ours/raw p50, {p['path']}"] = p["ours_over_raw_p50"]
    if first_engine and tcp_route:
        out[f"tcp route handoff p50 / {first_engine['path']} send_aux p50"] = round(
            tcp_route["handoff"]["p50"] / first_engine["ours_send_aux"]["p50"], 2)
        out[f"tcp route handoff p50 / {first_engine['path']} handoff p50"] = round(
            tcp_route["handoff"]["p50"] / first_engine["handoff"]["p50"], 2)
    return out


def markdown(results: dict) -> str:
    rows = ["| path | what is timed | p50 us | p99 us | p999 us | handoffs/s |",
            "|---|---|---|---|---|---|"]

    def row(path, what, s):
        rows.append(f"| {path} | {what} | {s.get('p50')} | {s.get('p99')} | {s.get('p999')} | "
                    f"{s.get('handoffs_per_s')} |")

    for p in results["paths"]:
        if "error" in p:
            rows.append(f"| {p['path']} | FAILED: {p['error']} | | | | |")
            continue
        if "raw_batch_write" in p:
            row(p["path"], "our send_aux (one batch write)", p["ours_send_aux"])
            row(p["path"], "raw batch_transfer_sync_write", p["raw_batch_write"])
        elif "ours_send_aux" in p:
            row(p["path"], "our send_aux (frames queued)", p["ours_send_aux"])
        row(p["path"], "handoff: send_aux -> status -> verified -> verdict", p["handoff"])
    bulk = [f"- {p['path']}: {p['bulk']['bytes'] >> 20} MiB one block, {p['bulk']['gb_per_s']} GB/s"
            for p in results["paths"] if "bulk" in p]
    lines = rows + ["", f"{results['paths'][0].get('row_bytes')} B per request in "
                        f"{results['paths'][0].get('blocks')} blocks", ""]
    lines += ["Bulk bandwidth (raw transfer_sync_write):"] + bulk + ["", "Ratios:"]
    lines += [f"- {k}: {v}" for k, v in results["ratios"].items()]
    return "\n".join(lines)


register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        obj = validate(cfg)
        make_plan(obj, detect())
    except ConfigError as exc:
        user_error(exc)
    run_bench(obj, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()

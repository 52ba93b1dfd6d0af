"""Where a run's wall time goes, call by call, across its processes (issue 39: what a handoff
one in flight spends between its step and its verdict, on both sides).

    python tools/call_trace.py run OUT [--spec NAME|LIST] -- python -m orchestrator ...
    python tools/call_trace.py report OUT [--anchor FUNC] [--skip N]

`run` puts tools/call_trace/ first on PYTHONPATH (its sitecustomize wraps the functions of the
spec in every Python process the command starts, forked ones included) and runs the command;
each process writes its calls to OUT/<pid>.json. A call costs the wrapper about a microsecond.
--spec: a preset (`one`: the one-in-flight path of both endpoints) or a comma list of
"module:Qual.name" (a trailing "!": the process writes its calls when that call returns, as well
as at exit: for a process the runner may kill after its last word).

`report` prints, per process, each function's calls, p50 and p90 duration (us) and its total
(ms); then, with --anchor (default: the prefill's form_step), the median handoff: for each
function, the median offset (us) of its first call's enter and exit after each anchor call
(anchors after the first N skipped; intervals longer than 5x the median dropped), on every
process, sorted by enter: the critical path of one in flight, both sides on one clock."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

PRESETS = {
    "one": [
        # prefill
        "orchestrator.handoff.endpoints.prefill_loop:PrefillLoop.run!",
        "orchestrator.handoff.endpoints.prefill_loop:PrefillLoop.form_step",
        "orchestrator.handoff.endpoints.prefill_loop:PrefillLoop.issue",
        "orchestrator.handoff.endpoints.prefill_loop:PrefillLoop.drain",
        "orchestrator.handoff.endpoints.prefill_loop:PrefillLoop.take_sent",
        "orchestrator.handoff.endpoints.prefill_loop:Book.flush",
        "orchestrator.handoff.digest:RowDigest.seal",
        "orchestrator.handoff.digest:RowDigest._seal_ahead",
        "orchestrator.handoff.digest:Sealed.result",
        "orchestrator.handoff.endpoints.prefill_loop:PrefillLoop._work",
        "orchestrator.handoff.endpoints.prefill_loop:PrefillLoop.judged",
        "orchestrator.handoff.endpoints.sender:ForwardStep.take_seal",
        "orchestrator.handoff.endpoints.sender:Sender.submit",
        "orchestrator.handoff.endpoints.sender:SendQueue.pump",
        "orchestrator.handoff.endpoints.sender:SendQueue._finish_oldest",
        "orchestrator.handoff.backends.mooncake.engine:MooncakeEngine.submit",
        "orchestrator.handoff.backends.mooncake.engine:MooncakeEngine.landed",
        "orchestrator.handoff.backends.common:AuxRouter.after_send",
        "orchestrator.handoff.backends.common:AuxRouter.after_step",
        "orchestrator.handoff.endpoints.prefill:PrefillEndpoint.log_decisions",
        "orchestrator.handoff.endpoints.links:Links.poll",
        "orchestrator.handoff.endpoints.links:Links.send",
        # decode
        "orchestrator.handoff.endpoints.decode:DecodeEndpoint.serve!",
        "orchestrator.handoff.endpoints.decode:DecodeEndpoint.take",
        "orchestrator.handoff.endpoints.decode_data:DataPlane.on_data",
        "orchestrator.handoff.endpoints.decode_control:Control.on_control",
        "orchestrator.handoff.digest:RowDigest._read_graph",
        "orchestrator.handoff.endpoints.decode_step:Stepper.step",
        "orchestrator.handoff.endpoints.decode_step:Stepper.step_one",
        "orchestrator.handoff.endpoints.judge:Rows.read_step",
        "orchestrator.handoff.endpoints.judge:Judge.clean",
        "orchestrator.handoff.digest:RowDigest.read_step",
        "orchestrator.handoff.endpoints.grants:Grants.flush",
        "orchestrator.handoff.endpoints.grants:Grants.arrive",
        "orchestrator.handoff.endpoints.decode_state:Replies.send",
        "orchestrator.handoff.endpoints.decode:DecodeEndpoint.on_timer",
    ],
}
ANCHOR = "orchestrator.handoff.endpoints.prefill_loop:PrefillLoop.form_step"


def run(out: Path, spec: str, cmd: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    names = PRESETS.get(spec, [s for s in spec.split(",") if s])
    env = dict(os.environ, CALL_TRACE=",".join(names), CALL_TRACE_OUT=str(out.resolve()))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "call_trace"), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.call(cmd, env=env)


def _short(name: str) -> str:
    return name.split(":", 1)[1]


def report(out: Path, anchor: str, skip: int) -> None:
    procs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    procs = [p for p in procs if p["calls"]]
    for p in procs:
        names = p["names"]
        print(f"== pid {p['pid']}: {p['cmd'][:110]}")
        by: dict[int, list[float]] = {}
        for f, _, t0, t1 in p["calls"]:
            by.setdefault(f, []).append((t1 - t0) / 1e3)
        print(f"   {'function':58s} {'calls':>8s} {'p50 us':>9s} {'p90 us':>9s} {'total ms':>10s}")
        for f, ds in sorted(by.items(), key=lambda kv: -sum(kv[1])):
            ds.sort()
            print(f"   {_short(names[f]):58s} {len(ds):8d} {ds[len(ds) // 2]:9.1f} {ds[int(len(ds) * .9)]:9.1f} "
                  f"{sum(ds) / 1e3:10.1f}")
    starts = sorted(t0 for p in procs for f, _, t0, _ in p["calls"] if p["names"][f] == anchor)[skip:]
    if len(starts) < 3:
        print(f"(fewer than 3 calls of {anchor}: no median handoff)")
        return
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    med = statistics.median(gaps)
    keep = [(a, b) for a, b in zip(starts, starts[1:]) if b - a <= 5 * med]
    offs: dict[tuple[int, str], tuple[list[float], list[float]]] = {}
    for pi, p in enumerate(procs):
        calls = sorted(p["calls"], key=lambda c: c[2])
        j = 0
        for a, b in keep:
            while j < len(calls) and calls[j][2] < a:
                j += 1
            seen: set[int] = set()
            k = j
            while k < len(calls) and calls[k][2] < b:
                f, _, t0, t1 = calls[k]
                if f not in seen:
                    seen.add(f)
                    e = offs.setdefault((pi, p["names"][f]), ([], []))
                    e[0].append((t0 - a) / 1e3)
                    e[1].append((t1 - a) / 1e3)
                k += 1
    print(f"\n== the median handoff: {len(keep)} intervals between calls of {_short(anchor)} "
          f"(median {med / 1e3:.1f} us); first call of each function in an interval")
    print(f"   {'proc':>7s} {'function':58s} {'in':>6s} {'enter us':>9s} {'exit us':>9s}")
    rows = []
    for (pi, name), (en, ex) in offs.items():
        rows.append((statistics.median(en), statistics.median(ex), procs[pi]["pid"], name, len(en)))
    for en, ex, pid, name, n in sorted(rows):
        print(f"   {pid:7d} {_short(name):58s} {n * 100 // len(keep):5d}% {en:9.1f} {ex:9.1f}")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "run":
        out, rest = Path(argv[1]), argv[2:]
        spec = "one"
        if rest[:1] == ["--spec"]:
            spec, rest = rest[1], rest[2:]
        if rest[:1] != ["--"] or len(rest) < 2:
            print(__doc__)
            return 2
        return run(out, spec, rest[1:])
    if len(argv) >= 2 and argv[0] == "report":
        anchor, skip, rest = ANCHOR, 50, argv[2:]
        while rest:
            if rest[0] == "--anchor" and len(rest) > 1:
                anchor, rest = rest[1], rest[2:]
            elif rest[0] == "--skip" and len(rest) > 1:
                skip, rest = int(rest[1]), rest[2:]
            else:
                print(__doc__)
                return 2
        report(Path(argv[1]), anchor, skip)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

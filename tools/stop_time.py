"""How fast a run stops: start `python -m orchestrator workload.requests=100000`, let the
handoffs run, send SIGINT or SIGTERM to the main process or to its whole process group (what
a terminal's Ctrl-C, `timeout`, systemd, Slurm and Kubernetes send), and time the exit. The
goal (README, exit codes): 130 / 143 within 2 s, failed <= what was in flight, no `None`.
tests/test_honest_verdicts.py asserts the behaviour with a bound that holds on a loaded box; this
measures the speed.

    python tools/stop_time.py [--signal SIGTERM] [--group] [--runs 5] [OVERRIDES ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.results.schema import Results  # noqa: E402


def once(sig: signal.Signals, group: bool, overrides: list[str], wait_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="stop-time-") as tmp:
        run_dir = Path(tmp) / "run"
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "workload.requests=100000", *overrides,
                                 f"hydra.run.dir={run_dir}"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 120
        while not list(run_dir.glob("requests*.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(wait_s)
        (os.killpg if group else os.kill)(proc.pid, sig)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=120)
        stop_s = time.monotonic() - t0
        res = Results.read(run_dir)
        return {"stop_s": round(stop_s, 2), "rc": proc.returncode, "verified": res.verified,
                "failed": res.failed, "not_started": res.not_started,
                "in_flight_max": res.workload.in_flight_max,
                "none_in_summary": "None" in out, "traceback": "Traceback" in out + err,
                "load": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--signal", default="SIGTERM", choices=["SIGINT", "SIGTERM"])
    ap.add_argument("--group", action="store_true", help="signal the whole process group")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--after", type=float, default=1.0, help="seconds of handoffs before the signal")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    sig = signal.Signals[args.signal]
    runs = []
    for _ in range(args.runs):
        r = once(sig, args.group, args.overrides, args.after)
        runs.append(r)
        print(json.dumps(r), flush=True)
    times = [r["stop_s"] for r in runs]
    ok = all(r["rc"] == 128 + sig and r["failed"] <= r["in_flight_max"] and not r["none_in_summary"]
             and not r["traceback"] for r in runs)
    print(f"{args.signal} to the {'group' if args.group else 'main process'}: stop {min(times)}-{max(times)} s "
          f"(median {statistics.median(times)}) over {len(runs)} runs, load {runs[-1]['load']:.1f}; "
          f"{'every run' if ok else 'NOT every run'} exited {128 + sig} with failed <= in flight and no None")
    return 0 if ok and max(times) <= 2.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

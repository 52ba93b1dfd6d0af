"""Start-up figures (issue 37), so anyone can re-measure them: the median of N runs (default
5) of each command's wall time, with the machine's load average beside them.

    python tools/startup_figures.py                 # this tree's code
    python tools/startup_figures.py --runs 3 --label before --pythonpath /path/to/old/tree
    python tools/startup_figures.py --make-run /path/to/set-up/clone   # also `make run` there
    python tools/startup_figures.py --spawn         # children started as fresh interpreters

Figures: `--help` wall; a refusal's wall (an unknown key); the default run's wall
(`python -m orchestrator`), its start-up (results.json startup_s) and each process's start-up
phases (results.json startup_phases, where the code has them); optionally `make run` on a
set-up clone. Goals on a quiet 2-core box: --help and a refusal <= 1.0 s, the default run's
start-up <= 1.5 s and wall <= 4 s, `make run` <= 5 s. A benchmark, not a test: on a loaded box
the figures swell, which is why the load is printed with them."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _timed(cmd: list[str], env: dict[str, str], cwd: Path, ok: tuple[int, ...]) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.monotonic() - t0
    if proc.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}")
    return wall


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 2)


def _spread(xs: list[float]) -> str:
    return f"{_median(xs)} s (min {min(xs):.2f}, max {max(xs):.2f})"


def _phases(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per process and phase, the median over the runs that have it."""
    acc: dict[str, dict[str, list[float]]] = {}
    for res in runs:
        for proc, phases in (res.get("startup_phases") or {}).items():
            for phase, s in phases.items():
                acc.setdefault(proc, {}).setdefault(phase, []).append(s)
    return {p: {ph: _median(v) for ph, v in d.items()} for p, d in acc.items()}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs of each command (the median is printed)")
    ap.add_argument("--pythonpath", default=str(ROOT), help="the tree whose orchestrator is measured")
    ap.add_argument("--python", default=sys.executable, help="the interpreter (a venv's python)")
    ap.add_argument("--label", default="", help="a name for this row (before, after, ...)")
    ap.add_argument("--make-run", metavar="CLONE", help="also time `make run` in this set-up clone")
    ap.add_argument("--spawn", action="store_true",
                    help="children as fresh interpreters (ORCHESTRATOR_START_METHOD=spawn)")
    ap.add_argument("--no-run", action="store_true", help="only --help and the refusal")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = ap.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": args.pythonpath}
    if args.spawn:
        env["ORCHESTRATOR_START_METHOD"] = "spawn"
    py, cwd = args.python, Path(args.pythonpath)
    loads = [_load()]
    helps = [_timed([py, "-m", "orchestrator", "--help"], env, cwd, (0,)) for _ in range(args.runs)]
    loads.append(_load())
    refusals = [_timed([py, "-m", "orchestrator", "workload.requets=10"], env, cwd, (2,)) for _ in range(args.runs)]
    loads.append(_load())
    walls: list[float] = []
    results: list[dict[str, Any]] = []
    if not args.no_run:
        with tempfile.TemporaryDirectory(prefix="startup-figures-") as tmp:
            for i in range(args.runs):
                run_dir = Path(tmp) / f"run{i}"
                walls.append(_timed([py, "-m", "orchestrator", f"hydra.run.dir={run_dir}"], env, cwd, (0,)))
                results.append(json.loads((run_dir / "results.json").read_text()))
                loads.append(_load())
    makes: list[float] = []
    if args.make_run:
        for _ in range(args.runs):
            makes.append(_timed(["make", "run"], {**os.environ}, Path(args.make_run), (0,)))
            loads.append(_load())
    startups = [r["startup_s"] for r in results if r.get("startup_s") is not None]
    out: dict[str, Any] = {
        "label": args.label, "pythonpath": args.pythonpath, "runs": args.runs,
        "start_method": "spawn" if args.spawn else "default",
        "help_s": _median(helps), "refusal_s": _median(refusals),
        "run_wall_s": _median(walls) if walls else None,
        "run_startup_s": _median(startups) if startups else None,
        "run_handoffs_s": _median([r["wall_s"] for r in results if r.get("wall_s")]) if results else None,
        "run_startup_phases_s": _phases(results),
        "make_run_s": _median(makes) if makes else None,
        "load_avg_1_5_15": loads,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"startup figures {args.label or ''} ({args.pythonpath}, median of {args.runs}, "
          f"cpus {os.cpu_count()}):".replace("  ", " "))
    print(f"  --help          {_spread(helps)}")
    print(f"  refusal         {_spread(refusals)}   (workload.requets=10, exit 2)")
    if walls:
        print(f"  default run     wall {_spread(walls)}; start-up {out['run_startup_s']} s; "
              f"handoffs {out['run_handoffs_s']} s")
        for proc, phases in out["run_startup_phases_s"].items():
            print(f"    {proc:<14}" + ", ".join(f"{k} {v:g}" for k, v in phases.items()))
    if makes:
        print(f"  make run        {_spread(makes)}   ({args.make_run})")
    print(f"  load average (1/5/15 min) before, then after each figure: {' | '.join(loads)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

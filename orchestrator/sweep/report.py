"""`python -m orchestrator.report SWEEP_DIR`: rebuild a sweep's summary.csv, .md and .png; exit
as the sweep did (the worst job's code: a failed row is not a 0).
`python -m orchestrator.report PREFILL_RUN_DIR DECODE_RUN_DIR`: one summary of a run split
across hosts (each side's results.json, merged)."""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.preflight.compose import OneLineParser
from orchestrator.results.reporting import merge, rel
from orchestrator.results.schema import Results
from orchestrator.sweep.sweep import SweepError, summarize, sweep_status, worst_exit


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="python -m orchestrator.report",
        description="Rebuild the summary of a Hydra sweep dir, or merge the run dirs of the two "
                    "sides of a run across hosts into one summary.")
    parser.add_argument("dirs", type=Path, nargs="+", metavar="DIR",
                        help="a sweep dir (outputs/multirun/<date>/<time>), or two run dirs")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m orchestrator.report SWEEP_DIR`: rebuild summary.csv, .md and .png;
    `python -m orchestrator.report PREFILL_RUN_DIR DECODE_RUN_DIR`: one summary of a run
    split across hosts."""
    args = build_parser().parse_args(argv)
    if len(args.dirs) == 2:
        try:
            a, b = (Results.read(d) for d in args.dirs)
            text, ok = merge(a, b)
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
        print(text, flush=True)
        return 0 if ok else 1
    if len(args.dirs) != 1:
        print("error: one sweep dir, or two run dirs", file=sys.stderr, flush=True)
        return 2
    try:
        paths = summarize(args.dirs[0])
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    for path in paths:
        print(rel(path), flush=True)
    print(sweep_status(args.dirs[0]), file=sys.stderr, flush=True)  # (stdout: the files)
    return worst_exit(args.dirs[0]) or 0  # as the sweep exited: a failed row is not a 0



if __name__ == "__main__":
    raise SystemExit(main())

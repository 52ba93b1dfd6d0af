"""`python -m orchestrator.report SWEEP_DIR`: rebuild a sweep's summary.csv, .md and .png; exit
1 when a row is not ok (failed, interrupted, refused or lost, or a combination not run), 0 when every
row is ok, 2 on bad input.
`python -m orchestrator.report PREFILL_RUN_DIR DECODE_RUN_DIR`: one summary of a run split
across hosts (each side's results.json, merged)."""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.job import failure
from orchestrator.preflight.compose import OneLineParser
from orchestrator.results.reporting import merge, rel
from orchestrator.results.schema import Results
from orchestrator.sweep.sweep import SweepError, not_ok, summarize, sweep_status

EXIT_ROW_NOT_OK = 1


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
            return failure.tell(failure.Refusal(str(exc)))
        print(text, flush=True)
        return 0 if ok else 1
    if len(args.dirs) != 1:
        return failure.tell(failure.Refusal("one sweep dir, or two run dirs"))
    try:
        paths = summarize(args.dirs[0])
    except SweepError as exc:
        return failure.tell(failure.Refusal(str(exc)))
    for path in paths:
        print(rel(path), flush=True)
    print(sweep_status(args.dirs[0]), file=sys.stderr, flush=True)  # (stdout: the files)
    return EXIT_ROW_NOT_OK if not_ok(args.dirs[0]) else 0  # a failed, lost or unrun row is not a 0



if __name__ == "__main__":
    raise SystemExit(main())

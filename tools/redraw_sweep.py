"""Redraw a sweep picture (docs/*-rate-sweep.png, docs/sweep-example.png) from the table a
doc quotes for it, with the plot code of this checkout (orchestrator.sweep.sweep): the measured numbers stay
the table's, only the drawing changes. A sweep run itself draws the same picture from its
job dirs (summary.png).

    python tools/redraw_sweep.py "### Latency against offered load (CPU)" docs/cpu-rate-sweep.png \
        --title "CPU box, commit b7ca42f"

The section's first table needs the columns `offered /s`, `mem_pool / route`, `verified`
(`n/n`), `handoffs/s` and `e2e p50 us` (with any suffix); `e2e p99 us` when present. With
`--summary-md` the table is a sweep's own summary.md (docs/sweeps.md quotes one): its columns
are the rows as the sweep wrote them, and any sweep's picture is drawn again from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.results.schema import RunStatus  # noqa: E402
from orchestrator.sweep import sweep  # noqa: E402


def table(text: str, heading: str) -> list[dict[str, str]]:
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    block = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        block.append([c.strip() for c in ln.strip("|").split("|")])
    head, body = block[0], block[2:]  # block[1] is the |---| line
    return [dict(zip(head, b)) for b in body]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("heading", help="the BENCHMARKS.md heading above the table")
    ap.add_argument("out", type=Path)
    ap.add_argument("--title", required=True, help="what the picture's title names instead of a run dir")
    ap.add_argument("--doc", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--summary-md", action="store_true", help="the table is a sweep's summary.md")
    args = ap.parse_args(argv)
    rows = table(args.doc.read_text(), args.heading)
    if args.summary_md:
        cols = list(rows[0])
        swept = cols[1:cols.index("status")]
        parsed = [{k: (None if v == "" else int(v) if k in ("job", "requests", "verified")
                       else RunStatus(v) if k == "status" else v)
                   for k, v in r.items()} for r in rows]
        sweep._write_png(args.out, Path(args.title), swept, parsed)
        print(json.dumps({"rows": len(parsed), "out": str(args.out)}))
        return 0
    out_rows = []
    for i, r in enumerate(rows):
        r = {("e2e p50 us" if k.startswith("e2e p50") else k): v for k, v in r.items()}
        pool, route = [x.strip() for x in r["mem_pool / route"].split("/")]
        verified, requests = (int(x) for x in r["verified"].split("/"))
        out_rows.append({
            "job": i, sweep.RATE_KEY: r["offered /s"].replace(",", ""), "override:mem_pool": pool,
            "status": RunStatus.ok if verified == requests else RunStatus.failed, "requests": requests,
            "verified": verified, "mem_pool": pool, "route": route,
            "handoffs_per_s": float(r["handoffs/s"].replace(",", "")),
            "e2e_p50_us": float(r["e2e p50 us"].replace(",", "")),
            "e2e_p99_us": float(r["e2e p99 us"].replace(",", "")) if r.get("e2e p99 us") else None,
        })
    # a one-part path: the title names it as given (orchestrator.results.plots.short_dir)
    sweep._write_png(args.out, Path(args.title), [sweep.RATE_KEY, "override:mem_pool"], out_rows)
    print(json.dumps({"rows": len(out_rows), "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

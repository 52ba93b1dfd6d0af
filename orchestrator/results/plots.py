"""Plots shared by a run (latency.png: where its latencies lie) and a sweep (summary.png).

Matplotlib runs headless (Agg) and is imported only when a plot is drawn.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Protocol

from orchestrator.results.rundir import RunFiles

LATENCY_PNG = "latency.png"


class LatencyMarks(Protocol):
    """A metric's measured percentiles, as results.Percentiles gives them."""

    @property
    def measured(self) -> bool: ...

    @property
    def p50(self) -> Optional[float]: ...

    @property
    def p99(self) -> Optional[float]: ...

    @property
    def p999(self) -> Optional[float]: ...

QUANTILES = ((0.5, "p50"), (0.99, "p99"), (0.999, "p999"))


def pyplot():
    """matplotlib.pyplot on the headless backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


METRICS = {"send_aux": "send_us", "taken": "taken_us", "handoff": "handoff_us", "from arrival": "e2e_us"}


def run_latencies(run_dir: Path, arrival: bool = False) -> dict[str, dict[str, list[float]]]:
    """{metric: {route: values}} from a run dir's requests*.jsonl: send_aux for every send
    that finished, taken (forward step done -> the decode's readiness gate passed; where
    the records have it) and handoff (-> the decode's verdict) for verified requests, and
    with `arrival` (an open-loop run) the latency from arrival of verified requests."""
    metrics = {m: k for m, k in METRICS.items() if arrival or m != "from arrival"}
    out: dict[str, dict[str, list[float]]] = {m: {} for m in metrics}
    for path in RunFiles(run_dir).all_requests():
        with open(path) as fh:
            for line in fh:
                if not line.endswith("\n"):
                    continue  # a torn last line
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                route = rec.get("route") or "none"
                for metric, key in metrics.items():
                    value = rec.get(key)
                    if value is None or (metric != "send_aux" and rec.get("outcome") != "verified"):
                        continue
                    out[metric].setdefault(route, []).append(float(value))
    if not out["taken"]:  # records from before the taken time existed
        del out["taken"]
    return out


def percentiles(values) -> dict[str, Optional[float]]:
    """p50/p99/p999 the way results.json has them (orchestrator.stats.LatencyHistogram), so
    a plot marks exactly the numbers the summary prints."""
    from orchestrator.results.stats import LatencyHistogram

    return LatencyHistogram(values).summary()


def latency_cdf(path: Path, data: dict[str, dict[str, list[float]]], title: str,
                marks: Optional[dict[str, LatencyMarks]] = None) -> Optional[Path]:
    """One panel per metric: the CDF of each route's latencies on a log x axis, its p50, p99
    and p999 marked and labelled beside their lines, below the curve (where a CDF leaves
    room), the legend under the panel. `marks` ({metric: LatencyMarks}, the job's
    latency_us) are the summary's own percentiles: a panel of one route marks those; several
    routes get theirs from the same computation. Returns the path, or None when nothing was
    measured."""
    panels = [(metric, routes) for metric, routes in data.items() if any(routes.values())]
    if not panels:
        return None
    plt = pyplot()
    from matplotlib import ticker

    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 5.2), squeeze=False)
    for ax, (metric, routes) in zip(axes[0], panels):
        drawn = [(r, v) for r, v in sorted(routes.items()) if v]
        for k, (route, values) in enumerate(drawn):
            xs = sorted(values)
            n = len(xs)
            ys = [(i + 1) / n for i in range(n)]
            step = max(1, n // 4000)  # the curve needs no more points than pixels
            given = (marks or {}).get(metric) if len(drawn) == 1 else None
            pcts = given if given and given.measured else SimpleNamespace(**percentiles(xs))
            shown = [(name, getattr(pcts, name), q) for q, name in QUANTILES
                     if getattr(pcts, name) is not None and n * (1 - q) >= 1]
            label = f"{route} (n={n:,}): " + ", ".join(f"{name} {x:,.0f}" for name, x, _ in shown) + " us"
            line, = ax.plot(xs[::step] + [xs[-1]], ys[::step] + [1.0], label=label)
            span = math.log(max(xs[-1], xs[0] * 1.01) / xs[0])
            for j, (name, x, q) in enumerate(shown):
                ax.axvline(x, color=line.get_color(), linestyle=":", linewidth=0.9)
                ax.plot([x], [q], marker="o", markersize=4, color=line.get_color())
                # low, beside its line: the CDF is above q >= 0.5 there, so the text meets no
                # curve; on the left when the next mark is too close on the right
                nxt = shown[j + 1][1] if j + 1 < len(shown) else None
                prev = shown[j - 1][1] if j else None
                crowded = nxt is not None and math.log(nxt / x) < 0.05 * span
                left = crowded and (prev is None or math.log(x / prev) > 0.05 * span) and j > 0
                ax.text(x, 0.03 + 0.16 * k, f"{name} {x:,.0f}" if left else f" {name} {x:,.0f}",
                        rotation=90, va="bottom", ha="right" if left else "left",
                        fontsize="x-small", color=line.get_color())
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_ylim(0, 1.02)
        ax.set_xlabel(f"{metric} latency (us, log scale)")
        ax.set_ylabel("fraction of requests (CDF)")
        ax.set_title(f"{metric}" + (" (verified)" if metric != "send_aux" else " (every send)"), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_latency_png(run_dir: Path, title: str, marks: Optional[dict[str, LatencyMarks]] = None,
                    arrival: bool = False) -> Optional[Path]:
    return latency_cdf(Path(run_dir) / LATENCY_PNG, run_latencies(run_dir, arrival), title, marks)


def short_dir(path) -> str:
    """A run or sweep dir as a title names it: its last two parts (outputs/<date>/<time>),
    never a temp dir's whole path."""
    parts = Path(path).parts
    return "/".join(parts[-2:]) if len(parts) >= 2 else str(path)

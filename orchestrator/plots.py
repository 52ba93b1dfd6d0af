"""Plots shared by a run (latency.png: where its latencies lie) and a sweep (summary.png).

Matplotlib runs headless (Agg) and is imported only when a plot is drawn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

LATENCY_PNG = "latency.png"
QUANTILES = ((0.5, "p50"), (0.99, "p99"), (0.999, "p999"))


def pyplot():
    """matplotlib.pyplot on the headless backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_latencies(run_dir: Path) -> dict[str, dict[str, list[float]]]:
    """{metric: {route: values}} from a run dir's requests*.jsonl: send_aux for every send
    that finished, taken (forward step done -> the decode's readiness gate passed) and handoff
    (-> the decode's verdict) for verified requests."""
    out: dict[str, dict[str, list[float]]] = {"send_aux": {}, "taken": {}, "handoff": {}}
    for path in sorted(Path(run_dir).glob("requests*.jsonl")):
        with open(path) as fh:
            for line in fh:
                if not line.endswith("\n"):
                    continue  # a torn last line
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                route = rec.get("route") or "none"
                if rec.get("send_us") is not None:
                    out["send_aux"].setdefault(route, []).append(float(rec["send_us"]))
                if rec.get("outcome") == "verified":
                    for key, metric in (("taken_us", "taken"), ("handoff_us", "handoff")):
                        if rec.get(key) is not None:
                            out[metric].setdefault(route, []).append(float(rec[key]))
    return out


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def latency_cdf(path: Path, data: dict[str, dict[str, list[float]]], title: str) -> Optional[Path]:
    """One panel per metric: the CDF of each route's latencies on a log x axis, its p50, p99
    and p999 marked and labelled. Returns the path, or None when nothing was measured."""
    panels = [(metric, routes) for metric, routes in data.items() if any(routes.values())]
    if not panels:
        return None
    plt = pyplot()
    from matplotlib import ticker

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.6), squeeze=False)
    for ax, (metric, routes) in zip(axes[0], panels):
        for route, values in sorted(routes.items()):
            if not values:
                continue
            xs = sorted(values)
            n = len(xs)
            ys = [(i + 1) / n for i in range(n)]
            step = max(1, n // 4000)  # the curve needs no more points than pixels
            marks = [(_quantile(xs, q), q, name) for q, name in QUANTILES if n * (1 - q) >= 1]
            label = f"{route} (n={n}): " + ", ".join(f"{name} {x:,.0f}" for x, _, name in marks) + " us"
            line, = ax.plot(xs[::step] + [xs[-1]], ys[::step] + [1.0], label=label)
            for x, q, name in marks:
                ax.axvline(x, color=line.get_color(), linestyle=":", linewidth=0.8)
                ax.plot([x], [q], marker="o", color=line.get_color())
                ax.annotate(name, (x, q), textcoords="offset points", xytext=(4, -12 if q > 0.9 else 4),
                            fontsize="x-small", color=line.get_color())
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_ylim(0, 1.02)
        ax.set_xlabel(f"{metric} latency (us, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{metric}: CDF per route" + (" (verified)" if metric in ("taken", "handoff") else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="x-small", loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_latency_png(run_dir: Path, title: str) -> Optional[Path]:
    return latency_cdf(Path(run_dir) / LATENCY_PNG, run_latencies(run_dir), title)

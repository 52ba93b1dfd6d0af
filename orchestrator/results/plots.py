"""Plots shared by a run (latency.png: where its latencies lie) and a sweep (summary.png).

Matplotlib runs headless (Agg) and is imported only when a plot is drawn.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Optional, Protocol, Sequence

from orchestrator.results.rundir import RunFiles, write_atomic

LATENCY_PNG = "latency.png"


class LatencyMarks(Protocol):
    """A metric's measured percentiles, as results.Percentiles gives them: p50/p99/p999,
    mean, max and, where chosen (report.percentiles), `percentiles` {"p90": .., ...}."""

    @property
    def measured(self) -> bool: ...

    @property
    def p50(self) -> Optional[float]: ...

    @property
    def p99(self) -> Optional[float]: ...

    @property
    def p999(self) -> Optional[float]: ...

    @property
    def mean(self) -> Optional[float]: ...

    @property
    def max(self) -> Optional[float]: ...

    @property
    def percentiles(self) -> Optional[dict[str, Optional[float]]]: ...


QUANTILES = ((0.5, "p50"), (0.99, "p99"), (0.999, "p999"))
DEFAULT_QS = (50.0, 90.0, 99.0, 99.9)  # report.percentiles' default


def layout_label(prefill_ranks: int, decode_ranks: int, decode_tp: int = 1) -> str:
    """The rank/TP layout a title names: "1 prefill rank -> 2 decode instances (TP 2 each)"."""
    def n(k: int, what: str) -> str:
        return f"{k} {what}" + ("s" if k != 1 else "")

    return (f"{n(prefill_ranks, 'prefill rank')} -> {n(decode_ranks, 'decode instance')}"
            + (f" (TP {decode_tp} each)" if decode_tp > 1 else " (TP 1)"))


def log_ticks(axis: Any, lo: float, hi: float) -> None:
    """Enough labelled ticks on a log axis from `lo` to `hi`: every digit within less than a
    decade, 1-2-3-5 up to two, 1-2-5 up to four and a half, decades beyond; plain numbers."""
    from matplotlib import ticker

    decades = math.log10(hi / lo) if lo > 0 and hi > lo else 0.0
    subs = (tuple(range(1, 10)) if decades < 0.8 else (1.0, 2.0, 3.0, 5.0) if decades < 2 else
            (1.0, 2.0, 5.0) if decades < 4.5 else (1.0,))
    axis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
    axis.set_minor_locator(ticker.LogLocator(base=10, subs=tuple(range(1, 10))))
    axis.set_minor_formatter(ticker.NullFormatter())
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 10 else f"{v:g}"))


def pyplot() -> Any:
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


def percentiles(values: Iterable[float]) -> dict[str, Optional[float]]:
    """p50/p99/p999 the way results.json has them (orchestrator.results.stats.LatencyHistogram), so
    a plot marks exactly the numbers the summary prints."""
    from orchestrator.results.stats import LatencyHistogram

    return LatencyHistogram(values).summary()


def _marks_of(values: Iterable[float], qs: Sequence[float]) -> SimpleNamespace:
    """What results.Percentiles would hold for these values (one computation for both)."""
    from orchestrator.results.stats import LatencyHistogram

    h = LatencyHistogram(values)
    return SimpleNamespace(**h.summary(), mean=h.mean, max=h.peak, percentiles=h.chosen(qs), measured=True)


def _shown(pcts: Any, n: int) -> list[tuple[str, float, float]]:
    """(name, value, q) of the percentiles to mark: the chosen ones where the marks have them
    (else p50/p99/p999): every one report.percentiles asks for (`n` kept for callers)."""
    chosen = getattr(pcts, "percentiles", None)
    named = ([(name, v, float(name[1:]) / 100) for name, v in chosen.items()] if chosen else
             [(name, getattr(pcts, name), q) for q, name in QUANTILES])
    return [(name, v, q) for name, v, q in named if v is not None]


def _cdf_axes(ax: Any, metric: str, drawn: list[tuple[str, list[float]]]) -> None:
    """A CDF panel's log x axis (1-2-5 ticks), labels, title, grid and legend."""
    lo = min(min(v) for _, v in drawn)
    hi = max(max(v) for _, v in drawn)
    ax.set_xscale("log")
    log_ticks(ax.xaxis, max(lo, 1e-3), max(hi, lo * 1.01, 1e-3))
    ax.tick_params(axis="x", labelsize="small", labelrotation=30)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"{metric} latency (us, log scale)")
    ax.set_ylabel("fraction of requests (CDF)")
    ax.set_title(f"{metric}" + (" (verified)" if metric != "send_aux" else " (every send)"), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)


def latency_cdf(path: Path, data: dict[str, dict[str, list[float]]], title: str,
                marks: Optional[dict[str, LatencyMarks]] = None, qs: Sequence[float] = DEFAULT_QS) -> Optional[Path]:
    """One panel per metric (up to three in a row, four as two by two): the CDF of each
    route's latencies on a log x axis, its chosen percentiles (report.percentiles: `qs`)
    marked and labelled beside their lines, each label at its own height below the curve
    (where a CDF leaves room), the mean dash-dotted, the max a marker at the top; the legend
    under the panel. `marks` ({metric: LatencyMarks}, the job's latency_us) are the summary's
    own numbers: a panel of one route marks those; several routes get theirs from the same
    computation. Returns the path, or None when nothing was measured."""
    fig = latency_figure(data, title, marks, qs)
    if fig is None:
        return None
    save_png(fig, Path(path))
    return path


def save_png(fig: Any, path: Path) -> None:
    """A figure into the run dir as every run file is written: rendered in memory, then
    write_atomic (a private temporary file, renamed: a link or FIFO planted at `path` is
    replaced, never followed; a full disk raises NoSpace, nothing torn left)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI, format="png")
    pyplot().close(fig)
    write_atomic(path, buf.getvalue())


DPI = 110


def latency_figure(data: dict[str, dict[str, list[float]]], title: str,
                   marks: Optional[dict[str, LatencyMarks]] = None, qs: Sequence[float] = DEFAULT_QS) -> Any:
    """latency_cdf's figure (None when nothing was measured), its mark labels placed."""
    panels = [(metric, routes) for metric, routes in data.items() if any(routes.values())]
    if not panels:
        return None
    plt = pyplot()

    cols = 2 if len(panels) == 4 else len(panels)
    rows = math.ceil(len(panels) / cols)
    width = 5.0 if cols > 1 else 6.0
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, 5.4 * rows + 0.4), squeeze=False, dpi=DPI)
    labels: list[tuple[Any, float, float, str, str]] = []  # (axes, x, preferred y, text, color)
    for ax, (metric, routes) in zip(axes.flat, panels):
        drawn = [(r, v) for r, v in sorted(routes.items()) if v]
        for k, (route, values) in enumerate(drawn):
            xs = sorted(values)
            n = len(xs)
            ys = [(i + 1) / n for i in range(n)]
            step = max(1, n // 4000)  # the curve needs no more points than pixels
            given = (marks or {}).get(metric) if len(drawn) == 1 else None
            pcts = given if given and given.measured else _marks_of(xs, qs)
            shown = _shown(pcts, n)
            mean, top = getattr(pcts, "mean", None), getattr(pcts, "max", None)
            stats = ([f"{name} {x:,.0f}" for name, x, _ in shown]
                     + ([f"mean {mean:,.0f}"] if mean is not None else [])
                     + ([f"max {top:,.0f}"] if top is not None else []))
            label = f"{route} (n={n:,}), us:\n" + "\n".join(textwrap.wrap(", ".join(stats), 52))
            line, = ax.plot(xs[::step] + [xs[-1]], ys[::step] + [1.0], label=label)
            color = line.get_color()
            for j, (name, x, q) in enumerate(shown):
                ax.axvline(x, color=color, linestyle=":", linewidth=0.9)
                ax.plot([x], [q], marker="o", markersize=4, color=color)
                # right of its line, each mark at its own height: right of the q-th
                # percentile the CDF is above q, so a label below q meets no curve; placed
                # after the layout where no other label is (_place_labels)
                labels.append((ax, x, 0.03 + 0.2 * (j % 4) + 0.05 * k, f" {name} {x:,.0f}", color))
            if mean is not None:
                ax.axvline(mean, color=color, linestyle="-.", linewidth=0.8, alpha=0.7)
            if top is not None:
                ax.plot([top], [1.0], marker="v", markersize=6, color=color)
        _cdf_axes(ax, metric, drawn)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title + "\nmarks: percentiles dotted, mean dash-dotted, max a triangle", fontsize=10)
    fig.tight_layout()
    _place_labels(fig, labels)
    return fig


def _place_labels(fig: Any, labels: list[tuple[Any, float, float, str, str]]) -> None:
    """Each mark's label (vertical, beside its line) where it overlaps no label placed before
    it and stays inside its panel: the preferred height first, then the nearest free height,
    then a few points right or left of the line (close percentiles: p99 and p99.9 of a
    saturated open loop share an x)."""
    renderer = fig.canvas.get_renderer()
    placed: list[Any] = []
    heights = [i / 40 for i in range(1, 40)]
    for ax, x, y0, text, color in labels:
        box = ax.get_window_extent(renderer)
        t = ax.annotate(text, xy=(x, y0), xytext=(0, 0), textcoords="offset points", rotation=90,
                        va="bottom", ha="left", fontsize="x-small", color=color,
                        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.75, "pad": 0.3})
        fits = None
        for dx in (0, 9, -9, 18, -18, 27, -27, 36, -36, 45, -45):
            for y in sorted(heights, key=lambda v: abs(v - y0)):
                t.xy = (x, y)
                t.set_position((dx, 0))
                bb = t.get_window_extent(renderer)
                if (bb.x0 >= box.x0 and bb.x1 <= box.x1 and bb.y0 >= box.y0 and bb.y1 <= box.y1
                        and not any(bb.overlaps(p) for p in placed)):
                    fits = bb
                    break
            if fits is not None:
                break
        if fits is None:  # no free place: left out rather than drawn over another
            t.remove()
            continue
        placed.append(fits.expanded(1.02, 1.02))


def run_latency_png(run_dir: Path, title: str, marks: Optional[dict[str, LatencyMarks]] = None,
                    arrival: bool = False, qs: Sequence[float] = DEFAULT_QS) -> Optional[Path]:
    return latency_cdf(Path(run_dir) / LATENCY_PNG, run_latencies(run_dir, arrival), title, marks, qs)


def draw_later(run_dir: Path, title: str, arrival: bool = False, qs: Sequence[float] = DEFAULT_QS) -> None:
    """An interrupted run's latency.png, drawn by a process of its own, in a session of its
    own, while and after this one exits: importing matplotlib and drawing take seconds on a
    busy 2-core box (4 s and 3 s at load 18), and a stop ends within about 2 s. Its marks are
    results.json's (written first); the image appears whole (drawn aside, then renamed)."""
    import subprocess
    import sys

    subprocess.Popen([sys.executable, "-m", "orchestrator.results.plots", str(run_dir),
                      json.dumps({"title": title, "arrival": arrival, "qs": list(qs)})],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True)


class Drawer:
    """A run's latency.png, drawn off the critical path by a process of its own: started
    when the handoffs end (`start`: it imports matplotlib while the endpoints wind down and
    the results are built), told to draw once results.json is written (`draw`: its marks are
    results.json's), and waited for after the summary is printed (`wait`), so the image is
    there when the command returns. The image appears whole (drawn aside, then renamed)."""

    NO_SPACE = 28  # the drawer's exit code for a full disk (ENOSPC, EDQUOT)

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.proc: Optional[Any] = None
        self.asked = False

    def start(self) -> None:
        import subprocess
        import sys

        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.results.plots", "--stdin",
                                          str(self.run_dir)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, close_fds=True)

    def draw(self, title: str, arrival: bool = False, qs: Sequence[float] = DEFAULT_QS) -> None:
        self.start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"title": title, "arrival": arrival, "qs": list(qs)}) + "\n").encode())
            self.proc.stdin.close()
            self.asked = True
        except OSError:
            pass

    def wait(self) -> Optional[str]:
        """None: drawn (or nothing to draw: the drawer is ended at once); "no space": the
        disk is full; else the error."""
        if self.proc is None:
            return None
        if not self.asked:
            self.proc.kill()
        err = self.proc.stderr.read() if self.proc.stderr is not None else b""
        self.proc.wait()
        if not self.asked:
            return None
        if self.proc.returncode == 0:
            return None
        if self.proc.returncode == self.NO_SPACE:
            return "no space"
        lines = err.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"the drawer exited with code {self.proc.returncode}"


def _draw_asked(run_dir: Path) -> int:
    """Drawer's process: matplotlib first, then the request from stdin (none: exit)."""
    import errno
    import sys

    pyplot()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    try:
        _draw(run_dir, json.loads(line))
    except OSError as exc:
        (run_dir / f".{LATENCY_PNG}.partial.png").unlink(missing_ok=True)  # nothing torn left
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return Drawer.NO_SPACE
        raise
    return 0


def _draw(run_dir: Path, opts: dict) -> Optional[Path]:
    """draw_later's process: latency.png from the run dir's records and results.json."""
    import os

    from orchestrator.results.schema import JobResults, Results

    res = Results.read(run_dir)
    if not isinstance(res, JobResults):
        return None
    lat = res.latency_us
    aside = run_dir / f".{LATENCY_PNG}.partial.png"
    path = latency_cdf(aside, run_latencies(run_dir, opts.get("arrival", False)), opts["title"],
                       {"send_aux": lat.send_aux, "taken": lat.taken, "handoff": lat.handoff,
                        "from arrival": lat.e2e}, opts.get("qs") or DEFAULT_QS)
    if path is None:
        return None
    os.replace(aside, run_dir / LATENCY_PNG)
    return run_dir / LATENCY_PNG


def short_dir(path: str | Path) -> str:
    """A run or sweep dir as a title names it: its last two parts (outputs/<date>/<time>),
    never a temp dir's whole path."""
    parts = Path(path).parts
    return "/".join(parts[-2:]) if len(parts) >= 2 else str(path)


if __name__ == "__main__":  # draw_later's process, or a Drawer's (--stdin)
    import sys

    if sys.argv[1] == "--stdin":
        sys.exit(_draw_asked(Path(sys.argv[2])))
    _draw(Path(sys.argv[1]), json.loads(sys.argv[2]))

"""Sweep summaries: scan a sweep dir's job results into summary.csv, summary.md, summary.png.

Every job writes its own results.json (a failed job too, marked with its error), so the
summary is built by scanning the sweep dir, not from Hydra's callback arguments (the basic
sweeper skips on_multirun_end when a job raised). `python -m orchestrator.report <dir>`
rebuilds the same files.

A job dir is a subdir whose name is a whole number (Hydra's `hydra.job.num`). Its row
carries the swept values (from `.hydra/overrides.yaml`, `hydra.*` keys left out) and a
status (orchestrator.results.schema.RunStatus): `ok` (every request verified, no error), `failed`
(ran, but not every request was verified), `interrupted` (SIGINT/SIGTERM ended it),
`error` (results.json carries an error, or cannot be read) or `missing` (no results.json:
the job crashed before writing one). Every combination of the sweep (from the sweep dir's
multirun.yaml, as Hydra's basic sweeper numbers them) without a job dir is a row too, `not
started`: an interrupted sweep lists what it never ran.
"""

from __future__ import annotations

import csv
import io
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from orchestrator.job import failure
from orchestrator.results.plots import layout_label, log_ticks, pyplot, short_dir
from orchestrator.results.rundir import (
    SWEEP_ID_NAME,
    NoSpace,
    RunDirBusy,
    RunFiles,
    claim_file,
    claim_run_dir,
    full,
    new_run_id,
    run_owner,
    sweep_owner,
    write_atomic,
)
from orchestrator.results.schema import DecodeSideResults, JobResults, Results, RunStatus

CSV_NAME = "summary.csv"
MD_NAME = "summary.md"
PNG_NAME = "summary.png"

# Columns after `job` and the swept keys, in order.
RESULT_COLUMNS = [
    "status", "requests", "verified", "corrupted", "failed", "routes", "mem_pool", "route",
    "send_aux_p50_us", "send_aux_p99_us", "send_aux_p999_us",
    "handoff_p50_us", "handoff_p99_us", "handoff_p999_us", "e2e_p50_us", "e2e_p99_us",
    "handoffs_per_s", "offered_per_s", "achieved_pct", "mb_per_s", "bytes_per_request", "startup_s",
    "startup_by_process", "effective_transport",
    "silent_corruptions", "steps_disagreed", "exit_code", "error",
    "taken_p50_us", "taken_p99_us", "taken_p999_us", "gate_read", "gate_read_p50_us", "gate_read_p99_us",
    "stall_p50_us", "stall_p99_us", "forward_steps_per_s_idle", "forward_steps_per_s_serving",
    "send_aux_mean_us", "send_aux_max_us", "taken_mean_us", "taken_max_us", "handoff_mean_us",
    "handoff_max_us", "e2e_mean_us", "e2e_max_us", "requests_per_send", "duration_s", "burstiness",
    "layout",
]
# After RESULT_COLUMNS: each job's report.percentiles, `<metric>_p<q>_us` for these metrics
PERCENTILE_METRICS = ("send_aux", "taken", "handoff", "e2e")
RATE_KEY = "workload.rate"


class SweepError(ValueError):
    """The directory is not a sweep dir (missing, or without any job subdir)."""


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The job subdirs (named by hydra.job.num) of the sweep that owns `sweep_dir`, sorted by
    job number. Where a sweep claimed the dir (rundir.SWEEP_ID_NAME), a job dir counts when
    its run was of that sweep (its rundir.RUN_ID_NAME), or when no run claimed it and it
    holds no results.json (a job of this sweep that crashed first: a `missing` row); any
    other is another sweep's, left out. A dir no sweep claimed (an older sweep): every one.
    A symbolic link is never a job dir."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return []
    jobs = [p for p in sweep_dir.iterdir() if p.name.isdigit() and p.is_dir() and not p.is_symlink()]
    sweep = sweep_owner(sweep_dir)
    if sweep is not None:
        jobs = [p for p in jobs if _of_sweep(p, sweep)]
    return sorted(jobs, key=lambda p: int(p.name))


def _of_sweep(job_dir: Path, sweep: str) -> bool:
    owner = run_owner(job_dir)
    if owner["run"] is None:
        return not os.path.lexists(RunFiles(job_dir).results)
    return owner["sweep"] == sweep


# What a sweep writes at the top of its dir (the job dirs apart): any of it there before the
# sweep starts is another sweep's (refused: never overwritten, never counted).
SWEEP_FILES = ("multirun.yaml", CSV_NAME, MD_NAME, PNG_NAME, SWEEP_ID_NAME)


def foreign_sweep_files(sweep_dir: Path) -> list[str]:
    """The job dirs (any whole-number name) and sweep files another sweep left in
    `sweep_dir`, jobs first in number order (lstat: nothing is followed)."""
    try:
        names = [e.name for e in os.scandir(sweep_dir)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    jobs = sorted((n for n in names if n.isdigit()), key=int)
    return jobs + sorted(n for n in names if n in SWEEP_FILES)


def own_sweep_dir(sweep_dir: Path, claim: bool = True) -> str:
    """A sweep owns its dir or refuses it: RunDirBusy naming what another sweep left there
    (foreign_sweep_files); else the dir is claimed for a new sweep id (SWEEP_ID_NAME,
    created exclusively), returned. Its jobs carry the id (app.own_run_dir) and the summary
    counts only them (job_dirs)."""

    names = foreign_sweep_files(sweep_dir)
    if names:
        shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
        raise RunDirBusy(f"hydra.sweep.dir={sweep_dir} holds another sweep's files ({shown}): choose a new "
                         "dir or remove them")
    sweep = new_run_id()
    if not claim:  # the check alone
        return sweep
    sweep_dir.mkdir(parents=True, exist_ok=True)
    claim_file(sweep_dir / SWEEP_ID_NAME, {"sweep": sweep},
               f"hydra.sweep.dir={sweep_dir} holds another sweep's files ({SWEEP_ID_NAME}): choose a new dir or "
               "remove them")
    return sweep


def _overrides(job_dir: Path) -> dict[str, str]:
    """`.hydra/overrides.yaml` as {key: value}; hydra.* keys and unreadable files skipped."""
    path = job_dir / ".hydra" / "overrides.yaml"
    try:
        items = yaml.safe_load(path.read_text()) or []
    except (OSError, yaml.YAMLError):
        return {}
    return _pairs(items)


def combinations(sweep_dir: Path) -> list[dict[str, str]]:
    """Every job of the sweep, in Hydra's job order, as {key: value} (hydra.* left out): the
    basic sweeper's product of the sweep's overrides (multirun.yaml). [] where it cannot tell
    (no or an unreadable multirun.yaml, another sweeper)."""
    try:
        conf = yaml.safe_load((Path(sweep_dir) / "multirun.yaml").read_text()) or {}
        hydra_conf = conf["hydra"]
        if not str(hydra_conf["sweeper"]["_target_"]).endswith("BasicSweeper"):
            return []
        params = hydra_conf["sweeper"].get("params") or {}
        args = [f"{k}={v}" for k, v in params.items()] + list(hydra_conf["overrides"]["task"] or [])
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)
    except Exception:  # noqa: BLE001 - a summary never fails on what it cannot enumerate
        return []
    return [_pairs(job) for job in batches[0]] if batches else []


def _pairs(items: Any) -> dict[str, str]:
    """["key=value", ...] as {key: value}; hydra.* keys skipped."""
    out: dict[str, str] = {}
    if not isinstance(items, list):
        return out
    for item in items:
        key, _, value = str(item).partition("=")
        key = key.lstrip("+~").strip()
        if not key or key.startswith(("hydra.", "hydra/")) or key == "hydra":
            continue
        out[key] = value.strip()
    return out


def _row(job_dir: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"job": int(job_dir.name)}
    if not RunFiles(job_dir).results.is_file():
        row.update(status=RunStatus.missing, error="no results.json")
        return row
    try:
        res = Results.read(job_dir)
    except (OSError, ValueError) as exc:
        row.update(status=RunStatus.error, error=f"unreadable results.json: {exc}")
        return row
    row.update(status=res.status, requests=res.requests, verified=res.verified, corrupted=res.corrupted,
               failed=res.failed, routes=";".join(f"{k}={v}" for k, v in sorted((res.routes or {}).items())),
               exit_code=res.exit_code, error=res.error)
    if isinstance(res, (JobResults, DecodeSideResults)):
        row.update(_ran(res))
    if isinstance(res, JobResults):
        row.update(_measured(res))
    return row


def _ran(res: JobResults | DecodeSideResults) -> dict[str, Any]:
    """The columns of a job that ran: its plan, transport, start-up and rate, TP agreement."""
    t, tp = res.timing, res.tp
    return dict(
        mem_pool=res.plan.mem_pool, route=res.plan.route, handoffs_per_s=t.handoffs_per_s,
        offered_per_s=t.offered_per_s,
        achieved_pct=(round(100 * t.handoffs_per_s / t.offered_per_s, 1)
                      if t.offered_per_s and t.handoffs_per_s is not None else None),
        mb_per_s=t.mb_per_s, bytes_per_request=t.bytes_per_request,
        effective_transport=res.transports.effective_transport, startup_s=t.startup_s,
        startup_by_process=";".join(f"{k}={v}" for k, v in (t.startup_by_process or {}).items()) or None,
        silent_corruptions=tp.silent_corruptions if tp else None,
        steps_disagreed=tp.steps_disagreed if tp else None)


def _measured(res: JobResults) -> dict[str, Any]:
    """A run's latency and decode gate columns."""
    lat, gate = res.latency_us, res.decode_gate
    load = gate.one_load
    row: dict[str, Any] = dict(
        e2e_p50_us=lat.e2e.p50, e2e_p99_us=lat.e2e.p99, gate_read=gate.read,
        gate_read_p50_us=gate.gate_read_us_per_poll.p50, gate_read_p99_us=gate.gate_read_us_per_poll.p99,
        stall_p50_us=gate.stall_us_per_poll.p50, stall_p99_us=gate.stall_us_per_poll.p99,
        forward_steps_per_s_idle=load.forward_steps_per_s_idle if load else None,
        forward_steps_per_s_serving=load.forward_steps_per_s_serving if load else None)
    for kind in ("send_aux", "taken", "handoff"):
        p = getattr(lat, kind)
        row.update({f"{kind}_p50_us": p.p50, f"{kind}_p99_us": p.p99, f"{kind}_p999_us": p.p999})
    for kind in PERCENTILE_METRICS:
        p = getattr(lat, kind)
        row.update({f"{kind}_mean_us": p.mean, f"{kind}_max_us": p.max})
        row.update({f"{kind}_{q}_us": v for q, v in (p.percentiles or {}).items()})
    row.update(requests_per_send=res.timing.requests_per_send, duration_s=res.workload.duration_s,
               burstiness=res.workload.burstiness, layout=_layout(res))
    return row


def _layout(res: JobResults) -> Optional[str]:
    """The job's rank/TP layout, from its pairs ("p0->d1") and TP summary."""
    if not res.pairs:
        return None
    prefill = {k.split("->")[0] for k in res.pairs}
    decode = {k.split("->")[-1] for k in res.pairs}
    return layout_label(len(prefill), len(decode), res.tp.ranks if res.tp else 1)


def _title(sweep_dir: Path, rows: list[dict[str, Any]]) -> str:
    """summary.png's title: the sweep, how its combinations ended, the rank/TP layout."""
    layouts = {r.get("layout") for r in rows if r.get("layout")}
    where = (f"\n{layouts.pop()}" if len(layouts) == 1 else
             "\nrank/TP layouts differ (summary.csv: layout)" if layouts else "")
    return f"sweep {short_dir(sweep_dir)}: {status_line(rows)}{where}"


def _number(value: Any) -> Optional[float]:
    if value is None or isinstance(value, bool):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _cell(value: Any) -> str:
    if isinstance(value, RunStatus):
        return value.value
    return "" if value is None else str(value)


def swept_column(key: str) -> str:
    """The column of a swept key: the key itself, or `override:KEY` where the key is also a
    result column (`mem_pool=NONE,NVLINK` gives `override:mem_pool` next to the plan's
    `mem_pool`)."""
    return f"override:{key}" if key in RESULT_COLUMNS or key == "job" else key


def _percentile_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The chosen-percentile columns any row has, metric by metric, in increasing q."""
    have = {k for row in rows for k in row}
    out = []
    for kind in PERCENTILE_METRICS:
        named = [k for k in have if k.startswith(f"{kind}_p") and k.endswith("_us") and k not in RESULT_COLUMNS]
        qs = sorted({(_number(k[len(kind) + 2:-3]), k) for k in named if _number(k[len(kind) + 2:-3]) is not None})
        out += [k for _, k in qs]
    return out


def collect(sweep_dir: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, rows) for a sweep dir, one row per job dir sorted by job number. Columns:
    job, the swept keys (in order of first appearance), RESULT_COLUMNS, then the jobs'
    chosen percentiles (report.percentiles) not already among them."""
    rows, swept = [], []
    dirs = {int(d.name): d for d in job_dirs(sweep_dir)}
    combos = combinations(sweep_dir)
    for num in sorted(set(dirs) | set(range(len(combos)))):
        if num in dirs:
            row, overrides = _row(dirs[num]), _overrides(dirs[num])
        else:
            row, overrides = {"job": num, "status": RunStatus.not_started}, combos[num]
        for key in overrides:
            if key not in swept:
                swept.append(key)
        rows.append((row, overrides))
    out = []
    for row, ov in rows:
        for key in swept:
            row[swept_column(key)] = ov.get(key)
        out.append(row)
    return ["job", *(swept_column(k) for k in swept), *RESULT_COLUMNS, *_percentile_columns(out)], out


def _write_csv(path: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    fh = io.StringIO(newline="")
    w = csv.writer(fh)
    w.writerow(columns)
    for row in rows:
        w.writerow([_cell(row.get(c)) for c in columns])
    write_atomic(path, fh.getvalue())  # never through a link planted there; whole or not at all


def _md_cell(value: Any) -> str:
    return _cell(value).replace("\r", " ").replace("\n", " ").replace("|", "\\|")


def status_line(rows: list[dict[str, Any]]) -> str:
    """"3 combinations: 1 ok, 1 interrupted, 1 not started" (every status present, in
    RunStatus order)."""
    counts = [(st, sum(r["status"] is st for r in rows)) for st in RunStatus]
    return f"{len(rows)} combinations: " + ", ".join(f"{n} {st.value}" for st, n in counts if n)


def short_columns(columns: list[str], rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """summary.md's table: (heading, row key) of what a reader compares across jobs: the job,
    the swept keys, status, verified and failed, handoffs/s, the handoff's p50/p99 (an open
    loop's latency from arrival too), the error where a job has one. Every column: summary.csv."""
    swept = columns[1:columns.index(RESULT_COLUMNS[0])]
    out = [("job", "job"), *((k, k) for k in swept), ("status", "status"), ("verified", "verified"),
           ("failed", "failed")]
    if any(_number(r.get("corrupted")) for r in rows):
        out.append(("corrupted", "corrupted"))
    out += [("handoffs/s", "handoffs_per_s"), ("handoff p50 us", "handoff_p50_us"),
            ("handoff p99 us", "handoff_p99_us")]
    if any(r.get("e2e_p50_us") not in (None, "") for r in rows):
        out += [("from arrival p50 us", "e2e_p50_us"), ("from arrival p99 us", "e2e_p99_us")]
    if any(r.get("error") for r in rows):
        out.append(("error", "error"))
    return out


def _write_md(path: Path, sweep_dir: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    short = short_columns(columns, rows)

    def cell(row: dict[str, Any], key: str) -> str:
        if key == "verified" and row.get("requests") not in (None, ""):
            return f"{_md_cell(row.get('verified'))}/{_md_cell(row.get('requests'))}"
        return _md_cell(row.get(key))

    lines = [f"# Sweep summary: {sweep_dir}", "",
             f"{status_line(rows)}.", "",
             "| " + " | ".join(h for h, _ in short) + " |",
             "|" + "|".join("---" for _ in short) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(cell(row, k) for _, k in short) + " |")
    lines += ["", f"Every column ({len(columns)}: each latency's percentiles, mean and max, MB/s, the "
                  f"transport, start-up, the decode gate, ...): {CSV_NAME}; what each holds: docs/sweeps.md."]
    write_atomic(path, "\n".join(lines) + "\n")


def _x_axis(swept: list[str], rows: list[dict[str, Any]]) -> tuple[Optional[str], str]:
    """(row key, axis label): the first swept key whose values are all numeric and not all
    the same (a key given one value, e.g. workload.requests=200, is not swept); None when
    no swept key is numeric (the jobs are then compared side by side as bars)."""
    for key in swept:
        values = [row.get(key) for row in rows if row.get(key) not in (None, "")]
        numbers = [_number(v) for v in values]
        if numbers and None not in numbers and len(set(numbers)) > 1:
            return key, key
    return None, ""


def _varying(swept: list[str], rows: list[dict[str, Any]]) -> list[str]:
    return [k for k in swept if len({str(r.get(k)) for r in rows}) > 1]


def _write_bars(path: Path, sweep_dir: Path, swept: list[str], rows: list[dict[str, Any]]) -> None:
    """A sweep over categorical keys (gate.readiness=true,false faults=...): per job, its
    outcomes (verified / corrupted / failed) and its rate, side by side. A job that did not
    run (refused, an error, no results) is a hatched bar saying so, not an empty slot."""
    import textwrap

    plt = pyplot()

    keys = _varying(swept, rows) or swept
    def pair(k: str, v: Any) -> str:  # key=value, the value on its own line when long
        name, value = k.split(":")[-1].split(".")[-1], textwrap.shorten(str(v), 20, placeholder="...")
        return f"{name}={value}" if len(name) + len(value) < 17 else f"{name}=\n{value}"

    labels = ["\n".join([f"job {r['job']}"] + [pair(k, r.get(k)) for k in keys]) for r in rows]
    x = list(range(len(rows)))
    fig, axes = plt.subplots(1, 2, figsize=(max(9.0, 1.3 * len(rows) + 6), 5.6))
    ran = [r["status"] in (RunStatus.ok, RunStatus.failed, RunStatus.interrupted) for r in rows]
    top = max([_number(r.get("requests")) or 0.0 for r in rows] + [1.0])
    bottom = [0.0] * len(rows)
    for key, color in (("verified", "tab:green"), ("corrupted", "tab:red"), ("failed", "tab:gray")):
        vals = [(_number(r.get(key)) or 0.0) if ok else 0.0 for r, ok in zip(rows, ran)]
        axes[0].bar(x, vals, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    rate_top = max([_number(r.get("handoffs_per_s")) or 0.0 for r in rows] + [1.0])
    for i, r in enumerate(rows):
        silent = _number(r.get("silent_corruptions"))
        if silent:
            axes[0].annotate(f"{silent:g} silent", (i, bottom[i]), ha="center", va="bottom", fontsize="small")
        if not ran[i]:
            what = "refused" if r.get("exit_code") == 2 else r["status"].value
            for ax, h in ((axes[0], top), (axes[1], rate_top)):
                ax.bar([i], [h], color="none", edgecolor="tab:orange", hatch="//", linewidth=1)
                ax.text(i, h / 2, what, ha="center", va="center", rotation=90, color="tab:orange",
                        fontsize="small", fontweight="bold")
    axes[0].set_title("outcomes per job (silent: taken before the row landed)", fontsize=10)
    axes[0].set_ylabel("requests")
    axes[1].bar(x, [(_number(r.get("handoffs_per_s")) or 0.0) if ok else 0.0 for r, ok in zip(rows, ran)],
                color="tab:blue")
    axes[1].set_title("verified handoffs/s", fontsize=10)
    axes[1].set_ylabel("handoffs/s (handoff phase)")
    for ax in axes:
        wide = len(rows) > 6
        ax.set_xticks(x, labels, fontsize="x-small", rotation=30 if wide else 0, ha="right" if wide else "center")
        ax.set_xlabel("job (swept values)")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylim(0, top * 1.18)  # headroom for the legend, above every bar
    axes[1].set_ylim(0, rate_top * 1.18)
    axes[0].legend(fontsize="small", loc="upper center", ncol=3, framealpha=0.9)
    fig.suptitle(_title(sweep_dir, rows), fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _save(fig: Any, path: Path) -> None:
    """A figure as PNG, written atomically (never through a link planted there)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    write_atomic(path, buf.getvalue())


STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--")]


def _series(swept: list[str], x_key: str, ok: list[dict[str, Any]]) -> dict[tuple, list[tuple[float, dict]]]:
    """One line per (mem_pool, route); other swept keys that vary among the plotted rows (not
    the x axis, not mem_pool, which the plan already names) split lines further, so that a
    line never zig-zags between two configurations at the same x."""
    extra = [k for k in swept if k not in (x_key, swept_column("mem_pool"))
             and len({r.get(k) for r in ok}) > 1]
    series: dict[tuple, list[tuple[float, dict[str, Any]]]] = {}
    for row in ok:
        x = _number(row.get(x_key))
        if x is None:
            continue
        label = (row.get("mem_pool") or "?", row.get("route") or "?",
                 *(f"{k}={row.get(k)}" for k in extra))
        series.setdefault(label, []).append((x, row))
    return series


def _lines(ax: Any, key: str, series: dict, load: bool) -> None:
    """A panel's lines: `key` against x for each series (with a load sweep's p99 dashed)."""
    for n_series, (label, pts) in enumerate(sorted(series.items())):
        marker, style = STYLES[n_series % len(STYLES)]
        if load:
            style = "-"  # p50 solid, p99 dashed (both panels: dashed means p99); the marker tells lines apart
        pts.sort(key=lambda p: p[0])
        px = [x for x, r in pts if _number(r.get(key)) is not None]
        py = [_number(r.get(key)) for x, r in pts if _number(r.get(key)) is not None]
        name = f"{label[0]} / {label[1]}" + "".join(f", {e}" for e in label[2:])
        # a distinct marker and dash per line, drawn thinner and on top as they come: a
        # line that lies exactly on another stays visible
        line, = ax.plot(px, py, marker=marker, linestyle=style, markersize=7 - n_series % 3,
                        linewidth=2.2 - 0.4 * (n_series % 3), zorder=3 + n_series, label=name)
        if load and key == "e2e_p50_us":
            qx = [x for x, r in pts if _number(r.get("e2e_p99_us")) is not None]
            qy = [_number(r.get("e2e_p99_us")) for x, r in pts if _number(r.get("e2e_p99_us")) is not None]
            ax.plot(qx, qy, marker=marker, markerfacecolor="none", linestyle="--", color=line.get_color(),
                    zorder=3 + n_series)


def _offered_line(ax: Any, xs: list[float], measured_top: float) -> bool:
    """A load sweep's offered = achieved diagonal; True when it was clipped off the chart."""
    offered = sorted(set(xs))
    ax.plot(offered, offered, color="gray", linestyle=":", zorder=2, label="offered")
    if measured_top and max(offered) > 2.5 * measured_top:  # it would squash the measured lines
        ax.set_ylim(0, 1.3 * measured_top)
        ax.text(0.02, 0.97, f"offered line leaves the chart above {1.3 * measured_top:,.0f}/s",
                transform=ax.transAxes, ha="left", va="top", fontsize="x-small", color="gray")
        return True
    return False


def _axes(ax: Any, key: str, title: str, x_label: str, xs: list[float], has_series: bool, load: bool,
          clipped: bool) -> None:
    """A panel's titles, scales, ticks and legend."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(x_label)
    ax.set_ylabel({"e2e_p50_us": "latency from arrival (us, log scale)", "send_aux_p50_us": "send_aux p50 (us)",
                   "handoffs_per_s": "verified handoffs/s"}.get(key, title))
    ax.grid(True, which="both", alpha=0.3)
    if xs and min(xs) > 0 and max(xs) / min(xs) > 10:
        ax.set_xscale("log")
        log_ticks(ax.xaxis, min(xs), max(xs))
    ticks = sorted(set(xs))
    if 0 < len(ticks) <= 8:  # label the swept values themselves
        ax.set_xticks(ticks, [f"{x:.0f}" if x.is_integer() else repr(x) for x in ticks])
        ax.minorticks_off()
    if has_series:
        if load and key == "e2e_p50_us":
            ax.set_yscale("log")
            lo, hi = ax.get_ylim()
            log_ticks(ax.yaxis, lo, hi)
        elif not clipped:
            ax.set_ylim(bottom=0)
        ax.legend(title="mem_pool / route", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no successful jobs", ha="center", va="center",
                transform=ax.transAxes, fontsize=14, color="gray")


def _write_png(path: Path, sweep_dir: Path, swept: list[str], rows: list[dict[str, Any]]) -> None:
    plt = pyplot()

    x_key, x_label = _x_axis(swept, rows)
    if x_key is None:
        plt.close("all")
        return _write_bars(path, sweep_dir, swept, rows)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    ok = [r for r in rows if r["status"] is RunStatus.ok]
    load = x_key == RATE_KEY  # a latency-vs-load sweep: offered load on x, p50 and p99 from arrival
    if load:
        panels = [("e2e_p50_us", "latency from arrival (us): p50 solid, p99 dashed"),
                  ("handoffs_per_s", "verified handoffs/s vs offered")]
        x_label = "offered load (requests/s per prefill rank)"
    else:
        panels = [("send_aux_p50_us", "send_aux p50 latency (us)"), ("handoffs_per_s", "handoffs/s")]
    series = _series(swept, x_key, ok)
    xs = [x for pts in series.values() for x, _ in pts]
    measured_top = max([_number(r.get("handoffs_per_s")) or 0.0 for r in ok] + [0.0])
    for ax, (key, title) in zip(axes, panels):
        _lines(ax, key, series, load)
        clipped = _offered_line(ax, xs, measured_top) if load and key == "handoffs_per_s" and xs else False
        _axes(ax, key, title, x_label, xs, bool(series), load, clipped)
    fig.suptitle(_title(sweep_dir, rows), fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def summarize(sweep_dir: Path, png: bool = True) -> list[Path]:
    """Write summary.csv, summary.md and summary.png into sweep_dir; return their paths.

    Raises SweepError when sweep_dir is not a directory or holds no job subdir. Never
    raises because jobs failed: failed, errored and missing jobs are rows too (left out of
    the plot only)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise SweepError(f"{sweep_dir} is not a directory")
    columns, rows = collect(sweep_dir)
    if not rows:
        raise SweepError(f"{sweep_dir} holds no job subdirs (0, 1, ...): not a sweep dir")
    swept = columns[1:columns.index(RESULT_COLUMNS[0])]
    csv_path, md_path, png_path = (sweep_dir / CSV_NAME, sweep_dir / MD_NAME,
                                   sweep_dir / PNG_NAME)
    _write_csv(csv_path, columns, rows)
    _write_md(md_path, sweep_dir, columns, rows)
    if not png:  # an interrupted sweep: the plot (about a second) can be drawn later by report
        return [csv_path, md_path]
    _write_png(png_path, sweep_dir, swept, rows)
    return [csv_path, md_path, png_path]


def sweep_status(sweep_dir: Path) -> str:
    """The sweep's status line: every combination counted by its status."""
    return status_line(collect(sweep_dir)[1])


def worst_exit(sweep_dir: Path) -> Optional[int]:
    """The worst exit code of a sweep's jobs (a job without a readable results.json counts
    as lost: 3); None when the directory holds no job."""
    codes = []
    for row in collect(sweep_dir)[1]:
        if row["status"] is RunStatus.not_started:
            continue
        code = row.get("exit_code")
        codes.append(code if isinstance(code, int) else 3)
    return max(codes) if codes else None


def not_ok(sweep_dir: Path) -> list[int]:
    """The jobs (numbers) of a sweep's rows that are not ok: failed, interrupted, an error,
    missing, or a combination not started."""
    return [int(row["job"]) for row in collect(sweep_dir)[1] if row["status"] is not RunStatus.ok]


class SweepSummary(Callback):
    """Writes the sweep summary when a multirun ends (config.yaml registers it for every run)
    and adds the worst job's exit code to the command's (failure.current(): jobs may have run
    in other processes or on other hosts, through a launcher). Before a Slurm launcher submits,
    its request is checked against sinfo (orchestrator.sweep.slurm)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from orchestrator.sweep import bad_files, slurm

        sweep_dir = Path(config.hydra.sweep.dir)
        self._own(sweep_dir, claim=False)  # refused before anything is written there
        launcher = config.hydra.get("launcher")
        if slurm.is_slurm_launcher(launcher):
            slurm.quiet_submitit(Path(config.hydra.sweep.dir) / ".submitit" / slurm.LOG_NAME)
            try:
                warning = slurm.precheck(launcher)
            except slurm.LauncherRequestError as exc:  # nothing submitted: one line, exit 2
                failure.leave(failure.Refusal(str(exc)))
            if warning:
                print(f"warning: {warning}", file=sys.stderr, flush=True)
        sweep = self._own(sweep_dir)
        refused = failure.current().refused
        if refused:  # rows for the jobs that picked a config-dir file that cannot compose
            bad_files.write_refused(sweep_dir, refused)
            for job in refused:  # this sweep's rows
                claim_run_dir(sweep_dir / str(job.num), new_run_id(), sweep)
            for why in dict.fromkeys(job.error for job in refused):
                print(f"warning: {why} (the jobs that pick it are refused rows; the others run)",
                      file=sys.stderr, flush=True)

    @staticmethod
    def _own(sweep_dir: Path, claim: bool = True) -> str:
        """A sweep owns its dir or refuses it (own_sweep_dir): one line, exit 2 (3: a full disk)."""
        try:
            return own_sweep_dir(sweep_dir, claim)
        except (RunDirBusy, NoSpace) as exc:
            failure.leave(exc)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        worst = worst_exit(sweep_dir)
        codes = failure.current().sweep
        if worst is not None:
            codes.append(worst)
        try:
            paths = summarize(sweep_dir)
        except SweepError as exc:
            print(f"sweep summary skipped: {exc}", file=sys.stderr, flush=True)
            return
        except OSError as exc:  # a full disk: what the sweep had, then one line, exit 3
            if not full(exc):
                raise
            print(f"sweep: {sweep_status(sweep_dir)}", flush=True)
            where = exc.path if isinstance(exc, NoSpace) else (getattr(exc, "filename", None) or sweep_dir)
            end = failure.ending(NoSpace(where), f"no space left writing {where} (the sweep summary is "
                                 f"incomplete: python -m orchestrator.report {sweep_dir} rebuilds it)")
            failure.say(end)
            codes.append(end.code)
            return
        for path in paths:
            print(f"sweep summary: {path}", flush=True)
        print(f"sweep: {sweep_status(sweep_dir)}", flush=True)

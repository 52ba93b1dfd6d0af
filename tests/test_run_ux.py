"""What a run shows and keeps (issue 33): the progress line, the load knobs (duration,
burstiness, chosen percentiles with mean and max, requests per send), sweeps that say how
each combination ended, the plots, the host's load in fingerprint.json, the run-dir lock
removed at the end, and Mooncake's per-transfer chatter kept out of the stderr logs."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.handoff.workload import arrival_offsets
from orchestrator.profile.config import ConfigError
from orchestrator.results.progress import Mode, mode_for
from orchestrator.results.progress import ProgressMeter as Progress
from orchestrator.results.schema import Percentiles, RunStatus
from orchestrator.results.stats import LatencyHistogram

from .conftest import ROOT, typed_cfg


# ---- the progress line ------------------------------------------------------------------------
class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("setting,console,tty,mode", [
    (None, False, True, Mode.live), (None, False, False, Mode.off), (None, True, False, Mode.lines),
    (True, False, False, Mode.lines), (True, False, True, Mode.live), (False, True, True, Mode.off),
    (False, True, False, Mode.off),
])
def test_progress_mode_follows_the_terminal_and_the_keys(setting, console, tty, mode):
    assert mode_for(setting, console, _Stream(tty)) is mode


def test_live_line_redraws_in_place_with_phase_counts_and_rate(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the line is cut to the terminal's width
    out, clock = _Stream(True), _Clock()
    p = Progress(1000, stream=out, mode=Mode.live, clock=clock)
    p.stage("starting processes")
    clock.t += 3.0
    p.tick()
    assert out.getvalue().split("\r")[-1].startswith("starting processes  3.0 s")
    p.start()
    clock.t += 2.0
    p(400, 390)
    last = out.getvalue().split("\r")[-1]
    assert "400/1,000 (40%)" in last and "verified 390, failed 10" in last and "200 handoffs/s" in last
    drawn = out.getvalue().count("\r")
    clock.t += 0.05
    p(410, 400)  # within REDRAW_S of the last: not drawn again
    assert out.getvalue().count("\r") == drawn
    clock.t += 1.0
    p.stage("collecting results")  # the phase's end freezes the rate
    clock.t += 10.0
    p(1000, 990)
    assert "328 handoffs/s  3.0 s" in out.getvalue().split("\r")[-1]  # 1,000 over the 3.05 s it ran
    p.close()
    assert out.getvalue().endswith("\r") and "\n" not in out.getvalue()
    monkeypatch.setenv("COLUMNS", "40")
    narrow = Progress(1000, stream=_Stream(True), mode=Mode.live, clock=clock)
    narrow.start()
    clock.t += 1
    narrow(500, 500)
    assert max(len(part) for part in narrow.stream.getvalue().split("\r")) <= 39


def test_lines_mode_writes_a_line_every_few_seconds_and_off_writes_nothing():
    for mode, stream in ((Mode.lines, _Stream(False)), (Mode.off, _Stream(False))):
        clock = _Clock()
        p = Progress(None, stream=stream, mode=mode, every_s=5.0, duration_s=30.0, clock=clock)
        p.start()
        for _ in range(40):  # 20 s of pipe messages, four a second
            clock.t += 0.5
            p(int((clock.t - 100) * 100), int((clock.t - 100) * 100))
        lines = stream.getvalue().splitlines()
        if mode is Mode.off:
            assert lines == []
            continue
        assert 4 <= len(lines) <= 6 and all(ln.startswith("progress: handoffs  ") for ln in lines)
        assert "/30 s" in lines[-1] and "verified" in lines[-1] and "100 handoffs/s" in lines[-1]


# ---- the load knobs ---------------------------------------------------------------------------
def test_burstiness_one_is_the_poisson_schedule_as_before_and_a_gamma_otherwise():
    rng = np.random.Generator(np.random.Philox(key=[7, 0]))
    before = np.cumsum(rng.exponential(1.0 / 500, size=2000))  # the schedule before the knob
    assert np.array_equal(arrival_offsets(500.0, 7, 2000), before)
    assert np.array_equal(arrival_offsets(500.0, 7, 2000, burstiness=1.0), before)
    for shape in (0.25, 4.0):
        gaps = np.diff(arrival_offsets(500.0, 7, 50_000, burstiness=shape), prepend=0.0)
        assert gaps.mean() == pytest.approx(1 / 500, rel=0.05)  # the rate stays workload.rate
        cv2 = gaps.var() / gaps.mean() ** 2  # a gamma's squared CV is 1/shape
        assert cv2 == pytest.approx(1 / shape, rel=0.1)
        assert np.array_equal(arrival_offsets(500.0, 7, 100, burstiness=shape),
                              arrival_offsets(500.0, 7, 100, burstiness=shape))  # seeded
    assert not np.array_equal(arrival_offsets(500.0, 7, 100, rank=0), arrival_offsets(500.0, 7, 100, rank=1))


def test_a_duration_draws_the_arrivals_up_to_it_without_the_ceiling():
    full = arrival_offsets(1000.0, 3, 5000, burstiness=0.5)
    timed = arrival_offsets(1000.0, 3, 10**12, burstiness=0.5, duration_s=2.0)
    assert timed.max() <= 2.0 and 1500 < len(timed) < 2500
    n = min(len(timed), len(full))
    assert np.array_equal(timed[:n], full[:n])  # the same schedule, cut at the duration
    assert len(arrival_offsets(1000.0, 3, 100, duration_s=60.0)) == 100  # the ceiling still holds


@pytest.mark.parametrize("overrides,key", [
    (("workload.burstiness=0.5",), "workload.burstiness"),  # no rate: a closed loop has no gaps
    (("workload.rate=100", "workload.burstiness=0"), "workload.burstiness"),
    (("workload.rate=100", "workload.burstiness=-1"), "workload.burstiness"),
    (("workload.duration_s=0",), "workload.duration_s"),
    (("workload.duration_s=-5",), "workload.duration_s"),
    (("report.percentiles=[99,50]",), "report.percentiles"),
    (("report.percentiles=[50,100.5]",), "report.percentiles"),
    (("report.percentiles=[]",), "report.percentiles"),
    (("logging.progress_every_s=0",), "logging.progress_every_s"),
])
def test_the_new_keys_are_checked(overrides, key):
    with pytest.raises(ConfigError) as err:
        typed_cfg(*overrides)
    assert err.value.key == key and "\n" not in str(err.value)


def test_percentiles_keep_their_keys_and_add_mean_max_and_the_chosen_ones():
    h = LatencyHistogram([float(v) for v in range(1, 1001)])
    p = Percentiles.of(h, (50, 90, 99.9))
    d = p.to_json()
    assert list(d)[:3] == ["p50", "p99", "p999"] and (d["p50"], d["p99"], d["p999"]) == (p.p50, p.p99, p.p999)
    assert d["max"] == 1000.0 and d["mean"] == 500.5
    assert list(d["percentiles"]) == ["p50", "p90", "p99.9"] and d["percentiles"]["p50"] == d["p50"]
    assert d["percentiles"]["p90"] == pytest.approx(900, rel=0.005)
    assert Percentiles.from_json(d) == p
    assert "percentiles" not in Percentiles.of(h).to_json()
    low = 0.1 * 1.005 ** 1500 * 1.0001  # just above a bucket's lower edge: its middle is above it
    top = LatencyHistogram([100.0] * 999 + [low])
    assert top.percentile(100) == top.peak == round(low, 2)  # never past the max
    merged = LatencyHistogram([5.0]).merge(LatencyHistogram([7.0, 2.0]))
    assert merged.peak == 7.0


# ---- sweeps that say how they ended -----------------------------------------------------------
def _job(sweep: Path, num: int, override: str, results: dict) -> None:
    (sweep / str(num) / ".hydra").mkdir(parents=True)
    (sweep / str(num) / ".hydra" / "overrides.yaml").write_text(f"- {override}\n")
    (sweep / str(num) / "results.json").write_text(json.dumps(results))


def _multirun(sweep: Path, task: list[str], sweeper: str = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"):
    import yaml

    sweep.mkdir(parents=True, exist_ok=True)
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"_target_": sweeper, "max_batch_size": None, "params": None},
        "overrides": {"task": task}}}))


def test_an_interrupted_sweep_lists_every_combination(tmp_path):
    from orchestrator.sweep.report import main as report
    from orchestrator.sweep.sweep import collect, summarize, sweep_status, worst_exit

    sweep = tmp_path / "sweep"
    _multirun(sweep, ["workload.requests=200,100000,300", "buffers.size=64"])
    done = {"requests": 200, "verified": 200, "corrupted": 0, "failed": 0, "routes": {"engine": 200},
            "plan": {"mem_pool": "NONE"}, "error": None, "exit_code": 0}
    _job(sweep, 0, "workload.requests=200", done)
    _job(sweep, 1, "workload.requests=100000",
         {**done, "requests": 100000, "verified": 571, "failed": 4, "not_started": 99425,
          "interrupted": True, "signal": "SIGINT", "exit_code": 130})
    columns, rows = collect(sweep)
    assert [(r["job"], r["status"]) for r in rows] == [
        (0, RunStatus.ok), (1, RunStatus.interrupted), (2, RunStatus.not_started)]
    assert rows[2]["workload.requests"] == "300" and rows[2]["buffers.size"] == "64"
    assert sweep_status(sweep) == "3 combinations: 1 ok, 1 interrupted, 1 not started"
    assert worst_exit(sweep) == 130  # a combination never started is no lost job
    summarize(sweep, png=False)
    assert "3 combinations: 1 ok, 1 interrupted, 1 not started." in (sweep / "summary.md").read_text()
    import csv

    with open(sweep / "summary.csv", newline="") as fh:
        assert [r["status"] for r in csv.DictReader(fh)] == ["ok", "interrupted", "not started"]
    assert report([str(sweep)]) == 1  # an interrupted row and one not run: not a 0 (UX IV)
    _multirun(sweep, ["workload.requests=200,100000,300"], sweeper="hydra_plugins.other.Sweeper")
    assert [r["status"] for r in collect(sweep)[1]] == [RunStatus.ok, RunStatus.interrupted]  # cannot tell


# ---- plots ------------------------------------------------------------------------------------
def test_open_loop_latency_png_is_two_by_two_with_every_mark(tmp_path):
    from PIL import Image

    from orchestrator.results.plots import latency_cdf

    rng = np.random.default_rng(1)
    values = list(300 + rng.gamma(2.0, 300.0, size=3000))
    data = {m: {"engine": values} for m in ("send_aux", "taken", "handoff", "from arrival")}
    path = latency_cdf(tmp_path / "latency.png", data, "t")
    width, height = Image.open(path).size
    assert width <= 1400 and height <= 1400


@pytest.mark.parametrize("lo,hi", [(700.0, 8000.0), (300.0, 900.0), (150.0, 30000.0), (80.0, 900000.0)])
def test_log_axes_carry_at_least_three_labelled_ticks(lo, hi):
    from orchestrator.results.plots import log_ticks, pyplot

    plt = pyplot()
    fig, ax = plt.subplots()
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    log_ticks(ax.xaxis, lo, hi)
    fig.canvas.draw()
    labelled = [t for t in ax.get_xticklabels() if t.get_text() and lo <= t.get_position()[0] <= hi]
    plt.close(fig)
    assert len(labelled) >= 3, [t.get_text() for t in labelled]


def test_a_load_sweeps_lines_are_solid_where_dashed_means_p99():
    from orchestrator.results.plots import pyplot
    from orchestrator.sweep.sweep import _lines

    plt = pyplot()
    fig, ax = plt.subplots()
    rows = {(p, "engine"): [(float(x), {"handoffs_per_s": x * 0.9, "e2e_p50_us": 100.0, "e2e_p99_us": 300.0})
                            for x in (100, 1000)] for p in ("NONE", "NVLINK", "BAREX")}
    _lines(ax, "handoffs_per_s", rows, load=True)
    assert {ln.get_linestyle() for ln in ax.get_lines()} == {"-"}
    plt.close(fig)


def test_layout_label():
    from orchestrator.results.plots import layout_label

    assert layout_label(1, 1) == "1 prefill rank -> 1 decode instance (TP 1)"
    assert layout_label(2, 3, 2) == "2 prefill ranks -> 3 decode instances (TP 2 each)"


# ---- the run-dir lock --------------------------------------------------------------------------
def test_the_lock_file_goes_at_the_end_and_a_second_run_never_shares_it(tmp_path, monkeypatch):
    import fcntl

    from orchestrator.results.rundir import LOCK_NAME, RunDirBusy, lock_run_dir, unlock_run_dir

    run_dir = tmp_path / "run"
    first = lock_run_dir(run_dir)
    with pytest.raises(RunDirBusy):
        lock_run_dir(run_dir)
    unlock_run_dir(first)
    assert not (run_dir / LOCK_NAME).exists()

    # a run that opened the file just before its holder removed it locks a file nobody names:
    # it must take the one the path names instead (the race forced by a hook, not by timing)
    real, calls = fcntl.flock, []

    def flock(fh, op):
        real(fh, op)
        if not calls:
            calls.append(op)
            (run_dir / LOCK_NAME).unlink()  # the holder's last act, between our open and lock
    monkeypatch.setattr(fcntl, "flock", flock)
    second = lock_run_dir(run_dir)
    monkeypatch.undo()
    assert calls and (run_dir / LOCK_NAME).exists()
    import os

    assert os.fstat(second.fileno()).st_ino == os.stat(run_dir / LOCK_NAME).st_ino
    with pytest.raises(RunDirBusy):
        lock_run_dir(run_dir)
    other = run_dir / LOCK_NAME
    other.unlink()
    other.write_text("someone else\n")  # a file that is not ours is not removed
    unlock_run_dir(second)
    assert other.read_text() == "someone else\n"


# ---- one real run: every knob at once ---------------------------------------------------------
@pytest.mark.integration
def test_a_timed_coalesced_run_shows_progress_and_keeps_its_run_dir_clean(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "workload.duration_s=1", "workload.requests=10000000",
         "transport.coalesce=true", "workload.batch_size=4", "workload.concurrency=16",
         "logging.progress=true", "logging.progress_every_s=0.5", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((run_dir / "results.json").read_text())
    assert 0 < res["verified"] == res["requests"] < 10_000_000 and res["not_started"] == 0
    assert res["workload"]["duration_s"] == 1.0 and res["warnings"] == []
    handoff = res["latency_us"]["handoff"]
    assert {"p50", "p99", "p999", "mean", "max", "percentiles"} <= set(handoff)
    assert list(handoff["percentiles"]) == ["p50", "p90", "p99", "p99.9"]
    assert handoff["max"] >= handoff["p999"] and res["requests_per_send"] >= 1
    assert "requests per send" in proc.stdout
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("progress: ")]
    assert any(ln.startswith("progress: starting processes") for ln in progress), proc.stderr
    assert any(ln.startswith("progress: handoffs") and "verified" in ln for ln in progress), proc.stderr
    assert not (run_dir / ".run.lock").exists()
    stderr_log = (run_dir / "prefill.stderr.log").read_text(errors="replace")
    assert "Batch Transfer completed" not in stderr_log and len(stderr_log) < 2000
    host = json.loads((run_dir / "fingerprint.json").read_text())["host"]
    assert host["cpu_count"] >= 1 and len(host["load_avg"]) == 3
    assert (run_dir / "latency.png").exists()


def test_a_lost_rank_of_a_timed_run_counts_what_arrived_not_its_ceiling(tmp_path):
    from orchestrator.job.recovery import reconstruct
    from orchestrator.results.outcomes import Detail, Outcome
    from orchestrator.results.records import Record

    from .conftest import report_spec

    cfg = typed_cfg("workload.duration_s=5", "workload.requests=10000000")
    lines = [Record(rid, rid, 0, rid, "engine", 1.0, 2.0, 3.0, 4.0, Outcome.verified, Detail.none, "c").line()
             for rid in range(12)]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    res = reconstruct(report_spec(cfg), tmp_path, 0, "prefill", Detail.prefill_lost, route="engine")
    assert (res.requests, res.verified, res.finished, res.not_started) == (12, 12, 12, 0)

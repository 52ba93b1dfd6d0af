"""A run's outputs in its run dir, opened once before the handoffs and finished once after
them (orchestrator.job.app calls each once, with the report's spec, the plan's description
in it, never the config):

- `open_outputs`: the run's log (the plan first), fingerprint.json, the live progress line and
  latency.png's drawer, kept by the job as `RunOutputs`;
- `finish_outputs`: the run's results (reporting.build_results, or build_decode_side for
  role=decode), results.json, the summary (printed, and kept as summary.txt), latency.png.

A full disk is handed back, not said: how a job ends and the line it says are the failure
table's (orchestrator.job.failure), a floor above this one."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from structlog.stdlib import BoundLogger

from orchestrator.profile.kinds import Role
from orchestrator.results import fingerprint, plots, reporting
from orchestrator.results.logs import configure
from orchestrator.results.progress import ProgressMeter, mode_for
from orchestrator.results.records import RunResult
from orchestrator.results.report_spec import ReportSpec
from orchestrator.results.rundir import NoSpace, RunFiles, write_atomic
from orchestrator.results.schema import DecodeSideResults, JobResults, Results

SUMMARY_TXT = "summary.txt"


def open_outputs(run_dir: Path, spec: ReportSpec, drawn: bool) -> RunOutputs:
    """Before the handoffs: the run's structured log (logging.console: on the console too),
    opened with the plan; fingerprint.json (`drawn`: the seed was drawn for this run, replay
    passes it back); the progress line and latency.png's drawer (a run of the prefill side)."""
    c = spec.console
    log = configure(run_dir, "orchestrator", keep_root_handlers=True,
                    console_level=logging.INFO if c.console else logging.WARNING)
    log.info("plan", **spec.plan.data)
    for event in spec.plan.events:
        log.warning(event["event"], reason=event["reason"], detail=event["detail"])
    fp = fingerprint.collect(spec.load.seed, spec.plan)
    fp["seeds"]["drawn"] = drawn  # replay passes a drawn seed back (orchestrator.replay)
    write_atomic(run_dir / "fingerprint.json", json.dumps(fp, indent=2) + "\n")
    w, side = spec.load, spec.role is not Role.decode
    total = w.requests * spec.ranks.prefill  # requests are per prefill rank
    progress = (ProgressMeter(total if w.duration_s is None else None, log, every_s=c.progress_every_s,
                              mode=mode_for(c.progress, c.console), duration_s=w.duration_s)
                if side else None)
    return RunOutputs(run_dir, spec, log, progress, plots.Drawer(run_dir) if side else None)


@dataclass
class RunOutputs:
    """One run's outputs: its run dir, the report's spec, its log, its progress line and
    latency.png's drawer (None for role=decode)."""

    run_dir: Path
    spec: ReportSpec
    log: BoundLogger
    progress: Optional[ProgressMeter]
    drawer: Optional[plots.Drawer]

    def handoffs_ended(self) -> None:
        """The drawer starts (it imports matplotlib while the endpoints wind down)."""
        if self.drawer is not None:
            self.drawer.start()

    def close_progress(self) -> None:
        """The progress line is cleared: the summary follows."""
        if self.progress is not None:
            self.progress.close()


def finish_outputs(run: RunOutputs, out: RunResult, verbose: bool = False) -> tuple[Results, Optional[NoSpace]]:
    """The run's results from what it measured (`out`); results.json, the summary as soon as
    it is written, then latency.png (drawn by the drawer's process, waited for here);
    `verbose`: the start-up phases line too. Returns the results and the full disk it ended
    on, if any (the file an endpoint or the runner could not write, or one of these)."""
    spec, run_dir, drawer = run.spec, run.run_dir, run.drawer
    results = (reporting.build_decode_side(spec, out) if spec.role is Role.decode
               else reporting.build_results(spec, out))
    results.role, results.run_dir = spec.role.value, str(run_dir)
    if out.no_space is not None:  # an endpoint's file, or a record the runner appended
        full = NoSpace(out.no_space)
        results.failed_writing(str(full))
        try:
            _write(run, results)
        except NoSpace:
            pass
        return _full(run, results, full)
    try:
        _write(run, results, drawer)
    except NoSpace as exc:  # after start: one line, exit 3, nothing torn or empty left
        results.failed_writing(str(exc))
        return _full(run, results, exc)
    run.log.info("results", **results.headline())
    late = (isinstance(results, JobResults) and _plotted(spec, results) and results.ending.interrupted
            and results.latency_us.send_aux.measured)  # an interrupted run's latency.png
    text = reporting.summary(results, run_dir, plot=late, drawing=drawer is not None and drawer.asked)
    print(text, flush=True)
    _save_summary(run_dir, text)
    drawn = drawer.wait() if drawer is not None else None  # (after the summary: off its path)
    if drawn == "no space":
        full = NoSpace(run_dir / plots.LATENCY_PNG)
        results.failed_writing(str(full))
        write_unless_full(run_dir, results, full)
        return results, full
    if drawn is not None:
        print(f"warning: {plots.LATENCY_PNG} not drawn: {drawn}", file=sys.stderr, flush=True)
    if verbose:
        print(phases_line(results), flush=True)
    if late:  # drawn beside and after this process's exit: a stop ends in about 2 s
        assert isinstance(results, JobResults)
        plots.draw_later(run_dir, _title(run, results), spec.load.rate is not None, spec.percentiles)
    return results, None


def _full(run: RunOutputs, results: Results, full: NoSpace) -> tuple[Results, NoSpace]:
    """The disk filled: the drawer waited for, results.json where it still fits."""
    if run.drawer is not None:
        run.drawer.wait()
    write_unless_full(run.run_dir, results, full)
    return results, full


def _plotted(spec: ReportSpec, results: Results) -> bool:
    """Whether this run draws latency.png (a run of the prefill side)."""
    return spec.role is not Role.decode and isinstance(results, JobResults)


def _write(run: RunOutputs, results: JobResults | DecodeSideResults, drawer: Optional[plots.Drawer] = None) -> None:
    """results.json, then latency.png: by the drawer where it started (when the handoffs
    ended), else here; an interrupted run's after its summary."""
    reporting.write(run.run_dir, results)
    spec = run.spec
    if _plotted(spec, results) and not results.ending.interrupted:
        assert isinstance(results, JobResults)  # (_plotted)
        if drawer is not None and drawer.proc is not None:
            drawer.draw(_title(run, results), spec.load.rate is not None, spec.percentiles)
        else:
            _png(run, results)


def _title(run: RunOutputs, results: JobResults) -> str:
    """latency.png's title: the plan, the transport, the rank/TP layout, the run."""
    plan, e = results.plan, run.spec.ranks
    transport = results.transports.effective_transport or plan.declared_transport
    ended = " (interrupted: what ran)" if results.ending.interrupted else ""
    layout = plots.layout_label(e.prefill, e.decode, e.decode_tp)
    return (f"mem_pool={plan.mem_pool}, buffers on {plan.buffer_device}, {transport}; {layout}\n"
            f"run {plots.short_dir(run.run_dir)}{ended}")


def _png(run: RunOutputs, results: JobResults) -> None:
    """latency.png: the CDFs of the run's latencies, the summary's own marks on them."""
    png = run.run_dir / plots.LATENCY_PNG
    lat = results.latency_us
    try:
        plots.run_latency_png(run.run_dir, _title(run, results),
                              marks={"send_aux": lat.send_aux, "taken": lat.taken,
                                     "handoff": lat.handoff, "from arrival": lat.e2e},
                              arrival=run.spec.load.rate is not None, qs=run.spec.percentiles)
    except OSError as exc:
        png.unlink(missing_ok=True)  # no torn or empty image left behind
        if exc.errno in (28, 122):
            raise NoSpace(png) from None
        raise


def write_unless_full(run_dir: Path, results: Results, full: NoSpace) -> None:
    """results.json says how the run ended, unless it is the file that did not fit."""
    if full.path.name != RunFiles.RESULTS:
        try:
            reporting.write(run_dir, results)
        except OSError:
            pass


def _save_summary(run_dir: Path, text: str) -> None:
    """summary.txt: the console's summary, as printed (a full disk loses only this copy)."""
    try:
        write_atomic(run_dir / SUMMARY_TXT, text + "\n")
    except (OSError, NoSpace):
        pass


def phases_line(results: JobResults | DecodeSideResults) -> str:
    """hydra.verbose: each process's start-up, phase by phase (results.json startup_phases)."""
    per = results.timing.startup_phases or {}
    return "start-up phases (s): " + ("; ".join(
        f"{name} " + ", ".join(f"{phase} {s:g}" for phase, s in phases.items()) for name, phases in per.items())
        or "none measured")

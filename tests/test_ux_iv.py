"""UX IV (issue 40): a README a newcomer reads in five minutes, honest exits, one error line for
every output-path mistake, a console that is the summary and `warning:` lines, readable outputs,
docs that cannot drift."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from .conftest import ROOT


def _cli(*args: str, cwd: Path = ROOT, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


# ---- 3. flags in any position, one line for an output-path mistake ------------------------------
@pytest.mark.parametrize("argv,expected", [
    (["a=1", "--cfg", "job", "b=2"], ["--cfg", "job", "a=1", "b=2"]),
    (["a=1", "--cfg", "job", "hydra.output_subdir=null"], ["--cfg", "job", "a=1", "hydra.output_subdir=null"]),
    (["x=1", "--info", "config", "y=2"], ["--info", "config", "x=1", "y=2"]),
    (["x=1", "--info", "y=2"], ["--info", "x=1", "y=2"]),  # --info's value is optional
    (["-m", "a=1,2", "--config-dir", "/d"], ["-m", "--config-dir", "/d", "a=1,2"]),
    (["a=1", "--help"], ["--help", "a=1"]),
])
def test_hydra_flags_go_before_the_overrides(argv, expected):
    from orchestrator.preflight.compose import flags_first

    assert flags_first(argv) == expected


def test_a_trailing_cfg_job_prints_the_config():
    """docs/sweeps.md's form: failed with `unrecognized arguments: hydra.output_subdir=null`."""
    proc = _cli("buffers.hidden_size=4096", "mem_pool=NVLINK", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "hidden_size: 4096" in proc.stdout and "unrecognized" not in proc.stderr


@pytest.mark.parametrize("argv,says", [
    (["hydra.run.dir=/proc/x"], "hydra.run.dir=/proc/x: cannot create a directory in /proc"),
    (["hydra.run.dir=/dev/null/x"], "hydra.run.dir=/dev/null/x: /dev/null is not a directory"),
    (["-m", "hydra.sweep.dir=/proc/x", "workload.requests=10,20"],
     "hydra.sweep.dir=/proc/x: cannot create a directory in /proc"),
    (["hydra.run.dir=/proc/x/${now:%H}"], "hydra.run.dir=/proc/x/${now:%H}: cannot create a directory in /proc"),
    (["--config-dir", "/nonexistent-ux-iv"], "--config-dir /nonexistent-ux-iv: does not exist"),
])
def test_an_output_path_mistake_is_one_line(argv, says):
    from orchestrator.preflight.compose import precheck

    problem = precheck(argv)
    assert problem is not None and problem.startswith(says), problem


def test_a_run_dir_that_is_a_file_or_unwritable(tmp_path, monkeypatch):
    from orchestrator.preflight import compose

    afile = tmp_path / "afile"
    afile.write_text("")
    assert compose.precheck([f"hydra.run.dir={afile}"]) == f"hydra.run.dir={afile}: {afile} is not a directory"

    def refuse(**_kw):  # root writes anywhere: the refusal the probe meets, forced
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkdtemp", refuse)
    assert compose.precheck([f"hydra.run.dir={tmp_path}/run"]) == (
        f"hydra.run.dir={tmp_path}/run: cannot create a directory in {tmp_path} (Permission denied)")
    assert list(tmp_path.iterdir()) == [afile]  # the probe leaves nothing


def test_the_proc_run_dir_is_exit_2_without_a_traceback(tmp_path):
    proc = _cli("hydra.run.dir=/proc/x", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: hydra.run.dir=/proc/x: cannot create a directory in /proc (No such file or directory)"]
    assert not (tmp_path / "outputs").exists()


# ---- 2. honest exits -------------------------------------------------------------------------
def _fake_run(outcomes: list[str]):
    """run_handoffs for the bench, each call the next outcome: "fail" (a side sent nothing) or
    "ok" (a row with no phases)."""
    from orchestrator.sweep.bench import PathResult

    calls: list[Path] = []

    def run(specs, run_dir, **_kw):
        calls.append(run_dir)
        ok = outcomes[len(calls) - 1] == "ok"
        paths = {"p": PathResult("p", "mooncake-tcp", 1600, 10)} if ok else {}
        return SimpleNamespace(paths=paths, error=None if ok else "prefill: sent nothing for 15 s", lost={},
                               interrupted=None, startup_s=1.0, startup_by_process={"prefill": 1.0},
                               gpu_sharing={})
    return run, calls


@pytest.mark.parametrize("outcomes,code", [(["fail", "fail"], 1), (["fail", "ok"], None), (["ok"], None)])
def test_a_bench_row_is_retried_once_then_failed(outcomes, code, tmp_path, monkeypatch, capsys):
    import dataclasses

    from orchestrator.bench import bench_spec
    from orchestrator.profile.config import validate
    from orchestrator.profile.platform import detect
    from orchestrator.sweep import bench

    from .conftest import compose_cfg

    spec = bench_spec(validate(compose_cfg()), detect())
    one = spec.paths[:1]
    spec = dataclasses.replace(spec, paths=one)
    run, calls = _fake_run(outcomes)
    monkeypatch.setattr(bench, "run_handoffs", run)
    if code is None:
        bench.run_bench(spec, tmp_path)
    else:
        with pytest.raises(SystemExit) as exc:
            bench.run_bench(spec, tmp_path)
        assert exc.value.code == code
    assert len(calls) == len(outcomes)
    md = (tmp_path / "bench.md").read_text()
    row = json.loads((tmp_path / "bench.json").read_text())["paths"][0]
    err = capsys.readouterr().err
    if outcomes == ["fail", "fail"]:
        assert f"| {one[0].name} | FAILED: prefill: sent nothing for 15 s (its retry; first try" in md
        assert row["retried"] == "prefill: sent nothing for 15 s"
        assert f"bench: 1 of 1 rows FAILED (each after one retry): {one[0].name}" in err
        assert "retrying it once" in err
    elif outcomes == ["fail", "ok"]:
        assert "error" not in row and row["retried"] == "prefill: sent nothing for 15 s"
        assert "FAILED" not in err
    else:
        assert "retried" not in row and "retry" not in err


def test_report_exits_1_when_a_row_is_not_ok(tmp_path):
    from orchestrator.sweep.report import main as report

    from .test_sweep import _job, _ok_results

    _job(tmp_path, 0, ["buffers.size=64"], _ok_results(16, "NONE", "engine", 500.0, 800.0))
    assert report([str(tmp_path)]) == 0
    failed = _ok_results(16, "NONE", "engine", 500.0, 800.0)
    failed.update(verified=97, failed=3, exit_code=1)
    _job(tmp_path, 1, ["buffers.size=128"], failed)
    assert report([str(tmp_path)]) == 1


# ---- 4. the console: the summary and warning: lines ----------------------------------------------
def test_a_structured_warning_is_one_plain_line_and_repeats_are_counted(tmp_path, capsys):
    import logging

    from orchestrator.results import logs

    log = logs.configure(tmp_path, "decode")
    log.warning("fallback", reason="degraded_no_cuda", detail="host buffers, engine over tcp")
    for rid in range(19):
        log.warning("handoff_rejected", prefill=0, rid=rid, detail="room_never_landed")
    log.info("plan", route="engine")
    logging.getLogger().handlers[-1].flush()
    out = capsys.readouterr().out.splitlines()
    assert out == ["warning: fallback: host buffers, engine over tcp (degraded_no_cuda)"]
    assert logs.repeated_warnings(tmp_path) == ["19 handoffs rejected (room_never_landed): see decode.log"]
    with open(tmp_path / "decode.log", "a") as fh:  # a rate-limited event carries a running count
        for n in (1, 2, 3, 1000):
            fh.write(json.dumps({"event": "control_rejected", "level": "warning", "count": n,
                                 "reason": "bad or missing MAC"}) + "\n")
    assert logs.repeated_warnings(tmp_path)[1] == "1000 control messages rejected (bad or missing MAC): see decode.log"
    logs.configure(tmp_path, "decode", console_level=logging.INFO)  # logging.console=true: every line
    structlog_line = logs.structlog.get_logger("orchestrator")
    structlog_line.warning("handoff_rejected", rid=1, detail="room_never_landed")
    assert "handoff_rejected" in capsys.readouterr().out
    logs.configure(None, "test")


@pytest.mark.parametrize("phase", ["importing", "composing the config", "starting the job"])
def test_an_early_interrupt_names_the_phase(phase, capsys, monkeypatch):
    import orchestrator.__main__ as entry

    monkeypatch.setattr(entry, "_PHASE", [phase])
    with pytest.raises(SystemExit) as exc:
        entry._interrupted(signal.SIGINT)
    assert exc.value.code == 130
    assert capsys.readouterr().err.strip() == f"interrupted (SIGINT) while {phase}: no job was running"


def test_the_app_phase_wins_while_a_job_prepares(capsys, monkeypatch):
    import orchestrator.__main__ as entry
    from orchestrator.job import app

    monkeypatch.setattr(app, "PHASE", ["preparing the run dir"])
    with pytest.raises(SystemExit):
        entry._interrupted(signal.SIGTERM)
    assert "interrupted (SIGTERM) while preparing the run dir" in capsys.readouterr().err


@pytest.mark.integration
def test_aux_lost_console_is_the_summary_with_one_counted_line(tmp_path):
    """The run docs/preflight.md shows: 19 rejections, one counted line, no structlog line; the
    latency line follows report.percentiles; summary.txt is what the console printed."""
    run_dir = tmp_path / "run"
    proc = _cli("faults=aux_lost", "workload.requests=200", "buffers.size=16", "transport.timeout_s=1",
                f"hydra.run.dir={run_dir}", "logging.progress=false", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout.splitlines()
    assert "handoff_rejected" not in proc.stdout + proc.stderr
    assert "warning: 19 handoffs rejected (room_never_landed): see decode.log" in out
    assert any(x.startswith("slots held by 19 room_never_landed rows") for x in out)
    assert out[2].startswith("latency us p50/p90/p99/p99.9: send_aux ")
    assert (run_dir / "summary.txt").read_text().splitlines() == out


@pytest.mark.integration
def test_degrade_prints_a_warning_line_not_a_structlog_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA there is no fallback to say")
    proc = _cli("mem_pool=INTRA_NODE_NVLINK", "transport.fallback=degrade", "workload.requests=50",
                "'report.percentiles=[50,99.9]'".strip("'"), f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == ("warning: fallback: INTRA_NODE_NVLINK wants CUDA buffers but no CUDA device is visible: "
                        "host buffers, engine over tcp (degraded_no_cuda)")
    assert not re.search(r"\[warning|\d{4}-\d\d-\d\dT", proc.stdout + proc.stderr)
    assert any(x.startswith("latency us p50/p99.9: send_aux ") for x in lines)


# ---- 5. readable outputs ---------------------------------------------------------------------
def test_summary_md_is_a_short_table(tmp_path):
    from orchestrator.sweep.sweep import summarize

    from .test_sweep import _job, _ok_results

    _job(tmp_path, 0, ["buffers.size=64"], _ok_results(16, "NONE", "engine", 500.0, 800.0))
    _job(tmp_path, 1, ["buffers.size=128"], {"requests": 10, "verified": 0, "corrupted": 0, "failed": 10,
                                             "routes": {}, "error": "boom"})
    _, md, _ = summarize(tmp_path, png=False) + [None]
    table = [x for x in md.read_text().splitlines() if x.startswith("|")]
    assert table[0] == ("| job | buffers.size | status | verified | failed | handoffs/s | handoff p50 us | "
                        "handoff p99 us | error |")
    assert table[2].startswith("| 0 | 64 | ok | 100/100 | 0 | 800.0 |") and table[3].endswith("| boom |")
    assert "summary.csv" in md.read_text().splitlines()[-1]
    header = (tmp_path / "summary.csv").read_text().splitlines()[0].split(",")
    assert len(header) > 3 * (table[0].count("|") - 1)  # the full table is the csv's


def test_mark_labels_never_overlap(tmp_path):
    """A saturated open loop: from arrival's p90, p99 and p99.9 at nearly one x (issue 40's PNG)."""
    import numpy as np

    from orchestrator.results.plots import latency_figure, pyplot

    rng = np.random.default_rng(3)
    send = list(300 + rng.gamma(2.0, 300.0, size=2000))
    arrival = sorted(list(rng.uniform(1e4, 4.6e6, size=1800)) + [4.66e6 + i for i in range(200)])
    data = {"send_aux": {"engine": send}, "taken": {"engine": send}, "handoff": {"engine": send},
            "from arrival": {"engine": arrival}}
    fig = latency_figure(data, "t", qs=[50, 90, 99, 99.9])
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        texts = [t for t in ax.texts if t.get_text().startswith(" p")]
        assert len(texts) == 4, [t.get_text() for t in texts]  # every report.percentiles mark
        boxes = [t.get_window_extent(renderer) for t in texts]
        inside = ax.get_window_extent(renderer)
        for i, a in enumerate(boxes):
            assert inside.x0 <= a.x0 and a.x1 <= inside.x1 and inside.y0 <= a.y0 and a.y1 <= inside.y1
            assert not any(a.overlaps(b) for b in boxes[i + 1:]), texts[i].get_text()
    pyplot().close(fig)


# ---- 6. docs that cannot drift -----------------------------------------------------------------
@pytest.mark.parametrize("line,shape", [
    ("start-up 11 s (prefill 8, decode 9) excluded", "start-up # s (prefill #, decode #) excluded"),
    ("start-up 11.505 s (prefill 11.48, decode 11.38) excluded", "start-up # s (prefill #, decode #) excluded"),
    ("734.8 handoffs/s, 1,176 rows, 12,345,678.5 us", "# handoffs/s, # rows, # us"),
    ("p50 1,333, p99 -2.5e-3", "p# #, p# #"),
])
def test_the_number_mask_keeps_the_comma_after_a_whole_number(line, shape):
    from tools.doc_samples import shape as mask

    assert mask(line) == shape


def test_a_sample_that_hides_lines_says_how_many():
    from tools.doc_samples import Sample, differences, regenerate

    fresh = ["a 1", "b 2", "c 3", "d 4", "e 5"]
    shown = ["a 1", "...", "d 4"]
    sample = Sample(ROOT / "README.md", "x", 0, 4, shown, False)
    assert regenerate(sample, fresh, 0) == ["a 1", "... 2 lines ...", "d 4"]
    assert differences(sample, fresh, 0) != []  # a bare `...` must say how many
    counted = Sample(ROOT / "README.md", "x", 0, 4, ["a 1", "... 2 lines ...", "d 4", "... 1 line ..."], False)
    assert differences(counted, fresh, 0) == []
    assert regenerate(counted, fresh, 0)[-1] == "... 1 line ..."


def test_the_layout_table_lists_every_module():
    from tools.layout_table import table

    text = table()
    for path in (ROOT / "orchestrator").rglob("*.py"):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            row = next(x for x in text.splitlines() if x.startswith(
                f"| `orchestrator/{path.parent.relative_to(ROOT / 'orchestrator')}/`".replace("/./", "/")))
            assert f"`{path.stem}`" in row, path
    assert "<!-- generated: layout -->" in (ROOT / "CONTRIBUTING.md").read_text()


def test_the_readme_is_a_guide():
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 1200
    assert "make run" in text and "make test" in text and "\n$ python -m orchestrator\n" in text
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    assert not re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", prose)  # no commit hashes
    assert "docs/index.md" in text
    index = (ROOT / "docs" / "index.md").read_text()
    for task in ("run", "sweep", "preflight a deployment", "benchmark", "multiple hosts", "reliability"):
        assert task in index.lower(), task
    for link in re.findall(r"\]\(([^)#]+)\)", index):
        assert (ROOT / "docs" / link).resolve().exists(), link


def test_an_unwritable_working_dir_names_the_default_run_dir(tmp_path, monkeypatch):
    from orchestrator.preflight import compose

    def refuse(**_kw):  # as root every dir is writable: the refusal forced
        raise PermissionError(13, "Permission denied")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tempfile.mkdtemp", refuse)
    assert compose.precheck([]) == (
        f"hydra.run.dir=outputs/${{now:%Y-%m-%d}}/${{now:%H-%M-%S-%f}}: cannot create a directory in {tmp_path} "
        "(Permission denied) (the default; set hydra.run.dir=DIR to write elsewhere)")


@pytest.mark.parametrize("codes,exit_code", [((3, 3), 0), ((3, 0), 1), ((0, 0), 0)])
def test_replay_exits_1_when_the_run_now_ends_otherwise(codes, exit_code, tmp_path, monkeypatch):
    """Identical outputs, but the replay ended with another exit code: not a 0 (the process
    that re-runs and the comparison are replaced; the exit rule is what is checked)."""
    from orchestrator.sweep import replay

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    for name in (".hydra/config.yaml", "results.json", "fingerprint.json", "requests.jsonl", "decisions.jsonl"):
        (run / name).write_text("{}\n")
    out = tmp_path / "replay"

    def rerun(cmd, **_kw):
        out.mkdir()
        (out / "results.json").write_text("{}\n")
        return SimpleNamespace(returncode=codes[1], stderr="")

    monkeypatch.setattr(replay.subprocess, "run", rerun)
    monkeypatch.setattr(replay, "task_config", lambda run_dir: {})  # its checks: tests/test_trust_iv.py
    monkeypatch.setattr(replay, "compare", lambda a, b: {
        "requests_identical": True, "decisions_identical": True,
        "exit_codes": {"original": codes[0], "replay": codes[1]}})
    monkeypatch.setattr(replay, "render", lambda rep: "")
    assert replay.main([str(run), "--out", str(out)]) == exit_code

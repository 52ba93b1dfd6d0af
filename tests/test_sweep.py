"""Sweep summaries: summarize() on a synthetic sweep dir, and one real multirun end to end
through the command line, plus `python -m orchestrator.report`."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.sweep.sweep import RESULT_COLUMNS, SweepError, summarize

from .conftest import ROOT

pytestmark = pytest.mark.xdist_group("sweep")  # one worker: the real sweep is run once

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ok_results(hidden: int, mem_pool: str, route: str, send_p50: float, rate: float) -> dict:
    """What report.build_results writes for a fully verified job (the keys summarize reads)."""
    row_bytes = 1536 + hidden * 4
    lat = {"p50": send_p50, "p99": send_p50 * 3, "p999": send_p50 * 5}
    return {
        "requests": 100, "verified": 100, "corrupted": 0, "failed": 0,
        "routes": {route: 100}, "failure_reasons": {},
        "latency_us": {"send_aux": lat,
                       "deliver": {"p50": 900.0, "p99": 1800.0, "p999": 2000.0},
                       "handoff": {"p50": 5000.5, "p99": 9000.0, "p999": 9500.25}},
        "handoffs_per_s": rate, "mb_per_s": round(rate * row_bytes / 1e6, 3),
        "bytes_per_request": row_bytes, "wall_s": 0.12,
        "effective_transport": "mooncake-tcp" if route == "engine" else "zmq-tcp",
        "declared_transport": "mooncake-tcp", "endpoint_transports": {},
        "decode_stats": {}, "plan": {"mem_pool": mem_pool, "buffer_device": "cpu",
                                     "route": route, "route_reason": "engine_default"},
        "error": None,
    }


def _job(sweep: Path, num: int, overrides: list[str], results: dict | None) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if results is not None:
        (job / "results.json").write_text(json.dumps(results, indent=2))


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


@pytest.fixture
def synthetic_sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "multirun" / "2026-11-30" / "09-00-00"
    _job(sweep, 0, ["buffers.hidden_size=16", "mem_pool=NONE", "hydra.job.chdir=false"],
         _ok_results(16, "NONE", "engine", 520.5, 830.0))
    _job(sweep, 1, ["buffers.hidden_size=4096", "mem_pool=NVLINK"],
         _ok_results(4096, "NVLINK", "tcp", 180.25, 1180.0))
    # What app.failed_job writes.
    _job(sweep, 2, ["buffers.hidden_size=7168", "mem_pool=INTRA_NODE_NVLINK"],
         {"requests": 100, "verified": 0, "corrupted": 0, "failed": 100, "routes": {},
          "error": "mem_pool=INTRA_NODE_NVLINK needs CUDA | strict"})
    # Crashed before writing results.json; 10 sorts after 2 (by number, not by name).
    _job(sweep, 10, ["buffers.hidden_size=16", "workload.seed=7"], None)
    (sweep / ".submitit").mkdir()            # not a job dir
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return sweep


def test_summarize_rows_and_columns(synthetic_sweep: Path) -> None:
    paths = summarize(synthetic_sweep)
    assert paths == [synthetic_sweep / "summary.csv", synthetic_sweep / "summary.md",
                     synthetic_sweep / "summary.png"]
    columns, rows = _read_csv(paths[0])
    # Swept keys in order of appearance; hydra.* left out; mem_pool (a result column too)
    # gets its own name.
    assert columns == ["job", "buffers.hidden_size", "override:mem_pool", "workload.seed",
                       *RESULT_COLUMNS]
    assert [r["job"] for r in rows] == ["0", "1", "2", "10"]
    assert [r["status"] for r in rows] == ["ok", "ok", "error", "missing"]
    ok0, ok1, err, missing = rows
    assert ok0["buffers.hidden_size"] == "16" and ok0["override:mem_pool"] == "NONE"
    assert ok0["workload.seed"] == ""
    assert ok0["routes"] == "engine=100" and ok0["mem_pool"] == "NONE" and ok0["route"] == "engine"
    assert ok0["send_aux_p50_us"] == "520.5" and ok0["send_aux_p999_us"] == "2602.5"
    assert ok0["handoff_p50_us"] == "5000.5" and ok0["handoff_p999_us"] == "9500.25"
    assert ok0["handoffs_per_s"] == "830.0" and ok0["bytes_per_request"] == "1600"
    assert ok0["effective_transport"] == "mooncake-tcp" and ok0["error"] == ""
    assert ok1["routes"] == "tcp=100" and ok1["mem_pool"] == "NVLINK" and ok1["route"] == "tcp"
    assert err["requests"] == "100" and err["verified"] == "0" and err["failed"] == "100"
    assert err["routes"] == "" and err["mem_pool"] == "" and err["send_aux_p50_us"] == ""
    assert err["override:mem_pool"] == "INTRA_NODE_NVLINK"
    assert err["error"] == "mem_pool=INTRA_NODE_NVLINK needs CUDA | strict"
    assert missing["buffers.hidden_size"] == "16" and missing["workload.seed"] == "7"
    assert missing["requests"] == "" and missing["error"] == "no results.json"


def test_summarize_md_and_png(synthetic_sweep: Path) -> None:
    _, md, png = summarize(synthetic_sweep)
    text = md.read_text()
    lines = text.splitlines()
    assert lines[0] == f"# Sweep summary: {synthetic_sweep}"
    table = [ln for ln in lines if ln.startswith("|")]
    assert len(table) == 2 + 4                       # header, rule, one row per job
    assert table[0].startswith("| job | buffers.hidden_size | override:mem_pool |")
    assert all(ln.count(" | ") == table[0].count(" | ") for ln in table[2:])
    assert "needs CUDA \\| strict" in text           # a | in a cell does not split it
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000


def test_summarize_partial_and_all_failed(tmp_path: Path) -> None:
    partial = _ok_results(16, "NONE", "engine", 500.0, 800.0)
    partial.update(verified=97, failed=3)
    _job(tmp_path, 0, ["buffers.size=64"], partial)
    _job(tmp_path, 1, ["buffers.size=128"], {"requests": 10, "verified": 0, "corrupted": 0,
                                            "failed": 10, "routes": {}, "error": "boom"})
    paths = summarize(tmp_path)                      # nothing ok: still csv, md and png
    _, rows = _read_csv(paths[0])
    assert [r["status"] for r in rows] == ["failed", "error"]
    assert paths[2].read_bytes()[:8] == PNG_MAGIC


def test_summarize_not_a_sweep(tmp_path: Path) -> None:
    with pytest.raises(SweepError):
        summarize(tmp_path / "nope")
    with pytest.raises(SweepError):
        summarize(tmp_path)                          # exists, no job subdirs
    assert not (tmp_path / "summary.csv").exists()


# -- end to end: a real two-job sweep through the command line -------------------------

@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sweep = tmp_path_factory.mktemp("sweep") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "-m", "buffers.hidden_size=16,4096",
         "workload.requests=100", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"sweep summary: {sweep / 'summary.csv'}" in proc.stdout
    return sweep


@pytest.mark.integration
@pytest.mark.slow
def test_real_sweep_summary(real_sweep: Path) -> None:
    columns, rows = _read_csv(real_sweep / "summary.csv")
    assert columns[:3] == ["job", "buffers.hidden_size", "workload.requests"]
    assert len(rows) == 2
    assert [r["buffers.hidden_size"] for r in rows] == ["16", "4096"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["verified"] == r["requests"] == "100"
        assert r["routes"] == "engine=100" and r["error"] == ""
        assert float(r["send_aux_p50_us"]) > 0 and float(r["handoffs_per_s"]) > 0
    assert int(rows[1]["bytes_per_request"]) > int(rows[0]["bytes_per_request"])
    assert (real_sweep / "summary.md").read_text().startswith("# Sweep summary:")
    assert (real_sweep / "summary.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.integration
@pytest.mark.slow
def test_report_cli_rebuilds(real_sweep: Path) -> None:
    names = ("summary.csv", "summary.md", "summary.png")
    for name in names:
        (real_sweep / name).unlink()
    proc = subprocess.run([sys.executable, "-m", "orchestrator.report", str(real_sweep)],
                          cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [Path(p).resolve() for p in proc.stdout.split()] == [real_sweep / n for n in names]
    _, rows = _read_csv(real_sweep / "summary.csv")
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert all((real_sweep / n).stat().st_size > 0 for n in names)


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_report_cli_bad_dir(tmp_path: Path, where: str) -> None:
    bad = tmp_path / "nope" if where == "missing" else tmp_path
    proc = subprocess.run([sys.executable, "-m", "orchestrator.report", str(bad)],
                          cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert str(bad) in proc.stderr

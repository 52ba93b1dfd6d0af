"""Replay: a run dir re-runs to identical decisions and checksums; tampering is caught."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from orchestrator.sweep.replay import compare

from .conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_replay_reports_identical_then_catches_a_changed_checksum(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.run([sys.executable, "-m", "orchestrator", "experiment=cpu_smoke",
                            "workload.requests=60", f"hydra.run.dir={run_dir}"],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert first.returncode == 0, first.stderr
    fp = json.loads((run_dir / "fingerprint.json").read_text())
    assert {"packages", "python", "torch", "gpus", "mc_env", "git", "seeds"} <= set(fp)
    assert fp["seeds"]["workload.seed"] == 1

    out = tmp_path / "replay"
    proc = subprocess.run([sys.executable, "-m", "orchestrator.replay", str(run_dir), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "deterministic outputs: IDENTICAL (60 request checksums, 60 decisions)" in proc.stdout
    assert "send_aux.p50" in proc.stdout
    # each run's load at start beside the ratios (fingerprint.json's host), never a "difference"
    assert {"cpu_count", "cpus_usable", "load_avg"} <= set(fp["host"])
    assert "  original: load " in proc.stdout and "  replay:   load " in proc.stdout
    assert "host.load_avg" not in proc.stdout
    rep = json.loads((out / "replay.json").read_text())
    assert rep["requests_identical"] and rep["decisions_identical"]

    lines = (out / "requests.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    rec["checksum"] = "0" * 32
    (out / "requests.jsonl").write_text("\n".join([json.dumps(rec)] + lines[1:]) + "\n")
    rep = compare(run_dir, out)
    assert not rep["requests_identical"] and rep["decisions_identical"]
    assert rep["request_differences"]


def test_replay_refuses_a_non_run_dir(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "orchestrator.replay", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "not a complete run dir" in proc.stderr
    assert "Traceback" not in proc.stderr

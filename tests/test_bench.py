"""The bench end to end on CPU, small: every path and phase runs, every request verifies, and
the tables carry what each row measured (a crash here once reached only the GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from orchestrator.sweep.bench import BenchResults

from .conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_bench_runs_every_path_and_phase(tmp_path):
    run_dir = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.bench", "bench.iters=40", "bench.handoffs=20",
         "bench.requests=128", "bench.batched_requests=192", "bench.batch_size=8", "bench.bulk_mib=1",
         "bench.bulk_reps=2",
         f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = BenchResults.from_json(json.loads((run_dir / "bench.json").read_text()))
    paths = results.paths
    assert {p.path.split(",")[0] for p in paths} >= {"engine tcp", "tcp route (ZMQ)"}
    for p in paths:
        assert p.ok, p
        assert set(p.phases) == {"handoff 1-in-flight", "per-request", "batched", "coalesced", "inline"}
        for name, ph in p.phases.items():
            assert ph.verified == ph.requests and ph.handoffs_per_s > 0, (p.path, ph)
            assert ph.requests == {"handoff 1-in-flight": 20, "batched": 192, "coalesced": 192}.get(name, 128), name
        assert p.phases["coalesced"].requests_per_send > 1
    engine = next(p for p in paths if p.path.startswith("engine"))
    assert engine.ours_over_raw_p50 > 0 and engine.bulk.gb_per_s > 0
    md = (run_dir / "bench.md").read_text()
    assert "| verified |" in md and "None" not in md and "Ratios:" in md
    # where it is while it runs, each side's start-up, and where it wrote
    assert "phase per-request" in proc.stderr and "phase coalesced" in proc.stderr, proc.stderr
    assert "start-up" in proc.stderr and "decode" in proc.stderr and "prefill" in proc.stderr
    assert "bench.json" in proc.stdout.splitlines()[-1] and "bench.md" in proc.stdout.splitlines()[-1]

"""gate.read (how the readiness gate reads rooms) and endpoints.decode_load (a decode that
decodes): the three read modes give the same verdicts, and the forward loop is off, with a
warning, on host rows. The cost on CUDA rows is measured on the GPU (tests/test_gpu_step.py,
BENCHMARKS.md)."""

from __future__ import annotations

import json

import pytest

from orchestrator.sweep.replay import deterministic

from .conftest import typed_cfg

pytestmark = pytest.mark.integration


def test_the_three_gate_reads_give_the_same_verdicts(run_job, tmp_path):
    outs = {}
    for mode in ("sglang", "batched", "side_stream"):
        res = run_job(tmp_path / mode, "workload.requests=200", f"gate.read={mode}", "workload.seed=7")
        assert (res.verified, res.corrupted, res.failed) == (200, 0, 0), res.failure_reasons
        gate = res.decode_gate
        assert gate.read == mode and gate.polls > 0 and gate.stall_us_per_poll.p50 is not None
        outs[mode] = deterministic(tmp_path / mode)
    assert outs["sglang"] == outs["batched"] == outs["side_stream"]


def test_decode_load_is_off_with_a_warning_on_host_rows(run_job, tmp_path):
    res = run_job(tmp_path, "workload.requests=200", "endpoints.decode_load.step_ms=8",
                  "endpoints.decode_load.idle_s=0.2")
    assert res.verified == 200 and res.decode_gate.load is None
    lines = [json.loads(x) for x in (tmp_path / "decode.log").read_text().splitlines()]
    assert any(x["event"] == "decode_load_off" and x["level"] == "warning" for x in lines)


@pytest.mark.parametrize("bad", ["endpoints.decode_load.step_ms=-1", "endpoints.decode_load.step_ms=inf",
                                 "endpoints.decode_load.idle_s=100"])
def test_decode_load_refuses_bad_values(bad):
    from orchestrator.profile.config import ConfigError

    with pytest.raises(ConfigError):
        typed_cfg(bad)

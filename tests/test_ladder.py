"""The cost ladder (`python -m orchestrator.bench phases=ladder`): a small CPU ladder end to
end (every rung's row, every handoff verified, the table's shape; no timing asserted), and
the pieces that read its rows: the yardstick's RESULT line, a rung with a handoff not
verified shown as FAILED."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from orchestrator.sweep.ladder import (
    HEADER,
    RUNGS,
    YARDSTICK,
    LadderResults,
    RungRow,
    RungRun,
    _yardstick,
    markdown,
    run_overrides,
)

from .conftest import ROOT


@pytest.mark.integration
@pytest.mark.slow
def test_cpu_ladder_runs_every_rung_and_verifies_every_handoff(tmp_path):
    run_dir = tmp_path / "ladder"
    n = 20
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.bench", "phases=ladder", f"bench.ladder_handoffs={n}",
         "bench.ladder_rounds=1", "bench.yardstick=off", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads((run_dir / "ladder.json").read_text())
    rows = {r["rung"]: r for r in d["rows"]}
    assert list(rows) == [r for r, _ in RUNGS]  # R0..R7, in order; yardstick off: no row
    for rung, row in rows.items():
        assert row["ok"], (rung, row)
        assert row["handoffs"] == n and row["verified"] == n, (rung, row)
        assert len(row["runs"]) == 1 and row["median_p50_us"] > 0, (rung, row)
    assert d["profile"]["route"] == "engine"
    md = (run_dir / "ladder.md").read_text()
    lines = md.splitlines()
    assert lines[0] == HEADER
    body = [ln for ln in lines[2:] if ln.startswith("| R")]
    assert [ln.split(" | ")[0] for ln in body] == [f"| {r}" for r, _ in RUNGS]
    assert all(ln.count("|") == HEADER.count("|") for ln in body)
    assert all(f" | {n}/{n} | " in ln for ln in body), md
    assert "FAILED" not in md and "None" not in md
    assert md.splitlines()[0] in proc.stdout  # the table on the console too
    # each round and rung says where it is (stderr); R7 ran the main command with one in flight
    assert "round 1 R7:" in proc.stderr, proc.stderr
    assert (run_dir / "round0" / "R7" / "results.json").is_file()


FAKE = """\
import sys
n = int(sys.argv[2])
print("RESULT cpu yardstick handoff (write + status + device digest + verdict), "
      f"{n} verified: p50 321.5 us p99 700.0 us; write alone p50 90.0 us; 3,000 handoffs/s one in flight")
print("decode: %d digest mismatches" % BAD)
"""


@pytest.mark.parametrize("bad", [0, 2])
def test_yardstick_row_reads_its_result_line(tmp_path, bad):
    """The yardstick's own RESULT line read back (a stand-in script prints the real format):
    its p50 and count, and a decode that saw mismatches fails the row."""
    script = tmp_path / "handoff_yardstick.py"
    script.write_text(textwrap.dedent(FAKE).replace("BAD", str(bad)))
    run = _yardstick(script, "cpu", 7, tmp_path, 30)
    assert run.n == 7 and run.p50_us == 321.5
    assert run.verified == 7 - bad
    assert run.ok is (bad == 0)
    assert (tmp_path / "yardstick.txt").is_file()


def test_yardstick_without_result_line_is_an_error(tmp_path):
    script = tmp_path / "y.py"
    script.write_text("import sys; print('Traceback: no engine'); sys.exit(1)\n")
    run = _yardstick(script, "cpu", 5, tmp_path, 30)
    assert not run.ok and "exit 1" in (run.error or "")


def _row(rung: str, p50s: list[float], verified_short: int = 0) -> RungRow:
    return RungRow(rung, f"label {rung}", [RungRun(i, 10, 10 - (verified_short if i == 0 else 0), p)
                                          for i, p in enumerate(p50s)])


def test_table_medians_increments_and_a_failed_rung():
    rows = [_row("R0", [100.0, 120.0, 110.0]), _row("R1", [130.0, 150.0, 140.0]),
            _row("R2", [150.0, 160.0, 170.0], verified_short=1), _row("R3", [200.0, 190.0, 210.0]),
            RungRow(YARDSTICK, "yardstick cpu 10", skipped="not found: x")]
    md = markdown(LadderResults({"buffer_device": "cpu"}, 10, 3, rows))
    lines = {ln.split(" | ")[0][2:]: ln for ln in md.splitlines() if ln.startswith("| ")}
    assert "| 110.0 | - | 100% | 100.0 | 120.0 | 3 |" in lines["R0"]
    assert "| 30/30 | 140.0 | +30.0 | 127% | 130.0 | 150.0 | 3 |" in lines["R1"]
    # one handoff short fails the rung; the rounds that passed still give its reading, marked
    assert ("| 29/30 | FAILED in 1 of 3 rounds: not all verified (round 1); median of the 2 passed: 165.0 "
            "| +25.0 | 150% | 160.0 | 170.0 | 3 |") in lines["R2"], lines["R2"]
    assert "| 200.0 | +35.0 |" in lines["R3"]
    assert "not found: x" in lines[YARDSTICK]
    assert not rows[2].ok and rows[4].ok

    rows = [_row("R0", [100.0]), RungRow("R1", "label R1", [RungRun(0, error="the decode ended x"),
                                                            RungRun(1, error="the decode ended x")]),
            RungRow("R1b", "label", [RungRun(0, error="log: a | b")]),
            _row("R2", [150.0])]
    md = markdown(LadderResults({"buffer_device": "cpu"}, 10, 2, rows))
    lines = {ln.split(" | ")[0][2:]: ln for ln in md.splitlines() if ln.startswith("| ")}
    assert "| FAILED in 2 of 2 rounds: the decode ended x (rounds 1, 2) | | | | | 2 |" in lines["R1"]
    assert "| 150.0 | - |" in lines["R2"]  # no increment over a rung with no reading
    assert "| FAILED in 1 of 1 rounds: log: a \\| b (round 1) |" in lines["R1b"]  # the table's bars kept


def test_full_run_against_the_yardstick_is_paired_round_by_round():
    """The goal's ratio (R7 / yardstick) per round, and their median beside the ratio of the
    medians; a round where either failed is left out of the pairs."""
    rows = [_row("R7", [300.0, 540.0, 440.0, 380.0]), _row(YARDSTICK, [250.0, 300.0, 400.0, 200.0])]
    rows[1].runs[3] = RungRun(3, error="the yardstick's decode ended")
    res = LadderResults({"buffer_device": "cuda"}, 10, 4, rows)
    assert res.paired() == [1.2, 1.8, 1.1]
    md = markdown(res)
    assert "round by round: [1.2, 1.8, 1.1]; median of the rounds' ratios **1.20x**; ratio of the medians 1.37x" in md
    assert res.to_json()["full_over_yardstick_per_round"] == [1.2, 1.8, 1.1]
    assert "round by round" not in markdown(LadderResults({}, 10, 1, [_row("R0", [1.0])]))


def test_rung_increments_are_paired_round_by_round():
    """A rung's cost as the median of its rounds' differences from the rung below (a round
    that moved every rung moves both), skipping a rung with no reading."""
    rows = [_row("R0", [100.0, 200.0, 110.0]), _row("R1", [120.0, 230.0, 400.0]),
            RungRow("R2", "label R2", skipped="not selected (bench.ladder_rungs)"), _row("R3", [130.0, 260.0, 405.0]),
            _row(YARDSTICK, [90.0, 95.0, 99.0])]
    res = LadderResults({}, 10, 3, rows)
    assert res.paired_steps() == {"R1": 30.0, "R3": 10.0}
    assert "paired by round (the median of the rounds' differences, us): R1 +30.0 (27% of R0), R3 +10.0 (9% of R0)." \
        in markdown(res)
    assert res.to_json()["paired_increment_us"] == {"R1": 30.0, "R3": 10.0}


@pytest.mark.integration
@pytest.mark.slow
def test_ladder_runs_only_the_rungs_asked_for(tmp_path):
    """bench.ladder_rungs: the rows left out are listed, not run."""
    run_dir = tmp_path / "ladder"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.bench", "phases=ladder", "bench.ladder_handoffs=10",
         "bench.ladder_rounds=1", "bench.yardstick=off", "bench.ladder_rungs=[R0]", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["rung"]: r for r in json.loads((run_dir / "ladder.json").read_text())["rows"]}
    assert rows["R0"]["verified"] == 10 and rows["R0"]["ok"]
    assert all(r["skipped"] == "not selected (bench.ladder_rungs)" and not r["runs"]
               for k, r in rows.items() if k != "R0"), rows
    assert not (run_dir / "round0" / "R7").exists()


def test_an_unknown_rung_is_refused_before_start():
    proc = subprocess.run([sys.executable, "-m", "orchestrator.bench", "phases=ladder", "bench.ladder_rungs=[R9]"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "bench.ladder_rungs" in err[0] and "R9" in err[0] and "yardstick" in err[0], err


def test_full_run_rung_keeps_the_profile_overrides_only():
    got = run_overrides(["experiment=deepseek_v3_mtp", "bench.phases=ladder", "bench.ladder_rounds=5",
                         "hydra.run.dir=x", "gate.settle_ms=0"], 300)
    assert got[:2] == ["experiment=deepseek_v3_mtp", "gate.settle_ms=0"]
    assert "workload.concurrency=1" in got and "workload.requests=300" in got
    assert not any(o.startswith(("bench.", "hydra.")) for o in got)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("rung", [0, 5])
def test_a_changed_byte_is_not_verified_and_fails_the_rung(tmp_path, rung):
    """The ladder checks bytes, not only that a verdict came: one handoff's source row has a
    byte changed after its seal (a hook of the ladder's own pair, not of the run), and the
    rung counts it not verified and fails. R0: the raw loop; R5: every composed component
    (the readiness gate's gate.settle_ms holds the torn-looking row, then it is judged)."""
    from orchestrator.bench import ladder_spec
    from orchestrator.preflight.compose import load_profile
    from orchestrator.profile.platform import detect
    from orchestrator.sweep.ladder import _pair

    spec = ladder_spec(load_profile(["bench.ladder_handoffs=6"]), detect())
    run = _pair(rung, spec.pair, tmp_path, 300, corrupt=2)
    assert run.error is not None and "not verified 1 " in run.error, run.error
    assert run.n == 6 and run.verified == 5 and not run.ok, run


# ---- the parent's end of the pair (PairLink): stand-in children, real processes and pipes ----
def _standin_decode(conn, code):
    """The decode's messages; `code` None: its result too, then it ends at once (as the real
    decode does on the prefill's bye); else it ends with `code` after its info."""
    conn.send(("info", {"d": 1}))
    if code is not None:
        raise SystemExit(code)
    conn.recv()
    conn.send(("ready", None))
    conn.send(("result", {"verified": 3}))


def _standin_prefill(conn, decode_pid):
    """The prefill's messages; its result only once the decode is gone (reaped by the parent)."""
    from orchestrator.sweep.ladder_pair import _wait_gone

    conn.send(("info", {"p": 1}))
    conn.recv()
    if conn.recv() == "go":
        _wait_gone(decode_pid)
        conn.send(("result", {"n": 3}))


def _standin_pair(tmp_path, code):
    import multiprocessing as mp

    from orchestrator.sweep.ladder import PairLink

    ctx = mp.get_context("fork")  # stand-ins import nothing heavy
    d_conn, d_child = ctx.Pipe()
    p_conn, p_child = ctx.Pipe()
    dec = ctx.Process(target=_standin_decode, args=(d_child, code), daemon=True)
    dec.start()
    pre = ctx.Process(target=_standin_prefill, args=(p_child, dec.pid), daemon=True)
    pre.start()
    d_child.close()
    p_child.close()
    link = PairLink({"decode": dec, "prefill": pre}, {"decode": d_conn, "prefill": p_conn}, tmp_path, 60)
    try:
        return link.exchange()
    finally:
        for p in (pre, dec):  # a stand-in still waiting (the forks hold the pipes' other ends too)
            if p.is_alive():
                p.kill()
            p.join()


def test_pair_takes_the_prefill_result_after_the_decode_has_ended(tmp_path):
    """The order that failed R2-R4 on a GPU host: the decode has its bye, sends its result and
    ends before the prefill's result comes (forced: the prefill holds its result until the
    decode is reaped). A side that ended after sending its result has not failed."""
    res, dres = _standin_pair(tmp_path, None)
    assert res == {"n": 3} and dres == {"verified": 3}


def test_a_side_that_ends_early_is_named_with_its_exit_and_last_log_line(tmp_path):
    from orchestrator.sweep.ladder import PairFailed

    (tmp_path / "decode.log").write_text('{"event": "engine_up"}\n{"event": "buffers_ready"}\n')
    with pytest.raises(PairFailed) as e:
        _standin_pair(tmp_path, 3)
    msg = str(e.value)
    assert msg.startswith("the decode ended before its result (exit 3, after its info)"), msg
    assert 'decode.log: {"event": "buffers_ready"}' in msg, msg


@pytest.mark.integration
@pytest.mark.slow
def test_a_real_pair_whose_decode_ends_before_the_prefill_result_passes(tmp_path):
    """R2 (the rung that failed most on the GPU host) on the real pair, the prefill's result
    held until the decode process is gone (ladder_pair.prefill_main's hold_for hook)."""
    from orchestrator.bench import ladder_spec
    from orchestrator.preflight.compose import load_profile
    from orchestrator.profile.platform import detect
    from orchestrator.sweep.ladder import _pair

    spec = ladder_spec(load_profile(["bench.ladder_handoffs=6"]), detect())
    run = _pair(2, spec.pair, tmp_path, 300, hold_result=True)
    assert run.ok and run.n == 6 and run.verified == 6, run
    assert "ladder_decode_end" in (tmp_path / "decode.log").read_text()

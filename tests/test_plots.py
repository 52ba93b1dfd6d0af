"""latency.png: the CDF per route of send_aux and handoff, from a run dir's requests files."""

from __future__ import annotations

import json

from orchestrator.results.plots import latency_cdf, run_latencies


def _line(rid, route, send, handoff, outcome="verified"):
    return json.dumps({"rid": rid, "route": route, "send_us": send, "handoff_us": handoff,
                       "outcome": outcome}) + "\n"


def test_run_latencies_split_by_route_and_keep_only_verified_handoffs(tmp_path):
    (tmp_path / "requests.jsonl").write_text(
        _line(0, "engine", 10.0, 100.0) + _line(1, "tcp", 20.0, 200.0)
        + _line(2, "tcp", 30.0, None, "failed") + '{"rid": 3, "route": "tc')  # a torn last line
    (tmp_path / "requests-prefill1.jsonl").write_text(_line(4, "engine", 11.0, 110.0))
    data = run_latencies(tmp_path)
    assert {m: {r: sorted(v) for r, v in routes.items()} for m, routes in data.items()} == {
        "send_aux": {"engine": [10.0, 11.0], "tcp": [20.0, 30.0]},
        "handoff": {"engine": [100.0, 110.0], "tcp": [200.0]}}
    path = latency_cdf(tmp_path / "latency.png", data, "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nothing_measured_draws_nothing(tmp_path):
    assert latency_cdf(tmp_path / "latency.png", {"send_aux": {}, "handoff": {}}, "t") is None
    assert not (tmp_path / "latency.png").exists()


def test_plots_mark_the_summarys_percentiles_and_numbers_keep_their_digits():
    from orchestrator.results.outcomes import Detail, Outcome
    from orchestrator.results.plots import percentiles
    from orchestrator.results.records import RankResult, Record
    from orchestrator.results.reporting import _num

    values = [100.0 + 7.3 * i for i in range(997)] + [8273.0, 9000.0, 12000.0]
    rank = RankResult(0, len(values))
    for i, v in enumerate(values):
        rank.add(Record(i, i, 0, i, "engine", None, v, v, v, Outcome.verified, Detail.none, ""))
    assert percentiles(values) == rank.latency["send_us"].summary()  # one computation for both
    assert _num(4439.4) == "4439.4" and _num(328546.37) == "328546.37" and _num(1234567.8) == "1234567.8"

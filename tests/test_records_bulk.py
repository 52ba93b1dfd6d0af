"""RankResult.add_many (a loop pass's records at once) counts exactly what add() per record
counts: outcomes, routes, details, every latency histogram, the pairs and the last verdict."""

import random

from orchestrator.results.outcomes import Detail, Outcome
from orchestrator.results.records import Finished, RankResult, Record


def _records(n: int) -> list[Record]:
    rng = random.Random(1)
    out = []
    for i in range(n):
        o = rng.choice([Outcome.verified] * 8 + [Outcome.failed, Outcome.corrupted])
        d = Detail.none if o is Outcome.verified else rng.choice([Detail.peer_lost, Detail.checksum_mismatch])
        out.append(Record(i, i * 7, i % 3, i % 64, "" if i % 13 == 0 else "engine", rng.random() * 100,
                          None if i % 5 == 0 else rng.random() * 300, rng.random() * 900,
                          rng.random() * 2000, o, d, "abc", taken_us=None if i % 7 == 0 else 3.0,
                          t_verdict=None if i % 11 == 0 else rng.random()))
    return out


def _state(res: RankResult):
    for h in res.latency.values():
        h.fold()
    for p in res.pairs.values():
        p.handoff_us.fold()
    return (res.outcomes, res.routes, res.details,
            {k: (h.counts, h.n, round(h.total, 3)) for k, h in res.latency.items()},
            {k: (p.outcomes, p.handoff_us.counts, p.first_verdict, p.last_verdict) for k, p in res.pairs.items()},
            res.t_last, {k: h.counts for k, h in res.stages.items()})


def test_add_many_counts_as_add_does():
    recs = _records(9000)  # past LatencyHistogram.BUFFER: folds on the way
    stages = [(1.0, 1.1, 1.3, 1.35, 1.4, 1.6)] * 5
    one, bulk = RankResult(0, len(recs)), RankResult(0, len(recs))
    for r in recs:
        one.add(r)
    for s in stages:
        one.add_stages(*s)
    for k in range(0, len(recs), 7):
        bulk.add_many(recs[k:k + 7], stages if k == 0 else ())
    assert _state(one) == _state(bulk)
    assert one.verified == bulk.verified > 0 and bulk.details[Detail.peer_lost] > 0


def test_finished_lines_are_record_lines():
    """A batch's requests.jsonl lines, formatted column by column, are byte for byte what
    Record.line gives each record (nulls, a fault's label, the run's tag)."""
    recs = _records(300)
    for i, r in enumerate(recs):
        r.fault = None if i % 4 else 'corrupt_byte "x"'
        r.handoff_us = None if i % 9 == 0 else round(r.handoff_us or 0.0, 2)
    tag = ', "run": "r%1"'
    bulk = Finished.of_records(recs)
    assert bulk.lines(tag) == "".join(r.line(tag) + "\n" for r in recs)
    assert bulk.lines() == "".join(r.line() + "\n" for r in recs)
    assert bulk.records() == recs and Finished.of_records([]).lines(tag) == ""

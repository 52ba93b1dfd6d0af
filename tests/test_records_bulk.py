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


def _reqs(n: int):
    """Finished requests as a prefill's loop leaves them: most share their step's times (a
    step's requests do), some have times of their own, some were never verified or never
    stepped, some were timed on the decode's clock (t_taken) and some not."""
    from orchestrator.handoff.endpoints.links import Req

    rng = random.Random(2)
    out, t = [], 100.0
    for i in range(n):
        if i % 8 == 0 or rng.random() < 0.2:  # a new step, or a request's own times
            t += rng.random()
            shared = (t, t + 1e-3 * rng.random(), t + 2e-3 * rng.random(), rng.random() * 900)
        t_step, t_land, tv, send = shared
        r = Req(i, i * 3, i % 2, t_step - 0.01, (1, 2), dst_slot=i % 64, src_slot=i % 64)
        r.t_step = 0.0 if i % 29 == 0 else t_step
        r.t_ready, r.t_landed, r.t_status_out = t_step + 1e-5, t_land, t_land + 1e-5
        r.t_status_in = 0.0 if i % 17 == 0 else t_land + 2e-5
        r.t_taken = 0.0 if i % 13 == 0 else t_land + 3e-5
        r.send_us = None if i % 31 == 0 else send
        r.set_buf_us = None if i % 2 else rng.random() * 50
        o = Outcome.verified if i % 9 else Outcome.failed
        r.verdict = (o, Detail.none if i % 9 else Detail.peer_lost, None if i % 37 == 0 else tv)
        r.route, r.content, r.t_done = "engine", f"{i:012x}", tv
        out.append(r)
    return out


def test_finished_columns_are_each_requests_values():
    """finished_columns, which computes each distinct latency once, gives every request the
    values its own times give (rounded to 0.01 us; None where a time is missing)."""
    from orchestrator.handoff.endpoints.prefill_loop import finished_columns

    reqs = _reqs(500)
    f = finished_columns(reqs, lambda rids: [None] * len(rids))

    def us(a, b):
        return round((a - b) * 1e6, 2)

    for k, r in enumerate(reqs):
        o, _, t = r.verdict
        tv = t if o is Outcome.verified else None
        assert f.set_buf_us[k] == (None if r.set_buf_us is None else round(r.set_buf_us, 2))
        assert f.send_us[k] == (None if r.send_us is None else round(r.send_us, 2))
        assert f.handoff_us[k] == (None if tv is None or not r.t_step else us(tv, r.t_step))
        assert f.e2e_us[k] == (None if tv is None else us(tv, r.t_arrive))
        assert f.taken_us[k] == (us(r.t_taken, r.t_step) if tv is not None and r.t_taken and r.t_step else None)
    assert any(v is None for v in f.taken_us) and len(set(f.handoff_us)) > 20
    rows = [(r.t_step, r.t_ready, r.t_landed, r.t_status_out, r.t_status_in, r.verdict[2]) for r in reqs
            if r.verdict[0] is Outcome.verified and r.verdict[2] is not None and r.t_status_in and r.t_step]
    assert list(f.stages) == rows

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
        r = Req(i, i * 3, (i // 24) % 2, t_step - 0.01, (1, 2), dst_slot=i % 64, src_slot=i % 64)
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
    """finished_columns, which computes each run's latencies once, gives every request the
    values its own times give (rounded to 0.01 us; None where a time is missing)."""
    from orchestrator.handoff.endpoints.prefill_loop import finished_columns

    reqs = _reqs(500)
    f = finished_columns(reqs, lambda rids: [None] * len(rids))
    assert max(f.n) > 1 and len(f.n) < len(reqs) * 0.8 and sum(f.n) == len(reqs)  # runs of a step's requests

    def us(a, b):
        return round((a - b) * 1e6, 2)

    recs = f.records()
    for r, rec in zip(reqs, recs, strict=True):
        o, _, t = r.verdict
        tv = t if o is Outcome.verified else None
        assert (rec.rid, rec.room, rec.dst_slot, rec.checksum) == (r.rid, r.room, r.dst_slot, r.content)
        assert rec.set_buf_us == (None if r.set_buf_us is None else round(r.set_buf_us, 2))
        assert rec.send_us == (None if r.send_us is None else round(r.send_us, 2))
        assert rec.handoff_us == (None if tv is None or not r.t_step else us(tv, r.t_step))
        assert rec.e2e_us == (None if tv is None else us(tv, r.t_arrive))
        assert rec.taken_us == (us(r.t_taken, r.t_step) if tv is not None and r.t_taken and r.t_step else None)
        assert (rec.outcome, rec.detail, rec.t_verdict) == (o, r.verdict[1], r.t_done)
    assert any(rec.taken_us is None for rec in recs) and len({rec.handoff_us for rec in recs}) > 20
    rows = [(r.t_step, r.t_ready, r.t_landed, r.t_status_out, r.t_status_in, r.verdict[2]) for r in reqs
            if r.verdict[0] is Outcome.verified and r.verdict[2] is not None and r.t_status_in and r.t_step]
    assert [row for row in f.expanded("stages") if row is not None] == rows


def test_runs_count_and_write_as_each_record_would():
    """A loop's batches as runs (finished_columns): counted as add() and add_stages of each
    request's record count them (every histogram's buckets, count, total and peak), and
    written byte for byte as Record.line writes each (a fault's label, set_buf times)."""
    from orchestrator.handoff.endpoints.prefill_loop import finished_columns

    reqs = _reqs(9000)  # past LatencyHistogram.BUFFER: folds on the way
    labels = lambda rids: [None if rid % 5 else f"fault {rid}%" for rid in rids]  # noqa: E731
    one, bulk, lines, tag = RankResult(0, len(reqs)), RankResult(0, len(reqs)), [], ', "run": "x%y"'
    for k in range(0, len(reqs), 97):
        f = finished_columns(reqs[k:k + 97], labels)
        bulk.add_finished(f)
        lines.append(f.lines(tag))
        for rec, row in zip(f.records(), f.expanded("stages"), strict=True):
            one.add(rec)
            lines.append(None)
            if row is not None:
                one.add_stages(*row)
    recs = [rec for k in range(0, len(reqs), 97) for rec in finished_columns(reqs[k:k + 97], labels).records()]
    assert "".join(x for x in lines if x) == "".join(r.line(tag) + "\n" for r in recs)

    def hists(res):  # (totals rounded: add() folds at other points, so sums in another order)
        hists = [*res.latency.values(), *res.stages.values(), *(p.handoff_us for p in res.pairs.values())]
        return [(h.fold().counts, h.n, round(h.total, 3), h.max) for h in hists]

    assert hists(one) == hists(bulk) and _state(one) == _state(bulk)
    assert bulk.details[Detail.peer_lost] > 0 and bulk.stages["write"].n > 0 and len(bulk.pairs) == 2


def test_batches_without_set_buf_or_fault_write_nulls():
    """A batch where no request has a set_buf time or a fault writes null for both (the
    format that bakes them in), as Record.line does."""
    from orchestrator.handoff.endpoints.prefill_loop import finished_columns

    reqs = _reqs(200)
    for r in reqs:
        r.set_buf_us = None
    f = finished_columns(reqs, lambda rids: [None] * len(rids))
    assert f.lines() == "".join(r.line() + "\n" for r in f.records())
    assert '"set_buf_us": null' in f.lines() and '"fault": null' in f.lines()


def test_extend_runs_is_extend_spelled_out():
    """LatencyHistogram.extend_runs folds what extend of the values repeated would, at the
    same points: the same buckets, count, total (summed in the same order) and peak."""
    import random as _random

    from orchestrator.results.stats import LatencyHistogram

    rng = _random.Random(3)
    a, b = LatencyHistogram(), LatencyHistogram()
    for _ in range(300):
        vals = [rng.random() * 10 ** rng.randint(0, 6) for _ in range(rng.randint(1, 9))]
        reps = [rng.randint(1, 70) for _ in vals]
        if rng.random() < 0.3:
            a.add(vals[0])
            b.add(vals[0])
        a.extend([v for v, n in zip(vals, reps) for _ in range(n)])
        b.extend_runs(vals, reps)
        assert len(a._pending) == len(b._pending) + b._extra  # folded at the same points
    assert a.n == b.n > 4096 * 3
    assert (a.fold().counts, a.n, a.total, a.max) == (b.fold().counts, b.n, b.total, b.max)
    assert a.percentile(50) == b.percentile(50) and a.mean == b.mean

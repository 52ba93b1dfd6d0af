"""A process that could not report, accounted for from what it recorded on disk: a decode
from its verdicts file, a prefill rank from its requests file and every decode's verdicts."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from orchestrator.results.outcomes import Detail, Outcome
from orchestrator.results.records import DecodeResult, RankResult, Record, read_jsonl, read_records
from orchestrator.results.report_spec import ReportSpec
from orchestrator.results.rundir import NoSpace, RunFiles, open_regular, parse_proc_name, run_of, run_tag
from orchestrator.results.rundir import full as _full


def decode_from_disk(run_dir: Path, name: str) -> DecodeResult:
    """A decode that sent no stats: its outcomes from its verdicts file."""
    res = DecodeResult(name, tp_rank=parse_proc_name(name).tp_rank,
                       error="no stats: the process ended early; counts from its verdicts file")
    for v in read_jsonl(RunFiles(run_dir).verdicts(name)):
        res.outcomes[Outcome(v["outcome"])] += 1
        if v["outcome"] != Outcome.verified.value:
            res.details[Detail(v["detail"])] += 1
    return res


def reconstruct(spec: ReportSpec, run_dir: Path, rank: int, name: str, missing: Detail,
                route: str = "", ran: bool = True, phase: tuple = (None, None),
                full: Optional[list[NoSpace]] = None) -> RankResult:
    """A prefill rank that could not report: its requests file holds what it recorded;
    a request it did not record keeps the verdict its decode gave it (every decode's
    verdicts file), and is otherwise failed with `missing` as the reason. The records
    added are appended to the requests file, so the file and the report agree.

    After an interrupt (`missing` is interrupted), a request past the last one with any
    trace never arrived (requests arrive in id order): not_started, with no line; a rank
    that never reached its handoff phase (`ran` false) started none. `phase` (the runner's
    clock: the handoff phase began, the run stopped) times a rate over the phase that ran.
    A workload.duration_s run's count is what arrived: the requests up to the last traced.
    A full disk while appending: the file keeps its complete lines, the NoSpace goes to
    `full` (raised where none is given)."""
    n = spec.load.requests
    base = rank * n
    path = RunFiles(run_dir).requests(name, spec.ranks.prefill)
    res = RankResult(rank, n, row_bytes=spec.rows.row_bytes)
    seen: set[int] = set()
    for rec in read_records(path):
        if base <= rec.rid < base + n and rec.rid not in seen:
            seen.add(rec.rid)
            res.add(rec)
    judged = _judged(run_dir, rank)
    from orchestrator.handoff.workload import decode_of, request_room

    end = base + n
    if missing is Detail.interrupted:
        traced = [r for r in (*seen, *judged) if base <= r < base + n]
        end = (max(traced) + 1) if traced and ran else base
        res.not_started = base + n - end
        res.interrupted = True
    elif spec.load.duration_s is not None:  # a duration run's count is what arrived: as far as traced
        traced = [r for r in (*seen, *judged) if base <= r < base + n]
        end = (max(traced) + 1) if traced and ran else base
        res.requests = end - base
    added = []
    for rid in range(base, end):
        if rid in seen:
            continue
        outcome, detail = judged.get(rid, (Outcome.failed, missing))
        rec = Record(rid, request_room(spec.load.room_seed, spec.load.duplicate_rooms, rid),
                     decode_of(rid, spec.ranks.decode), -1,
                     route if rid in judged else "", None, None, None, None, outcome, detail, "", None)
        res.add(rec)
        added.append(rec)
    t_phase, t_stop = phase
    if res.verified and t_phase is not None and t_stop is not None and res.t_start is None:
        res.t_start, res.t_last = t_phase, t_stop  # no verdict times: the phase as the runner saw it
    if added:
        try:
            _append(path, added)
        except NoSpace as exc:
            if full is None:
                raise
            full.append(exc)
    res.error = f"{name} did not report; {len(added)} requests accounted for from the decode's verdicts"
    return res


def _judged(run_dir: Path, rank: int) -> dict[int, tuple[Outcome, Detail]]:
    """The verdicts every decode instance gave prefill rank `rank`, by request id."""
    judged: dict[int, tuple[Outcome, Detail]] = {}
    for decode, f in RunFiles(run_dir).all_verdicts():
        if not decode.tp_leader:
            continue  # a TP instance's verdict is its leader's
        for v in read_jsonl(f):
            if v.get("prefill") == rank:
                judged[v["rid"]] = (Outcome(v["outcome"]), Detail(v["detail"]))
    return judged


def _append(path: Path, added: list[Record]) -> None:
    """Append `added` to a requests file, of which only complete lines count: a torn last
    line is cut off first. All or nothing: a full disk (NoSpace, naming the file) leaves the
    file as it was, its records complete lines. Opened as rundir.open_regular opens (a link
    or special file planted there raises UnsafePath: never followed); the lines carry the id
    of the run that owns the dir."""
    import os

    tag = run_tag(run_of(path.parent))
    cut = 0
    fd = open_regular(path, os.O_RDWR | os.O_CREAT)
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0) if size else b""
        cut = data.rfind(b"\n") + 1
        if cut != len(data):
            os.ftruncate(fd, cut)
        body = "".join(rec.line(tag) + "\n" for rec in added).encode()
        done = 0
        while done < len(body):
            done += os.pwrite(fd, body[done:], cut + done)
    except OSError as exc:
        if not _full(exc):
            raise
        try:
            os.ftruncate(fd, cut)
        except OSError:
            pass
        raise NoSpace(path) from None
    finally:
        os.close(fd)

"""Trust II (issue 19): messages bound to their run and session, control identity bound to a
connection, bounded listeners, and every failure after start as one line with exit 3.
Real processes, real sockets, real Mooncake engines; nothing mocked."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from orchestrator import MetadataBuffers
from orchestrator.handoff.backends.mooncake.engine import MooncakeEngine
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.advert import DecodeAdvert
from orchestrator.handoff.transport.auth import Authenticator, Replayed, new_nonce
from orchestrator.job import protocol
from orchestrator.profile.layout import describe
from orchestrator.profile.plan import Platform
from orchestrator.results.outcomes import Detail, KVPoll, Outcome
from orchestrator.results.schema import Results

from .conftest import ROOT, DecodeProcess, plan_of, typed_cfg
from .helpers.bounds import bound, startup_timeout_s
from .helpers.peers import PrefillPeer

pytestmark = pytest.mark.integration
SECRET = b"one secret shared by every split run"


def _cli(tmp_path: Path, *overrides: str, env=None, timeout=180, name="run"):
    run_dir = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "orchestrator", f"hydra.run.dir={run_dir}", *overrides],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, **(env or {})})
    return proc, run_dir


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---- 1. bound to the run -------------------------------------------------------------------
def test_auth_sessions_are_bound_to_both_nonces_and_reject_replays():
    base = Authenticator(SECRET)
    p, d = new_nonce(), new_nonce()
    mine, theirs = base.session(0, p, d, "prefill"), base.session(0, p, d, "decode")
    sealed = mine.seal(b"payload")
    assert theirs.unseal(sealed) == b"payload"
    with pytest.raises(Replayed):
        theirs.unseal(sealed)  # the same message again
    assert base.session(0, p, new_nonce(), "decode").unseal(mine.seal(b"x")) is None  # another run
    assert base.session(1, p, d, "decode").unseal(mine.seal(b"x")) is None  # another rank
    assert mine.unseal(mine.seal(b"x")) is None  # reflected back: the other direction's key
    frames = mine.sign([b"a", b"b"], b"ad")
    assert theirs.open(frames, b"ad") == [b"a", b"b"] and theirs.open(frames, b"other") is None
    assert base.open(frames) is None  # the bare secret opens nothing of a session


def test_replay_from_an_earlier_run_under_a_shared_secret_never_opens(tmp_path):
    """Run 1's genuine, authentic frames and status for request 1, replayed into run 2 (same
    secret, same room, same request id) while run 2 waits for request 1: all refused; and
    run 1's row with its valid digest, written straight into run 2's registered memory
    through Mooncake, fails the digest (the pad is bound to run 2's prefill nonce)."""
    cfg = typed_cfg("mem_pool=NVLINK", "workload.seed=5")  # a pinned seed: same rooms
    run1 = PrefillPeer(cfg, _mk(tmp_path / "1"), secret=SECRET)
    captured = []
    try:
        room, tag = run1.fill(1)
        slot = run1.arrive(1, room)
        rows = run1.rows()
        ad = (1).to_bytes(8, "little")
        captured = [run1.auth.sign(wire.encode_aux(room, i, slot, r), ad) for i, r in enumerate(rows)]
        captured.append([run1.auth.sign_frame(wire.status_frame(0, [(1, room, slot, KVPoll.Success, tag)]))])
        for frames in captured:
            run1.push.send_multipart(frames)
        assert run1.verdict(1) == (Outcome.verified, Detail.none)
    finally:
        run1.close()
    run2 = PrefillPeer(cfg, _mk(tmp_path / "2"), secret=SECRET)
    try:
        room2, tag2 = run2.fill(1)
        assert room2 == room  # pinned seed: the same room, the same request id
        slot2 = run2.arrive(1, room2)
        for frames in captured:  # the replay, whatever slot it names
            run2.push.send_multipart(frames)
        assert run2.quiet(700)  # no verdict from the replay
        run2.send_frames(room2, slot2, run2.rows())
        run2.status(room2, 1, slot2, tag2)
        assert run2.verdict(1) == (Outcome.verified, Detail.none)
    finally:
        stats = run2.close()
    assert stats.refused.rejected_auth == len(captured) and stats.outcomes[Outcome.verified] == 1


def test_row_from_an_earlier_run_fails_the_digest_under_a_shared_secret(tmp_path):
    cfg = typed_cfg("mem_pool=NONE", "buffers.kv_checksum_enabled=true", "workload.seed=5")
    old = PrefillPeer(cfg, _mk(tmp_path / "1"), secret=SECRET)
    old.fill(1)  # run 1's row for request 1 and its valid digest (kv_checksum field)
    old_rows = [f[0].clone() for f in old.buffers.fields]
    old.close()
    peer = PrefillPeer(cfg, _mk(tmp_path / "2"), secret=SECRET)
    try:
        rows = MetadataBuffers(4, cfg.buffers.hidden_size, torch.float32, cfg.buffers.max_sampling_mask_tokens,
                               kv_checksum_enabled=True, device="cpu")
        for f, t in zip(rows.fields, old_rows):
            f[0].copy_(t)
        attacker = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "tcp", env=peer.plan.mc_env)
        attacker.register(rows.arena_ptr, rows.arena_bytes)
        ptrs, _, lens = rows.get_buf_infos()
        room, tag = peer.fill(1)  # what run 2's prefill writes and says it wrote
        slot = peer.arrive(1, room)
        dst = peer.bootstrap.aux_ptrs
        attacker.batch_write(peer.bootstrap.session_id, ptrs, [d + n * slot for d, n in zip(dst, lens)], lens)
        peer.status(room, 1, slot, 0)  # run 2's own authentic "done", without its tag
        assert peer.verdict(1) == (Outcome.corrupted, Detail.checksum_mismatch)
        # with the sender's tag in its status (what the prefill sends): told apart
        slot = peer.arrive(2, room)
        attacker.batch_write(peer.bootstrap.session_id, ptrs, [d + n * slot for d, n in zip(dst, lens)], lens)
        peer.status(room, 2, slot, peer.fill(2, room=room)[1])
        assert peer.verdict(2) == (Outcome.corrupted, Detail.written_by_someone_else)
    finally:
        stats = peer.close()
    assert stats.outcomes[Outcome.verified] == 0


def test_replays_inside_a_run_are_counted_and_change_nothing(tmp_path):
    """buffers.size=1: request 2 gets request 1's slot. Request 1's status, its arrive and
    its AUX_DATA frames replayed after its verdict: counted, no second grant, no verdict,
    and request 2 verifies."""
    cfg = typed_cfg("mem_pool=NVLINK", "buffers.size=1", "workload.batch_size=1")
    peer = PrefillPeer(cfg, tmp_path)
    try:
        room, tag = peer.fill(1)
        arrive = peer.auth.seal(wire.encode("arrive", reqs=[[1, room]], contiguous=False))
        peer.control.send(arrive)
        while 1 not in peer.grants:
            peer.recv()
        slot = peer.grants[1]
        ad = (1).to_bytes(8, "little")
        frames = [peer.auth.sign(wire.encode_aux(room, i, slot, r), ad) for i, r in enumerate(peer.rows())]
        status = [peer.auth.sign_frame(wire.status_frame(0, [(1, room, slot, KVPoll.Success, tag)]))]
        for f in frames + [status]:
            peer.push.send_multipart(f)
        assert peer.verdict(1) == (Outcome.verified, Detail.none)
        peer.push.send_multipart(status)  # replayed status: request 1 is judged
        peer.control.send(arrive)  # replayed arrive: would re-grant request 1
        time.sleep(0.5)
        room2, tag2 = peer.fill(2)
        slot2 = peer.arrive(2, room2)
        assert slot2 == slot and peer.grants.get(1) == slot  # one grant for request 1, ever
        for f in frames:  # request 1's bytes replayed into request 2's slot
            peer.push.send_multipart(f)
        peer.send_frames(room2, slot2, peer.rows())
        peer.status(room2, 2, slot2, tag2)
        assert peer.verdict(2) == (Outcome.verified, Detail.none)
        for f in frames:  # ...and after request 2's own rows landed: still refused
            peer.push.send_multipart(f)
        peer.push.send_multipart(status)
        time.sleep(0.3)
    finally:
        stats = peer.close()
    assert stats.refused.replayed == 3  # the arrive and the two statuses
    assert stats.refused.rejected_auth == 2 * len(frames)  # frames under another tenant's grant
    assert stats.outcomes[Outcome.verified] == 2 and stats.grants == 2


def _scripted_decode(cfg, secret, tmp_path, on_arrive):
    """A decode side played by the test (tcp route): a real prefill process bootstraps with
    it; `on_arrive(rid, slot)` returns the extra updates to send right after the grant."""
    from orchestrator.job.children import prefill_main
    from orchestrator.job.specs import build_specs

    b = cfg.buffers
    bufs = MetadataBuffers(b.size, b.hidden_size, b.hidden_states_dtype.value, b.max_sampling_mask_tokens,
                           b.max_top_logprobs_num, None, b.output_dsa_topk_indices_dim, layout=cfg.layout,
                           device="cpu")
    ptrs, _, lens = bufs.get_buf_infos()
    base = Authenticator(secret)
    nonce = new_nonce()
    z = zmq.Context()
    router, pull = z.socket(zmq.ROUTER), z.socket(zmq.PULL)
    ctl = "tcp://127.0.0.1:%d" % router.bind_to_random_port("tcp://127.0.0.1")
    data = "tcp://127.0.0.1:%d" % pull.bind_to_random_port("tcp://127.0.0.1")
    plan = plan_of(cfg, Platform())
    conn, child = mp.get_context("spawn").Pipe()
    conn = protocol.Channel(conn)
    proc = mp.get_context("spawn").Process(target=prefill_main, args=(build_specs(cfg, plan).prefill, str(tmp_path),
                                                                      secret, child), daemon=True)
    proc.start()
    result, sess, ident, free = None, None, None, list(range(b.size))
    granted: dict[int, tuple[int, int]] = {}
    try:
        assert conn.poll(60) and isinstance(conn.recv(), protocol.Up)
        conn.send(protocol.Decodes(infos=[[DecodeAdvert(control_endpoint=ctl, data_endpoint=data,
                                                        transport="zmq-tcp", session_id=None)]]))
        deadline = time.monotonic() + 120
        while result is None and time.monotonic() < deadline:
            if router.poll(10):
                ident, raw = router.recv_multipart()
                if sess is None:
                    hello = wire.decode(base.unseal(raw))
                    sess = base.session(hello.rank, hello.nonce, nonce, "decode")
                    router.send_multipart([ident, base.seal(wire.encode(
                        "bootstrap", session_id=None, aux_ptrs=ptrs, item_lens=lens, slots=b.size,
                        layout=describe(bufs.specs), fingerprint=hello.fingerprint, tp_rank=0,
                        boot_id="", scratch_ptr=0, nonce=nonce, hello_nonce=hello.nonce))])
                else:
                    msg = wire.decode(sess.unseal(raw))
                    for rid, room in getattr(msg, "reqs", []):
                        slot = free.pop()
                        granted[rid] = (slot, room)
                        # the grant and the first extra in one message: taken in that order
                        extra = on_arrive(rid, slot)
                        router.send_multipart([ident, sess.seal(wire.encode(
                            "update", grants=[[rid, slot]] + extra[0][0], v=extra[0][1]))])
                        for grants, v in extra[1:]:
                            router.send_multipart([ident, sess.seal(wire.encode("update", grants=grants, v=v))])
            while pull.poll(0):
                frames = pull.recv_multipart()
                if frames[0] == wire.AUX_DATA:
                    continue  # the rows themselves do not matter here
                body = sess.open_frame(frames[0]) if len(frames) == 1 else None
                assert body is not None, "a status frame, authentic"
                msg = wire.parse([body], lens, b.size)
                assert isinstance(msg, wire.StepStatus)
                for rid, *_ in msg.entries:
                    free.append(granted.pop(rid)[0])
                    now = time.monotonic_ns()
                    router.send_multipart([ident, sess.seal(wire.encode(
                        "update", grants=[], v=[[rid, Outcome.verified.code, Detail.none.code, now, now, now]]))])
            while conn.poll(0):
                match conn.recv():
                    case protocol.Result(result=value):
                        result = value
                    case protocol.Error(line=line):
                        raise AssertionError(line)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        router.close(0)
        pull.close(0)
        z.term()
    assert result is not None, "the prefill did not finish"
    return result


def test_prefill_takes_a_verdict_only_for_a_request_it_sent(tmp_path):
    """The decode side (here: a scripted one) says "corrupted" for each request the moment
    it grants it, before the prefill sent anything, and re-grants it: the prefill counts and
    ignores both, and every request ends with its real verdict."""
    cfg = typed_cfg("mem_pool=NVLINK", "workload.requests=40", "workload.concurrency=4", "buffers.size=8",
                    "transport.timeout_s=5")
    now = time.monotonic_ns()

    def premature(rid, slot):
        return [([], [[rid, Outcome.corrupted.code, Detail.checksum_mismatch.code, now, now, now]]),
                ([[rid, slot]], []),  # a second grant
                ([], [[rid + 10_000, Outcome.verified.code, Detail.none.code, now, now, now]])]  # not ours

    res = _scripted_decode(cfg, SECRET, tmp_path, premature)
    assert res.outcomes[Outcome.verified] == 40 and res.outcomes[Outcome.corrupted] == 0
    assert res.replayed == 2 * 40 and res.rejected == 40  # premature and second grant; not ours
    records = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert all(r["route"] == "tcp" and r["handoff_us"] > 0 for r in records)


# ---- 2. control identity is a session ----------------------------------------------------
def test_replayed_hello_cannot_take_over_a_prefill(tmp_path):
    """An authentic hello copied off the wire and replayed from another connection is
    refused and counted; grants and verdicts keep going to the real prefill."""
    cfg = typed_cfg("mem_pool=NVLINK")
    peer = PrefillPeer(cfg, tmp_path)
    z = zmq.Context()
    thief = z.socket(zmq.DEALER)
    thief.connect(peer.info.control_endpoint)
    try:
        assert peer.handoff(1) == (Outcome.verified, Detail.none)
        thief.send(peer.sealed_hello)  # the copy
        thief.send(peer.auth.seal(wire.encode("arrive", reqs=[[9, 9]], contiguous=False)))  # not its session
        assert not thief.poll(700)  # no bootstrap, no grant to the thief
        for rid in range(2, 6):
            assert peer.handoff(rid) == (Outcome.verified, Detail.none)
    finally:
        thief.close(0)
        z.term()
        stats = peer.close()
    assert stats.refused.hijack_refused == 1 and stats.refused.rejected_auth == 1
    assert stats.outcomes[Outcome.verified] == 5 and stats.grants == 5


# ---- 3. bounded listeners ----------------------------------------------------------------
def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _zmtp_huge_frame(endpoint: str, declared: int, body: bytes):
    """A raw ZMTP 3.0 PUSH peer that announces one frame of `declared` bytes, sends `body`
    of it and holds the connection open (what an outsider can do to any listener it
    reaches); returns the socket."""
    import socket
    import struct

    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    try:
        s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
        prop = b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
        ready = b"\x05READY" + prop
        s.sendall(bytes([0x04, len(ready)]) + ready)
        s.sendall(b"\x02" + struct.pack(">Q", declared))
        for i in range(0, len(body), 1 << 20):
            s.sendall(body[i:i + (1 << 20)])
    except OSError:
        pass  # dropped by the receiver: what it should do
    return s


def test_huge_frames_are_dropped_before_they_are_buffered(tmp_path):
    """An outsider holds 8 connections open to the decode's data and control listeners,
    each announcing a 4 GiB frame and sending 48 MiB of it: libzmq drops them at the header
    (ZMQ_MAXMSGSIZE from the layout), the decode's resident memory grows by less than
    64 MB, and real handoffs then verify."""
    cfg = typed_cfg("mem_pool=NVLINK")
    peer = PrefillPeer(cfg, tmp_path)
    pid = peer.decode.proc.pid
    held = []
    try:
        assert peer.handoff(1) == (Outcome.verified, Detail.none)
        before = _rss_kb(pid)
        payload = b"\x00" * (48 << 20)
        for endpoint in (peer.info.data_endpoint, peer.info.control_endpoint):
            for _ in range(4):
                held.append(_zmtp_huge_frame(endpoint, 1 << 32, payload))
        time.sleep(1.0)
        grown_kb = _rss_kb(pid) - before
        for rid in range(2, 12):
            assert peer.handoff(rid) == (Outcome.verified, Detail.none)
    finally:
        for s in held:
            s.close()
        stats = peer.close()
    print(f"decode RSS {before} KiB before the flood, grown by {grown_kb} KiB with 8 x 48 MiB held")
    assert grown_kb < 64 * 1024
    assert stats.outcomes[Outcome.verified] == 11


# ---- 6. one run per run dir --------------------------------------------------------------
def test_a_second_run_into_a_busy_run_dir_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "orchestrator", "workload.requests=6000",
                              f"hydra.run.dir={run_dir}"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + bound(startup_timeout_s(), start=True)  # its start-up, bounded by the run
        while not (run_dir / "requests.jsonl").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        second, _ = _cli(tmp_path, "workload.requests=100", name="run")
        assert first.poll() is None, "the first run ended before the second was tried"
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stdout + second.stderr
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "in use by another run" in lines[0], lines
    assert "Traceback" not in second.stderr
    assert first.returncode == 0, err
    rids = [json.loads(x)["rid"] for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert len(rids) == len(set(rids)) == 6000


# ---- 4. every failure after start: exit 3, one line, no traceback, nothing torn ---------------
def _tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")


def test_disk_full_after_start_is_one_line_and_exit_3(tmp_path):
    disk = tmp_path / "small"
    _tmpfs(disk, "900k")
    try:
        proc, run_dir = _cli(disk, "workload.requests=1000")
        leftovers = [p.name for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: no space left writing "), proc.stderr
    assert leftovers == []


def test_a_side_killed_during_start_up_is_exit_3_with_one_line(tmp_path):
    """Every endpoint process is SIGKILLed the moment it exists (before it reports)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "workload.requests=100",
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killed = set()
    deadline = time.monotonic() + bound(startup_timeout_s(), start=True)  # the run ends itself within it
    while proc.poll() is None and time.monotonic() < deadline and len(killed) < 2:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) in killed:
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            # an endpoint: spawned by the runner, or forked by its forkserver (handoff.warmstart),
            # which is the runner's child and keeps its own command line (never killed here)
            if (ppid == proc.pid and b"spawn_main" in cmd) or (
                    b"forkserver" in cmd and _ppid(ppid) == proc.pid and ppid not in killed):
                os.kill(int(pid), 9)
                killed.add(int(pid))
        time.sleep(0.01)
    out, err = proc.communicate(timeout=60)
    assert killed
    assert proc.returncode == 3, out + err
    assert "Traceback" not in out + err
    assert "while starting" in out + err or "while bootstrapping" in out + err
    assert Results.read(run_dir).exit_code == 3


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _decode_that_fails(conn) -> None:
    protocol.Channel(conn).send(protocol.Error(line="MemoryError: the decode's own last word"))


def test_a_dead_decodes_own_error_reaches_the_results(tmp_path):
    """Job._finish reads a decode's pipe after it died, so its error is reported (it was
    dropped while the runner read the pipe only of a living decode)."""
    from orchestrator.job.runner import Job, _Proc
    from orchestrator.job.specs import build_specs

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    p = ctx.Process(target=_decode_that_fails, args=(child,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    cfg = typed_cfg()
    job = Job(build_specs(cfg, plan_of(cfg, Platform())), tmp_path, secret=SECRET)
    job.decodes = [_Proc("decode", p, protocol.Channel(conn), "decode", 0)]
    job._finish()
    out = job.out
    assert "MemoryError: the decode's own last word" in out.error
    assert "MemoryError: the decode's own last word" in out.decodes["decode"].error


# ---- 5. refused before start: exit 2, one line ------------------------------------------
@pytest.mark.parametrize("override,expect", [
    ("transport.timeout_s=inf", "transport.timeout_s=inf"),
    ("endpoints.startup_timeout_s=1e9", "endpoints.startup_timeout_s="),
    ("transport.mooncake.metadata_server=HTTP://127.0.0.1:8080/metadata", "lower-case scheme"),
    ("buffers.size=100000000", "bytes"),
])
def test_refused_before_start_with_one_line(tmp_path, override, expect):
    proc, run_dir = _cli(tmp_path, override)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], lines
    assert not (run_dir / "requests.jsonl").exists()


def test_buffers_beyond_memory_name_the_bytes_needed():
    from orchestrator.job.check import check_profile
    from orchestrator.profile.config import ConfigError
    from orchestrator.profile.rules import buffer_bytes

    cfg = typed_cfg("buffers.size=1000000", "buffers.hidden_size=7168", "buffers.hidden_states_dtype=bfloat16")
    need = 2 * buffer_bytes(cfg.buffers, cfg.layout)
    with pytest.raises(ConfigError) as info:
        check_profile(cfg, Platform(host_mem_bytes=need - 1))
    assert info.value.key == "buffers.size" and f"{need:,} bytes" in str(info.value)
    check_profile(cfg, Platform(host_mem_bytes=need))  # fits: allowed
    gpu = typed_cfg("mem_pool=INTRA_NODE_NVLINK", "buffers.size=1000000", "buffers.hidden_size=7168")
    with pytest.raises(ConfigError, match="GPU 0"):
        check_profile(gpu, Platform(cuda_devices=2, mooncake_cuda=True, gpu_mem_bytes=(10**9, 10**9)))


@pytest.mark.parametrize("content,where", [
    (b"workload:\n  requests: 10\n  concurrency: [1, 2\n", "bad.yaml:"),
    (b"workload:\n  requests: 10\n\xff\xfe: x\n", "bad.yaml:3: not UTF-8"),
])
def test_bad_yaml_in_a_config_dir_is_named_with_its_line(tmp_path, content, where):
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "bad.yaml").write_bytes(content)  # read by the run that picks it
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "--config-dir", str(conf), "experiment=bad",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT,
                          timeout=180)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and where in lines[0] and "Traceback" not in proc.stderr, lines


# ---- 5'. a slow sibling is not a lost peer ------------------------------------------------
@pytest.mark.slow
def test_a_stalled_sibling_prefill_never_makes_a_healthy_one_lose_the_decode(tmp_path):
    """Two prefill ranks, 4 decode rows: prefill 0 stopped 5 s holds the rows prefill 1
    waits for; the decode's own heartbeat keeps prefill 1 from declaring it lost."""
    proc, run_dir = _cli(tmp_path, "endpoints.prefill_ranks=2", "buffers.size=4", "faults=prefill_stopped",
                         "faults.at_request=100", "faults.duration_s=5", "transport.timeout_s=3",
                         "workload.requests=1500")
    res = Results.read(run_dir)
    assert proc.returncode == 0 and (res.verified, res.failed) == (3000, 0), res.failure_reasons
    assert res.ending.faults_applied[0]["fault"] == "prefill_stopped"


# ---- 3'. a stalled Mooncake listener ---------------------------------------------------------
def test_a_handshake_held_by_idle_connections_fails_in_time_naming_the_listener(tmp_path):
    """Mooncake's handshake listener (0.0.0.0, not ours to bind) serves one handshake at a
    time: 5 idle connections to it held one for 25 s on this box. The prefill gives up within
    transport.timeout_s and its one line names the listener."""
    import socket

    from orchestrator.job.children import prefill_main
    from orchestrator.job.specs import build_specs

    cfg = typed_cfg("mem_pool=NONE", "transport.timeout_s=3")
    decode = DecodeProcess(cfg, tmp_path, secret=SECRET)
    host, port = decode.info.session_id.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(5)]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    conn = protocol.Channel(conn)
    proc = ctx.Process(target=prefill_main, args=(build_specs(cfg, decode.plan).prefill, str(tmp_path), SECRET,
                                                  child), daemon=True)
    proc.start()
    try:
        assert conn.poll(60) and isinstance(conn.recv(), protocol.Up)
        t0 = time.monotonic()
        conn.send(protocol.Decodes(infos=[[decode.info]]))
        assert conn.poll(30)
        msg = conn.recv()
        waited = time.monotonic() - t0
    finally:
        for s in idle:
            s.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        decode.stop()
    assert isinstance(msg, protocol.Error), msg
    line = msg.line
    assert "TimeoutError" in line and decode.info.session_id in line, line
    assert "\n" not in line and "listener" in line
    assert waited < bound(3.0) < 25  # transport.timeout_s=3; held, the handshake took 25 s


# ---- 1'. rooms differ per run -------------------------------------------------------------
def _rooms(run_dir: Path) -> list[int]:
    return [json.loads(x)["room"] for x in (run_dir / "requests.jsonl").read_text().splitlines()]


def test_rooms_differ_per_run_unless_the_seed_is_pinned(tmp_path):
    a, da = _cli(tmp_path, "workload.requests=200", name="a")
    b, db = _cli(tmp_path, "workload.requests=200", name="b")
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert not set(_rooms(da)) & set(_rooms(db))  # a drawn seed each: no room in common
    seeds = [json.loads((d / "fingerprint.json").read_text())["seeds"] for d in (da, db)]
    assert all(s["drawn"] for s in seeds) and seeds[0]["workload.seed"] != seeds[1]["workload.seed"]
    assert Results.read(da).workload.seed == seeds[0]["workload.seed"]
    c, dc = _cli(tmp_path, "workload.requests=200", "workload.seed=5", name="c")
    d, dd = _cli(tmp_path, "workload.requests=200", "workload.seed=5", name="d")
    assert c.returncode == d.returncode == 0
    assert _rooms(dc) == _rooms(dd)  # a pinned seed repeats its rooms
    assert json.loads((dc / "fingerprint.json").read_text())["seeds"]["drawn"] is False

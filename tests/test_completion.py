"""A Mooncake batch's completion asked without waiting (backends/mooncake/completion.py), on
the real engine of the installed wheel: real writes over Mooncake's TCP transport into this
process's own registered memory.

What it must hold: it never says done before every block has landed (the binding's
`transfer_check_status`, which looks at task 0 alone, does), a failed block fails the batch,
and MooncakeEngine.landed() raises on that as wait() does."""

from __future__ import annotations

import time

import numpy as np
import pytest

from orchestrator.handoff.backends.mooncake.completion import BatchStatus, TaskState, transfer_timeout_ns
from orchestrator.handoff.backends.mooncake.engine import EngineError, MooncakeEngine

pytestmark = pytest.mark.integration

BLOCKS, BLOCK = 20, 50_000  # a batch whose tasks land at visibly different times


@pytest.fixture(scope="module")
def engine():
    eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "tcp")
    src = np.random.default_rng(0).integers(1, 256, BLOCKS * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    eng.register(src.ctypes.data, src.nbytes)
    eng.register(dst.ctypes.data, dst.nbytes)
    return eng, src, dst


def _submit(eng: MooncakeEngine, src: np.ndarray, dst: np.ndarray, dst_offset: int = 0) -> tuple[int, float]:
    srcs = [src.ctypes.data + i * BLOCK for i in range(BLOCKS)]
    dsts = [dst.ctypes.data + dst_offset + i * BLOCK for i in range(BLOCKS)]
    t0 = time.monotonic()
    return eng.submit(eng.session_id, srcs, dsts, [BLOCK] * BLOCKS), t0


def test_the_installed_wheel_exports_the_batch_status(engine):
    eng, _, _ = engine
    assert eng.polls and BatchStatus.attach(eng.raw) is not None


def test_done_only_once_every_block_landed(engine):
    """200 batches of 20 blocks, each asked until done: every byte is there at the first
    'done'. (The binding's transfer_check_status said done early for 189 of 200 such batches
    on the 2-core box.)"""
    eng, src, dst = engine
    early = asks = 0
    for _ in range(200):
        dst[:] = 0
        batch, t0 = _submit(eng, src, dst)
        while not eng.landed(batch, t0, src.nbytes):
            asks += 1
        early += not np.array_equal(src, dst)
    assert early == 0
    assert asks > 0  # it was asked while in flight, and answered not yet


def test_a_failed_block_fails_the_batch(engine):
    """A destination outside the peer's registered memory: the peer refuses that block, and
    the batch is FAILED (landed() raises, as wait() would), not WAITING forever."""
    eng, src, dst = engine
    batch, t0 = _submit(eng, src, dst, dst_offset=1 << 40)
    deadline = time.monotonic() + 30
    with pytest.raises(EngineError, match="getBatchTransferStatus"):
        while not eng.landed(batch, t0, src.nbytes):
            assert time.monotonic() < deadline, "a failed batch was never reported"


def test_poll_says_waiting_then_completed(engine):
    eng, src, dst = engine
    status = BatchStatus.attach(eng.raw)
    assert status is not None
    dst[:] = 0
    batch, _ = _submit(eng, src, dst)
    states = []
    while not states or states[-1] is TaskState.WAITING:
        states.append(status.poll(batch))
    assert states[-1] is TaskState.COMPLETED and set(states[:-1]) <= {TaskState.WAITING}
    assert np.array_equal(src, dst)


def test_a_wheel_without_the_symbols_keeps_the_engine_wait():
    class Bare:  # a binding with no get_engine_ptr
        pass

    assert BatchStatus.attach(Bare()) is None
    eng = MooncakeEngine.__new__(MooncakeEngine)
    waited = []
    eng._status = None
    eng._engine = type("W", (), {"get_batch_transfer_status": lambda self, ids: waited.append(ids) or 0})()
    assert not eng.polls
    assert eng.landed(7, time.monotonic(), 64) and waited == [[7]]


@pytest.mark.parametrize("value, seconds", [(None, 30), ("12", 12), ("2", 5), ("x", 5), (" 7s", 7), ("-3", 5)])
def test_the_timeout_reads_mc_transfer_timeout_as_the_binding_does(value, seconds):
    env = {} if value is None else {"MC_TRANSFER_TIMEOUT": value}
    assert transfer_timeout_ns(env) == seconds * 10**9

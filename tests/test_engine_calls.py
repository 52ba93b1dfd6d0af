"""MooncakeEngine's call dispatch: numpy address arrays go to Mooncake 0.3.14's `*_arrays`
calls where the wheel has them (feature-detected), and to the list calls of 0.3.13 (the CPU
wheel) otherwise; lists always take the list calls. The bytes themselves move through the real
engine in tests/test_transports.py; this only checks which binding call gets what."""

import numpy as np

from orchestrator.handoff.backends.mooncake.engine import MooncakeEngine


class _Wheel:
    """A TransferEngine binding that records its calls (with or without the 0.3.14 calls)."""

    def __init__(self, arrays: bool):
        self.calls: list[tuple] = []
        if arrays:
            self.batch_transfer_async_write_arrays = self._rec("async_arrays", 7)
            self.batch_transfer_sync_write_arrays = self._rec("sync_arrays", 0)
        self.batch_transfer_async_write = self._rec("async_list", 7)
        self.batch_transfer_sync_write = self._rec("sync_list", 0)

    def _rec(self, name, rc):
        def call(*args):
            self.calls.append((name, args))
            return rc
        return call


def _engine(arrays: bool) -> tuple[MooncakeEngine, _Wheel]:
    eng = MooncakeEngine.__new__(MooncakeEngine)
    wheel = _Wheel(arrays)
    eng._engine = wheel
    eng._async_arrays = getattr(wheel, "batch_transfer_async_write_arrays", None)
    eng._sync_arrays = getattr(wheel, "batch_transfer_sync_write_arrays", None)
    return eng, wheel


def test_arrays_reach_the_arrays_calls_as_contiguous_uint64():
    eng, wheel = _engine(arrays=True)
    assert eng._async_arrays is not None  # the wheel takes numpy address arrays
    srcs = np.array([[1, 99], [2, 99]], dtype=np.int64)[:, 0]  # not contiguous, int64
    assert eng.submit("s", srcs, np.array([10, 20]), np.array([64, 64])) == 7
    eng.batch_write("s", srcs, np.array([10, 20]), np.array([64, 64]))
    assert [c[0] for c in wheel.calls] == ["async_arrays", "sync_arrays"]
    for _, (session, *arrs) in wheel.calls:
        assert session == "s"
        assert all(a.dtype == np.uint64 and a.flags.c_contiguous for a in arrs)
        assert [a.tolist() for a in arrs] == [[1, 2], [10, 20], [64, 64]]


def test_lists_and_the_old_wheel_take_the_list_calls():
    eng, wheel = _engine(arrays=True)
    eng.submit("s", [1, 2], [10, 20], [64, 64])
    old, old_wheel = _engine(arrays=False)
    assert old._async_arrays is None
    old.submit("s", np.array([1, 2], dtype=np.uint64), np.array([10, 20]), np.array([64, 64]))
    old.batch_write("s", np.array([1]), np.array([10]), np.array([64]))
    assert [c[0] for c in wheel.calls] == ["async_list"]
    assert [c[0] for c in old_wheel.calls] == ["async_list", "sync_list"]
    for _, (_, *seqs) in wheel.calls + old_wheel.calls:
        assert all(type(x) is list and all(type(v) is int for v in x) for x in seqs)

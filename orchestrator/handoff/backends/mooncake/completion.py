"""A Mooncake batch's completion, asked without waiting.

The Python binding (0.3.13 / 0.3.14) has two completion calls and neither fits a loop that
must keep hearing its sockets: `get_batch_transfer_status` busy-polls until the batch is done
or its timeout passes (a write to a decode whose link was cut holds it ~13 s), and
`transfer_check_status` looks at task 0 alone and frees the batch when that one is done (the
others may still be in flight: it said done 12 ms before a 10-block batch was).

The engine itself has the call: `mooncake::TransferEngine::getBatchTransferStatus(batch,
status&)` looks once at every task of the batch and returns (MultiTransport: COMPLETED,
FAILED or WAITING). Both wheels export it and `freeBatchID(batch)` from engine.so, and the
binding's `get_engine_ptr()` gives the `TransferEngine*`. Both return a `Status` (a 2-byte
code and a `const char*` message, with a destructor): by the Itanium C++ ABI the caller passes
its storage as a hidden first argument, then `this`. Checked against both wheels'
disassembly (0.3.13.post1 non-cuda, 0.3.14 cuda13: the method loads `impl_` from `*this` and
returns the hidden pointer). `BatchStatus.attach` returns None where a symbol is missing, so
a wheel without them keeps the blocking wait.

Timeouts are the binding's own: a batch not done `transfer_timeout + its bytes` ns after it
started (`MC_TRANSFER_TIMEOUT` seconds, at least 5; 30 when unset) has failed."""

from __future__ import annotations

import ctypes
import os
import re
import sys
from enum import IntEnum
from typing import Any, Optional

_GET_STATUS = "_ZN8mooncake14TransferEngine22getBatchTransferStatusEmRNS_9Transport14TransferStatusE"
_FREE_BATCH = "_ZN8mooncake14TransferEngine11freeBatchIDEm"
_DELETE_ARRAY = "_ZdaPv"  # operator delete[](void*): frees a non-OK Status's message


class TaskState(IntEnum):
    """mooncake::Transport::TransferStatusEnum."""

    WAITING = 0
    PENDING = 1
    INVALID = 2
    CANCELED = 3
    COMPLETED = 4
    TIMEOUT = 5
    FAILED = 6


_WAITING, _COMPLETED, _FAILED = TaskState.WAITING, TaskState.COMPLETED, TaskState.FAILED
_STILL = (int(TaskState.WAITING), int(TaskState.PENDING))  # the raw states poll() reads as plain ints
_DONE = int(TaskState.COMPLETED)


class _Status(ctypes.Structure):
    """mooncake::Status: `Code code_` (uint16) and `const char* message_` (nullptr when OK)."""

    _fields_ = [("code", ctypes.c_uint16), ("message", ctypes.c_void_p)]


class _TransferStatus(ctypes.Structure):
    """mooncake::Transport::TransferStatus."""

    _fields_ = [("s", ctypes.c_int), ("transferred_bytes", ctypes.c_size_t)]


def transfer_timeout_ns(env: Optional[dict[str, str]] = None) -> int:
    """The binding's timeout for a batch, less its bytes: MC_TRANSFER_TIMEOUT seconds (at
    least 5; C's atoi, so a non-number reads 0 and gives 5), else 30."""
    value = (os.environ if env is None else env).get("MC_TRANSFER_TIMEOUT")
    if value is None:
        return 30 * 10**9
    number = re.match(r"\s*([+-]?\d+)", value)  # what atoi reads
    return max(5, int(number.group(1)) if number else 0) * 10**9


class BatchStatus:
    """Looks once at a batch's tasks: `poll(batch)` is TaskState.COMPLETED (the batch is
    freed: never ask again), FAILED (freed where every task has finished, as the binding's
    own wait does) or WAITING. One caller at a time (its Status and TransferStatus are reused
    across calls): the prefill's loop."""

    def __init__(self, engine_ptr: int, get_status: Any, free_batch: Any, delete_array: Any):
        self._this = ctypes.c_void_p(engine_ptr)
        self._get, self._free, self._delete = get_status, free_batch, delete_array
        self._ret = _Status()
        self._st = _TransferStatus()
        self._ret_ref, self._st_ref = ctypes.byref(self._ret), ctypes.byref(self._st)

    @classmethod
    def attach(cls, engine: Any) -> Optional["BatchStatus"]:
        """For a mooncake.engine.TransferEngine: None where its wheel lacks get_engine_ptr or
        engine.so lacks either symbol."""
        ptr_of = getattr(engine, "get_engine_ptr", None)
        path = getattr(sys.modules.get(type(engine).__module__), "__file__", None)
        if ptr_of is None or not path:
            return None
        try:
            lib = ctypes.CDLL(path)  # the extension already loaded: the same handle
            get_status = getattr(lib, _GET_STATUS)
            free_batch = getattr(lib, _FREE_BATCH)
            delete_array = getattr(lib, _DELETE_ARRAY)  # found in its libstdc++
        except (OSError, AttributeError):
            return None
        get_status.restype = free_batch.restype = delete_array.restype = None
        get_status.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p]
        free_batch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
        delete_array.argtypes = [ctypes.c_void_p]
        ptr = int(ptr_of())
        return cls(ptr, get_status, free_batch, delete_array) if ptr else None

    def _ok(self) -> bool:
        """Whether the last call's Status was OK; frees its message where it had one."""
        ret = self._ret
        if ret.message:
            self._delete(ret.message)
            ret.message = None
        return ret.code == 0

    def poll(self, batch: int) -> TaskState:
        ret = self._ret  # the callee constructs the Status in it (and sets the state unless it failed)
        self._get(self._ret_ref, self._this, batch, self._st_ref)
        s = self._st.s if ret.code == 0 and not ret.message else -1
        if s in _STILL:
            return _WAITING
        self._ok()  # frees a message
        self.free(batch)
        return _COMPLETED if s == _DONE else _FAILED  # any other state, or a non-OK Status, failed

    def free(self, batch: int) -> bool:
        """freeBatchID: whether the batch was freed (not while a task is unfinished)."""
        self._free(self._ret_ref, self._this, batch)
        return self._ok()

"""Mooncake TransferEngine wrapper: one engine per process, return codes become exceptions.

Mooncake picks its transport at initialize time from the PRESENCE of MC_* variables, and it
does not validate protocol names, so this wrapper (1) applies the plan's MC_* environment
(set or unset, every managed name) right before creating the engine, and (2) reads what the
engine itself logged while it came up to record the EFFECTIVE transport, which the caller
compares with the declared one.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from orchestrator.handoff.backends.mooncake.completion import BatchStatus, TaskState, transfer_timeout_ns
from orchestrator.handoff.backends.mooncake.probe import send_probe
from orchestrator.handoff.transport.ports import any_free_port
from orchestrator.profile.kinds import is_loopback
from orchestrator.profile.plan import EngineTransport
from orchestrator.results.rundir import open_regular


class EngineError(RuntimeError):
    """A Mooncake call returned an error code; `rc` and `context` say which and on what."""

    def __init__(self, op: str, rc: int, **context: object):
        self.op, self.rc, self.context = op, rc, context
        detail = ", ".join(f"{k}={v}" for k, v in context.items())
        super().__init__(f"mooncake {op} returned {rc}" + (f" ({detail})" if detail else ""))


# What the engine prints when a transport comes up (glog lines, Mooncake 0.3.13/0.3.14).
_TRANSPORT_MARKERS = (
    (re.compile(r"Intra-Node NVLink transport|IntraNodeNvlinkTransport", re.I),
     EngineTransport.nvlink_intra),
    (re.compile(r"RdmaTransport|using RDMA|rdma_transport", re.I), EngineTransport.rdma),
    (re.compile(r"TcpTransport|using TCP transport", re.I), EngineTransport.tcp),
)


_METADATA_FAILURE = re.compile(r"EtcdStoragePlugin: unable to \w+ .*|context deadline exceeded.*")


def _metadata_failure(text: str) -> Optional[str]:
    """The metadata server's failure in an initialize log (etcd not answering: Mooncake's
    etcd client gives up after 5 s per call), else None."""
    match = _METADATA_FAILURE.search(text or "")
    return f"metadata server not answering: {match.group(0).strip()}" if match else None


def transport_from_log(text: str) -> Optional[EngineTransport]:
    """The transport an engine's start-up log shows, or None if it names none."""
    for pattern, transport in _TRANSPORT_MARKERS:
        if pattern.search(text):
            return transport
    return None


_fd_lock = threading.Lock()


@contextmanager
def captured_stderr(log_path: Optional[str]) -> Iterator[list[str]]:
    """Send file descriptor 2 (where glog writes) straight into `log_path` (appending), so
    what the engine printed survives even when it aborts the process; yield a list that
    receives the text written while inside. Without a path, a temporary file is used."""
    out: list[str] = []
    with _fd_lock:
        fh = (open(open_regular(log_path, os.O_RDWR | os.O_APPEND | os.O_CREAT), "a+b") if log_path
              else tempfile.TemporaryFile(mode="w+b"))  # a link or FIFO planted there: refused
        with fh:
            fh.seek(0, os.SEEK_END)
            start = fh.tell()
            saved = os.dup(2)
            try:
                os.dup2(fh.fileno(), 2)
                yield out
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                fh.seek(start)
                out.append(fh.read().decode(errors="replace"))


def listening_sockets() -> list[str]:
    """"addr:port" of every TCP socket this process listens on (Linux /proc). Mooncake binds
    its handshake and TCP-transport listeners on all interfaces whatever host it is given;
    this is how a run finds out and says so."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, v6 in (("/proc/self/net/tcp", False), ("/proc/self/net/tcp6", True)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A = LISTEN
                continue
            addr_hex, port_hex = cols[1].split(":")
            if v6:
                words = [addr_hex[i:i + 8] for i in range(0, 32, 8)]
                raw = b"".join(bytes.fromhex(w)[::-1] for w in words)
                addr = "[" + ipaddress.IPv6Address(raw).compressed + "]"
            else:
                addr = str(ipaddress.IPv4Address(bytes.fromhex(addr_hex)[::-1]))
            found.append(f"{addr}:{int(port_hex, 16)}")
    return sorted(found)


def exposed(listeners: list[str]) -> list[str]:
    """The listeners not bound to a loopback address."""
    out = []
    for item in listeners:
        addr = item.rsplit(":", 1)[0].strip("[]")
        if not is_loopback(addr, ipv6=True):
            out.append(item)
    return out


def apply_env(env: Mapping[str, Optional[str]]) -> dict[str, str]:
    """Set or unset each variable; return the effective values of the names touched."""
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return {name: os.environ[name] for name in env if name in os.environ}


@contextmanager
def _init_lock(wait_s: float = 10.0) -> Iterator[None]:
    """Serialises engine start-up among this host's processes. Mooncake 0.3.13/0.3.14 picks
    its handshake and TCP-transport ports at random in one range, probes them with
    SO_REUSEADDR and listens later: two engines starting at once can pick the same port, and
    one then dies with "listen: Address already in use". Once initialize returned, both of its
    ports listen and later probes skip them. A holder that takes more than `wait_s` (a stuck
    metadata server) is not waited for further."""
    import fcntl

    path = os.path.join(tempfile.gettempdir(), "orchestrator-mooncake-init.lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:  # another user's lock file: start unserialised, as Mooncake alone would
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)  # releases the lock


def _unique_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


Addresses = Union[Sequence[int], np.ndarray]


def _as_list(values: Addresses) -> Sequence[int]:
    return values.tolist() if isinstance(values, np.ndarray) else values


def _as_u64(values: Addresses) -> np.ndarray:
    """Contiguous uint64, as the 0.3.14 `*_arrays` calls take (no copy when it already is)."""
    return np.ascontiguousarray(values, dtype=np.uint64)


class MooncakeEngine:
    """One initialized TransferEngine. Create one per process and reuse it (teardown ~1 s).

    Block addresses and lengths may be Python lists or numpy integer arrays. Mooncake 0.3.14
    (the CUDA 13 wheel) takes contiguous 8-byte integer arrays in its
    `batch_transfer_{async,sync}_write_arrays` calls; where the installed wheel has them
    (feature-detected), arrays go to them as they are, with no Python list built per call.
    0.3.13 (the CPU wheel) has only the list calls: arrays are turned into lists for it."""

    def __init__(
        self,
        host: str,
        metadata_server: str,
        protocol: str,
        device_name: str = "",
        env: Optional[Mapping[str, Optional[str]]] = None,
        log_path: Optional[str] = None,
    ):
        self.applied_env = apply_env(env or {})
        from mooncake.engine import TransferEngine  # imported late: env must be in place

        with _init_lock():
            try:
                port_ok = any_free_port(os.environ, host)
            except ValueError as exc:
                raise EngineError("initialize", -1, reason=str(exc)) from None
            if not port_ok:  # Mooncake would segfault in initialize
                raise EngineError("initialize", -1, reason="no free port in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT")
            # With P2PHANDSHAKE a segment is named host:rpc_port (the port Mooncake picks). With
            # a metadata server the name is exactly the local_hostname given, and two engines
            # registering the same name collide: give each a port number of its own.
            local = host if metadata_server == "P2PHANDSHAKE" else f"{host}:{_unique_port(host)}"
            self._engine = TransferEngine()
            quiet_info_logs(0)  # an earlier engine of this process raised it: its lines name the transport
            with captured_stderr(log_path) as logged:
                rc = self._engine.initialize(local, metadata_server, protocol, device_name)
        self.init_log = logged[0] if logged else ""
        if rc != 0:
            why = _metadata_failure(self.init_log)
            raise EngineError("initialize", rc, host=host, metadata_server=metadata_server,
                              protocol=protocol, **({"reason": why} if why else {}))
        self.host = host
        self.protocol = protocol
        self.rpc_port = self._engine.get_rpc_port()
        self.session_id = f"{host}:{self.rpc_port}" if local == host else local
        self.effective_transport = transport_from_log(self.init_log)
        self._async_arrays = getattr(self._engine, "batch_transfer_async_write_arrays", None)
        self._sync_arrays = getattr(self._engine, "batch_transfer_sync_write_arrays", None)
        self._status = BatchStatus.attach(self._engine)
        self._timeout_ns = transfer_timeout_ns()
        self.quiet = quiet_info_logs()  # its start-up lines were read: only now

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise EngineError("register_memory", rc, ptr=hex(ptr), nbytes=nbytes)

    def probe(self, session: str) -> bool:
        """Whether the peer's handshake port `session` answered Mooncake's send_probe (False
        where the installed wheel has none)."""
        return send_probe(self._engine, session) == 0

    def submit(self, session: str, srcs: Addresses, dsts: Addresses, lengths: Addresses) -> int:
        """Start one batch write; returns its batch id (wait() for it)."""
        if self._async_arrays is not None and isinstance(srcs, np.ndarray):
            batch = self._async_arrays(session, _as_u64(srcs), _as_u64(dsts), _as_u64(lengths))
        else:
            batch = self._engine.batch_transfer_async_write(session, _as_list(srcs), _as_list(dsts),
                                                            _as_list(lengths))
        if batch == 0:
            raise EngineError("batch_transfer_async_write", -1, session=session,
                              blocks=len(srcs), bytes=int(sum(_as_list(lengths))))
        return batch

    def wait(self, batch: int, **context: object) -> None:
        """Until the batch has landed (Mooncake polls its status in a loop). Raises
        EngineError: Mooncake writes the good blocks of a failed batch anyway (no rollback),
        so the receiver must never trust a slot whose sender saw this raise."""
        rc = self._engine.get_batch_transfer_status([batch])
        if rc != 0:
            raise EngineError("get_batch_transfer_status", rc, **context)

    @property
    def polls(self) -> bool:
        """Whether landed() answers without waiting (the wheel exports the engine's batch
        status: completion.py); else it is wait()."""
        return self._status is not None

    def landed(self, batch: int, t0: float, nbytes: int, **context: object) -> bool:
        """Whether the batch (started at monotonic `t0`, `nbytes` long) has landed, asked once,
        without waiting; True means it was freed, so never ask again. Raises EngineError as
        wait() does: a task failed, or the batch is older than the binding's timeout (its
        transfer timeout plus a nanosecond a byte). Where the wheel has no batch status, it
        is wait()."""
        status = self._status
        if status is None:
            self.wait(batch, **context)
            return True
        state = status.poll(batch)
        if state is TaskState.COMPLETED:
            return True
        if state is TaskState.FAILED:
            raise EngineError("getBatchTransferStatus", -1, **context)
        if (time.monotonic() - t0) * 1e9 > self._timeout_ns + nbytes:
            status.free(batch)  # the binding frees a timed-out batch too (once its tasks end)
            raise EngineError("getBatchTransferStatus", -2, reason="timeout", **context)
        return False

    def batch_write(self, session: str, srcs: Addresses, dsts: Addresses, lengths: Addresses) -> None:
        """One synchronous batch write (SGLang's call)."""
        if self._sync_arrays is not None and isinstance(srcs, np.ndarray):
            rc = self._sync_arrays(session, _as_u64(srcs), _as_u64(dsts), _as_u64(lengths))
        else:
            rc = self._engine.batch_transfer_sync_write(session, _as_list(srcs), _as_list(dsts),
                                                        _as_list(lengths))
        if rc != 0:
            raise EngineError("batch_transfer_sync_write", rc, session=session,
                              blocks=len(srcs), bytes=int(sum(_as_list(lengths))))

    @property
    def raw(self) -> Any:
        """The underlying TransferEngine (benchmarks compare against it directly)."""
        return self._engine


_GLOG_MINLOGLEVEL = "_ZN3fLI17FLAGS_minloglevelE"  # glog's FLAGS_minloglevel (C++ mangled)


def quiet_info_logs(level: int = 1) -> bool:
    """Set the engine's glog threshold in this process: 1 (WARNING, the default) once an
    engine's start-up lines were read (Mooncake logs one INFO line per batch write, "Batch
    Transfer completed!", ~82 bytes a request, into the process's stderr log; warnings and
    errors still go there); 0 (INFO) before the next engine starts in the same process, whose
    start-up lines name its effective transport. False where glog is not found."""
    import ctypes

    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({line.split()[-1] for line in fh if "/libglog" in line})
    except OSError:
        return False
    for path in paths:
        try:
            ctypes.c_int.in_dll(ctypes.CDLL(path), _GLOG_MINLOGLEVEL).value = level
            return True
        except (OSError, ValueError):
            continue
    return False

"""SGLang 0.5.23's own aux-metadata code, loaded from the installed release as a test oracle.

Importing sglang's modules pulls in dependencies this project does not install (and
`sglang/__init__.py` itself runs sglang.srt.environ's cache redirection and transformers
patches), so nothing of sglang is imported. Instead the installed wheel's source files are
located (importlib.util.find_spec("sglang") reads the package's location from the path
finders without executing any of it), parsed with `ast`, and exactly the definitions the
tests need are compiled from the shipped syntax trees (never edited: same text, same line
numbers in tracebacks) and executed in a namespace that supplies the few names they refer to:

  disaggregation/utils.py          MetadataBuffers
  disaggregation/common/utils.py   AuxDataCodec
  disaggregation/base/conn.py      KVPoll
  disaggregation/common/conn.py    CommonKVManager: _encode_kv_status_message,
                                   parse_kv_status_message, send_kv_status_message,
                                   _send_multipart_locked, _prefill_unique_rank,
                                   handle_chunk_ready, handle_abort_ack_message, the class
                                   attributes kv_status_msg_tag / kv_status_msg_carries_reason,
                                   and ABORT_ACK_TAG
  disaggregation/mooncake/conn.py  MooncakeKVManager: AUX_DATA_HEADER, send_aux_tcp,
                                   send_aux_data_to_endpoint, _handle_aux_data, and the
                                   decode_thread loop nested in start_decode_thread
                                   (its bases are checked: neither it nor
                                   common/staging_handler.py's StagingManagerMixin overrides
                                   what is taken from CommonKVManager)
  environ.py                       EnvField, EnvBool, EnvStr (how `envs.X.get()` reads the
                                   environment), declared like Envs declares the two flags
  utils/network.py                 NetworkAddress (with _is_ipv6, _wrap)

What is stubbed (this module's own code, not SGLang's): is_npu() -> False; the socket cache
behind `_send_multipart_locked` (`_connect`: one ZMQ PUSH socket per endpoint, as SGLang's);
and the manager state the extracted methods read (kv_args with aux_data_ptrs/aux_item_lens,
no staging handler, deferred KV release off, apply_prefill_status recording its arguments).

load() returns the Oracle, or raises OracleUnavailable (tests turn that into a skip) when
sglang 0.5.23 is not installed (`make` installs it with --no-deps: its runtime dependencies
are not needed).
"""

from __future__ import annotations

import ast
import ctypes
import importlib.metadata
import importlib.util
import logging
import struct
import sys
import threading
import time
import types
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import zmq

SGLANG_VERSION = "0.5.23"
_DISAGG = "srt/disaggregation"


class OracleUnavailable(RuntimeError):
    """sglang 0.5.23's source is not installed here."""


# ---- finding and compiling the shipped source ------------------------------------------------
def package_dir() -> Path:
    """The installed sglang package directory, found without executing sglang's code."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise OracleUnavailable(
            f"sglang=={SGLANG_VERSION} is not installed (the oracle of the SGLang compatibility "
            f"tests; `make` installs it: pip install --no-deps sglang=={SGLANG_VERSION})") from None
    if version != SGLANG_VERSION:
        raise OracleUnavailable(f"sglang {version} is installed; these tests hold the code "
                                f"against sglang=={SGLANG_VERSION}")
    spec = importlib.util.find_spec("sglang")  # top-level: locates, executes nothing
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        dist = importlib.metadata.distribution("sglang")
        locations = [str(dist.locate_file("sglang"))]
    root = Path(locations[0])
    if not (root / _DISAGG / "utils.py").is_file():
        raise OracleUnavailable(f"sglang's source is not at {root} (a build without .py files?)")
    return root


class _Source:
    """One shipped file: its syntax tree and accessors for the definitions in it."""

    def __init__(self, root: Path, rel: str):
        self.path = root / rel
        self.tree = ast.parse(self.path.read_text(encoding="utf-8"), filename=str(self.path))
        self.future = [n for n in self.tree.body
                       if isinstance(n, ast.ImportFrom) and n.module == "__future__"]

    def top(self, name: str) -> ast.stmt:
        for node in self.tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
                return node
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node
        raise OracleUnavailable(f"{self.path}: no top-level {name}")

    def method(self, cls: str, name: str) -> ast.FunctionDef:
        for node in self.top(cls).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        raise OracleUnavailable(f"{self.path}: {cls} has no method {name}")

    def class_attr(self, cls: str, name: str) -> Optional[ast.expr]:
        """The value expression of a class-body assignment, None when the class has none."""
        for node in self.top(cls).body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == name:
                return node.value
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node.value
        return None

    def run(self, nodes: Sequence[ast.stmt], ns: Dict[str, Any]) -> Dict[str, Any]:
        """Compile the shipped nodes (with the file's own __future__ imports) and execute
        them in `ns`; tracebacks name the installed file and its real line numbers."""
        module = ast.Module(body=[*self.future, *nodes], type_ignores=[])
        exec(compile(module, str(self.path), "exec", dont_inherit=True), ns)
        return ns

    def value(self, expr: ast.expr, ns: Dict[str, Any]) -> Any:
        return eval(compile(ast.Expression(expr), str(self.path), "eval", dont_inherit=True), ns)


def _namespace(name: str, **names: Any) -> Dict[str, Any]:
    """The globals of the extracted code: a module of its own (dataclasses look their
    class's module up in sys.modules), named apart from sglang's real modules."""
    module = types.ModuleType(f"sglang_oracle_src.{name}")
    module.__dict__.update(names)
    sys.modules[module.__name__] = module
    return module.__dict__


def _nested_function(outer: ast.FunctionDef, name: str) -> ast.FunctionDef:
    for node in outer.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise OracleUnavailable(f"{outer.name} has no nested function {name}")


def _closure_factory(src: _Source, inner: ast.FunctionDef, free: Sequence[str],
                     ns: Dict[str, Any]) -> Callable[..., Callable]:
    """A function (free vars...) -> `inner`, `inner` being the shipped nested function
    (unchanged), closed over the variables its enclosing method defined."""
    wrapper = ast.parse(f"def _bind_{inner.name}({', '.join(free)}):\n    return {inner.name}\n").body[0]
    wrapper.body.insert(0, inner)
    ast.copy_location(wrapper, inner)
    ast.fix_missing_locations(wrapper)
    src.run([wrapper], ns)
    return ns[f"_bind_{inner.name}"]


# ---- this module's stubs for what the extracted methods read ----------------------------------
class _Logger(logging.LoggerAdapter):
    def __init__(self, name: str):
        super().__init__(logging.getLogger(name), {})

    def warning_once(self, msg, *args, **kwargs):
        self.warning(msg, *args, **kwargs)


def _is_npu() -> bool:
    return False


class _AbortAckUnavailable:
    @staticmethod
    def from_zmq(msg):  # only reached with deferred KV release on, which the stub keeps off
        raise AssertionError("ABORT_ACK handling needs msgspec; not part of the oracle")


@dataclass
class AuxKVArgs:
    """The part of SGLang's KVArgs the aux path reads."""

    aux_data_ptrs: List[int]
    aux_item_lens: List[int]


@dataclass
class TransferTarget:
    """The part of SGLang's TransferInfo that send_aux_tcp reads."""

    room: int
    endpoint: str
    dst_port: int
    dst_aux_index: int


class _ManagerState:
    """State of a MooncakeKVManager as far as the extracted methods read it. The methods
    themselves are SGLang's (attached by Oracle._manager_class)."""

    def __init__(self, kv_args: AuxKVArgs, ctx: zmq.Context, prefill_rank: int = 0):
        self.kv_args = kv_args
        self._zmq_ctx = ctx
        self._socket_cache: Dict[str, zmq.Socket] = {}
        self._socket_lock = threading.Lock()
        self._socket_send_locks = defaultdict(threading.Lock)
        self._stopped = False
        # _prefill_unique_rank() = attn_tp_rank * (pp_size * attn_cp_size) + ... = prefill_rank
        self.attn_tp_rank, self.pp_size, self.attn_cp_size = prefill_rank, 1, 1
        self.pp_rank, self.attn_cp_rank = 0, 0
        self.request_status: Dict[int, Any] = {}
        self._staging_handler = None
        self.enable_deferred_decode_kv_release = False
        self.applied: List[Tuple[int, int, int, Optional[str]]] = []
        self.staging_requests: List[List[bytes]] = []

    def _connect(self, endpoint: str, is_ipv6: bool = False) -> zmq.Socket:
        """One PUSH socket per endpoint, as SGLang's CommonKVManager._connect (bounded send)."""
        with self._socket_lock:
            sock = self._socket_cache.get(endpoint)
            if sock is None:
                sock = self._zmq_ctx.socket(zmq.PUSH)
                if is_ipv6:
                    sock.setsockopt(zmq.IPV6, 1)
                sock.setsockopt(zmq.SNDTIMEO, 5000)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.connect(endpoint)
                self._socket_cache[endpoint] = sock
            return sock

    def apply_prefill_status(self, *, bootstrap_room, status, prefill_rank, failure_reason):
        self.applied.append((bootstrap_room, status, prefill_rank, failure_reason))

    def _handle_staging_req(self, msg):
        self.staging_requests.append(msg)

    def note_abort_ack(self, room, prefill_rank, generation):
        raise AssertionError("not reached: deferred KV release is off")

    def close(self) -> None:
        for sock in self._socket_cache.values():
            sock.close(linger=1000)
        self._socket_cache.clear()


# ---- the oracle ------------------------------------------------------------------------------
class Oracle:
    def __init__(self, root: Path):
        self.root = root
        d = _DISAGG
        environ = _Source(root, "srt/environ.py")
        network = _Source(root, "srt/utils/network.py")
        base = _Source(root, f"{d}/base/conn.py")
        common_utils = _Source(root, f"{d}/common/utils.py")
        utils = _Source(root, f"{d}/utils.py")
        common = _Source(root, f"{d}/common/conn.py")
        mooncake = _Source(root, f"{d}/mooncake/conn.py")
        staging = _Source(root, f"{d}/common/staging_handler.py")

        import ipaddress
        import os
        import socket
        import warnings
        from contextlib import contextmanager
        from dataclasses import dataclass as _dataclass

        import torch

        # envs: SGLang's EnvField/EnvBool/EnvStr, declared as Envs declares the two flags
        env_ns = environ.run([environ.top("EnvField"), environ.top("EnvBool"), environ.top("EnvStr")],
                             _namespace("environ", os=os, warnings=warnings, Any=Any,
                                        contextmanager=contextmanager))
        envs_cls = type("Envs", (), {
            "SGLANG_ENABLE_DISAGG_SAMPLING_MASK": env_ns["EnvBool"](False),
            "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": env_ns["EnvStr"](None),
        })
        self.envs = envs_cls()
        self._check_env_defaults(environ, env_ns)

        net_ns = network.run([network.top("_is_ipv6"), network.top("_wrap"), network.top("NetworkAddress")],
                             _namespace("network", ipaddress=ipaddress, socket=socket,
                                        dataclass=_dataclass, Optional=Optional))
        self.NetworkAddress = net_ns["NetworkAddress"]

        self.KVPoll = base.run([base.top("KVPoll")], _namespace("base.conn"))["KVPoll"]
        self.AuxDataCodec = common_utils.run([common_utils.top("AuxDataCodec")],
                                             _namespace("common.utils", ctypes=ctypes))["AuxDataCodec"]

        self.MetadataBuffers = utils.run([utils.top("MetadataBuffers")], _namespace(
            "utils", torch=torch, nullcontext=nullcontext, envs=self.envs, is_npu=_is_npu,
            Req=Any, Tuple=Tuple, Optional=Optional, List=List))["MetadataBuffers"]

        common_methods = ["_encode_kv_status_message", "parse_kv_status_message",
                          "send_kv_status_message", "_send_multipart_locked", "_prefill_unique_rank",
                          "handle_chunk_ready", "handle_abort_ack_message"]
        common_ns = _namespace("common.conn", logger=_Logger("sglang_oracle.common.conn"),
                               NetworkAddress=self.NetworkAddress, KVPoll=self.KVPoll,
                               AbortAck=_AbortAckUnavailable, List=List, Optional=Optional,
                               Tuple=Tuple)
        # MooncakeKVManager(StagingManagerMixin, CommonKVManager): what it takes from
        # CommonKVManager must not be overridden in front of it
        bases = [b.id for b in mooncake.top("MooncakeKVManager").bases if isinstance(b, ast.Name)]
        if bases != ["StagingManagerMixin", "CommonKVManager"]:
            raise OracleUnavailable(f"MooncakeKVManager's bases are {bases}")
        for name in common_methods + ["kv_status_msg_tag", "kv_status_msg_carries_reason"]:
            for src, cls in ((mooncake, "MooncakeKVManager"), (staging, "StagingManagerMixin")):
                if src.class_attr(cls, name) is not None or any(
                        isinstance(n, ast.FunctionDef) and n.name == name for n in src.top(cls).body):
                    raise OracleUnavailable(f"{cls} overrides {name}; the oracle binds CommonKVManager's")
        common.run([common.top("ABORT_ACK_TAG")] + [common.method("CommonKVManager", m)
                                                     for m in common_methods], common_ns)
        mooncake_methods = ["send_aux_tcp", "send_aux_data_to_endpoint", "_handle_aux_data"]
        self._mooncake_ns = mooncake_ns = _namespace(
            "mooncake.conn", logger=_Logger("sglang_oracle.mooncake.conn"), struct=struct,
            AuxDataCodec=self.AuxDataCodec, NetworkAddress=self.NetworkAddress, KVPoll=self.KVPoll,
            List=List, Optional=Optional, Tuple=Tuple)
        mooncake.run([mooncake.method("MooncakeKVManager", m) for m in mooncake_methods], mooncake_ns)
        start_decode = mooncake.method("MooncakeKVManager", "start_decode_thread")
        self._bind_decode_thread = _closure_factory(
            mooncake, _nested_function(start_decode, "decode_thread"), ("self", "recv"), mooncake_ns)

        # class attributes as the classes declare them (MooncakeKVManager over CommonKVManager)
        attrs: Dict[str, Any] = {m: common_ns[m] for m in common_methods}
        attrs.update({m: mooncake_ns[m] for m in mooncake_methods})
        for name in ("kv_status_msg_tag", "kv_status_msg_carries_reason"):
            attrs[name] = common.value(common.class_attr("CommonKVManager", name), common_ns)
        attrs["AUX_DATA_HEADER"] = mooncake.value(
            mooncake.class_attr("MooncakeKVManager", "AUX_DATA_HEADER"), mooncake_ns)
        attrs["__module__"] = mooncake_ns["__name__"]
        self.Manager = type("MooncakeKVManager", (_ManagerState,), attrs)
        mooncake_ns["MooncakeKVManager"] = self.Manager  # the methods name their class
        self.AUX_DATA_HEADER: bytes = attrs["AUX_DATA_HEADER"]
        self.kv_status_msg_tag = attrs["kv_status_msg_tag"]
        self.kv_status_msg_carries_reason = attrs["kv_status_msg_carries_reason"]

    @staticmethod
    def _check_env_defaults(environ: _Source, env_ns: Dict[str, Any]) -> None:
        """The two flags' declarations in Envs are what the stub declares."""
        want = {"SGLANG_ENABLE_DISAGG_SAMPLING_MASK": ("EnvBool", False),
                "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": ("EnvStr", None)}
        for name, (kind, default) in want.items():
            expr = environ.class_attr("Envs", name)
            if not (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name)
                    and expr.func.id == kind and len(expr.args) == 1
                    and environ.value(expr.args[0], env_ns) == default and not expr.keywords):
                raise OracleUnavailable(f"Envs.{name} is not {kind}({default!r}) in {environ.path}")

    # ---- status messages, SGLang's methods on Mooncake's settings ----------------------------
    def encode_status(self, room: int, status: int, prefill_rank: int,
                      reason: Optional[str] = None) -> List[bytes]:
        mgr = self.Manager(AuxKVArgs([], []), ctx=None, prefill_rank=prefill_rank)
        return mgr._encode_kv_status_message(bootstrap_room=room, status=status,
                                             failure_reason=reason)

    def parse_status(self, frames: Sequence[bytes]) -> Optional[Tuple[int, int, int, Optional[str]]]:
        mgr = self.Manager(AuxKVArgs([], []), ctx=None)
        return mgr.parse_kv_status_message(list(frames))

    # ---- the two ends of the aux path ------------------------------------------------------------
    def receiver(self, ctx: zmq.Context, aux_data_ptrs: Sequence[int],
                 aux_item_lens: Sequence[int]) -> "DecodeReceiver":
        return DecodeReceiver(self, ctx, list(aux_data_ptrs), list(aux_item_lens))

    def sender(self, ctx: zmq.Context, aux_data_ptrs: Sequence[int], aux_item_lens: Sequence[int],
               prefill_rank: int = 0) -> "PrefillSender":
        return PrefillSender(self, ctx, list(aux_data_ptrs), list(aux_item_lens), prefill_rank)


class DecodeReceiver:
    """SGLang's decode side: a PULL socket on 127.0.0.1, drained by SGLang's own
    decode_thread loop (AUX_DATA -> _handle_aux_data -> AuxDataCodec writing into
    aux_data_ptrs[field] + aux_item_lens[field] * slot; else parse_kv_status_message ->
    apply_prefill_status, recorded in `statuses`)."""

    def __init__(self, oracle: Oracle, ctx: zmq.Context, ptrs: List[int], item_lens: List[int]):
        self.manager = oracle.Manager(AuxKVArgs(ptrs, item_lens), ctx)
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.host = "127.0.0.1"
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.received: List[List[bytes]] = []
        self._decode_thread = oracle._bind_decode_thread

    @property
    def statuses(self) -> List[Tuple[int, int, int, Optional[str]]]:
        return self.manager.applied

    def run(self, messages: int, timeout: float = 5.0) -> int:
        """Feed up to `messages` received messages through SGLang's decode loop (in this
        thread); returns how many arrived before `timeout` seconds passed."""
        mgr, sock = self.manager, self.socket
        deadline = time.monotonic() + timeout
        count = 0

        def recv():  # what _make_worker_recv hands the loop: poll with a timeout, None when idle
            nonlocal count
            left = deadline - time.monotonic()
            if count >= messages or left <= 0 or not sock.poll(int(left * 1000) + 1):
                mgr._stopped = True
                return None
            count += 1
            msg = sock.recv_multipart()
            self.received.append(msg)
            return msg

        mgr._stopped = False
        self._decode_thread(mgr, recv)()
        return count

    def close(self) -> None:
        self.socket.close(linger=0)
        self.manager.close()


class PrefillSender:
    """SGLang's prefill side of the TCP aux route: send_aux_tcp / send_aux_data_to_endpoint /
    send_kv_status_message over SGLang's _send_multipart_locked (a real ZMQ PUSH socket)."""

    def __init__(self, oracle: Oracle, ctx: zmq.Context, ptrs: List[int], item_lens: List[int],
                 prefill_rank: int):
        self.manager = oracle.Manager(AuxKVArgs(ptrs, item_lens), ctx, prefill_rank)

    def send_aux_tcp(self, host: str, port: int, room: int, src_slot: int, dst_slot: int,
                     dst_aux_ptrs: Sequence[int]) -> int:
        target = TransferTarget(room=room, endpoint=host, dst_port=port, dst_aux_index=dst_slot)
        return self.manager.send_aux_tcp(target, src_slot, list(dst_aux_ptrs))

    def send_status(self, host: str, port: int, room: int, status: int,
                    reason: Optional[str] = None) -> None:
        self.manager.send_kv_status_message(targets=[(host, port)], bootstrap_room=room,
                                            status=status, failure_reason=reason)

    def send_frames(self, host: str, port: int, frames: List[bytes]) -> None:
        self.manager._send_multipart_locked(f"tcp://{host}:{port}", frames, is_ipv6=False)

    def close(self) -> None:
        self.manager.close()


_ORACLE: Optional[Oracle] = None
_ERROR: Optional[OracleUnavailable] = None


def load() -> Oracle:
    """The oracle (built once); OracleUnavailable when sglang 0.5.23's source is not here."""
    global _ORACLE, _ERROR
    if _ORACLE is None and _ERROR is None:
        try:
            _ORACLE = Oracle(package_dir())
        except OracleUnavailable as exc:
            _ERROR = exc
    if _ERROR is not None:
        raise _ERROR
    return _ORACLE


def load_or_skip() -> Oracle:
    """load(), or skip the calling test module with the reason (pytest.importorskip-like)."""
    import pytest

    try:
        return load()
    except OracleUnavailable as exc:
        pytest.skip(f"SGLang oracle unavailable: {exc}", allow_module_level=True)


# ---- the address a side advertises (utils/network.py) ----------------------------------------
def local_ip_rule() -> Callable[..., str]:
    """SGLang 0.5.23's get_local_ip_auto, with get_local_ip_by_nic and get_local_ip_by_remote,
    compiled from the shipped utils/network.py (unchanged) over the real os, socket and
    logging: it reads this process's environment and interfaces, and imports netifaces as
    SGLang does. Raises OracleUnavailable without sglang 0.5.23's source."""
    import os
    import socket

    network = _Source(package_dir(), "srt/utils/network.py")
    ns = network.run([network.top("get_local_ip_by_nic"), network.top("get_local_ip_by_remote"),
                      network.top("get_local_ip_auto")],
                     _namespace("network_rule", os=os, socket=socket, Optional=Optional,
                                logger=_Logger("sglang_oracle.network")))
    return ns["get_local_ip_auto"]


def pool_envs_pr38024() -> Any:
    """The two pool variables as SGLang reads them: SGLANG_MOONCAKE_CUSTOM_MEM_POOL as 0.5.23's
    Envs declares it (EnvStr(None)), and SGLANG_CUSTOM_MEM_POOL as sgl-project/sglang PR #38024
    (open) declares it: EnvStrWithAlias(None, deprecated_name=SGLANG_MOONCAKE_CUSTOM_MEM_POOL),
    with 0.5.23's own EnvField / EnvStr / _DeprecatedEnvFallback / EnvStrWithAlias compiled from
    the shipped environ.py. `.get()` on either reads this process's environment (the alias,
    when taken, is copied to the new name, as SGLang does)."""
    import os
    import warnings
    from contextlib import contextmanager

    environ = _Source(package_dir(), "srt/environ.py")
    ns = environ.run([environ.top(n) for n in ("EnvField", "EnvStr", "_DeprecatedEnvFallback",
                                               "EnvStrWithAlias")],
                     _namespace("environ_alias", os=os, warnings=warnings, Any=Any,
                                contextmanager=contextmanager))
    envs = type("Envs", (), {
        "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": ns["EnvStr"](None),
        "SGLANG_CUSTOM_MEM_POOL": ns["EnvStrWithAlias"](None, deprecated_name="SGLANG_MOONCAKE_CUSTOM_MEM_POOL"),
    })
    return envs()


# ---- what the decode makes of a request at each poll (the gate and the receiver) -------------
class FakeClock:
    """The `time` module the extracted receiver reads: time() is whatever the test sets."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def time(self) -> float:
        return self.now


class _KVManagerState:
    """What CommonKVReceiver._poll reads of its kv_mgr: one request's status, the timeout."""

    def __init__(self, status: int, waiting_timeout: float):
        self.status, self.waiting_timeout = status, waiting_timeout
        self.failures: List[str] = []

    def check_status(self, room: int) -> int:
        return self.status

    def record_failure(self, room: int, reason: str) -> None:
        self.failures.append(reason)

    def update_status(self, room: int, status: int) -> None:
        self.status = status


class ReceiverState:
    """The attributes CommonKVReceiver._poll / _check_waiting_timeout read and write."""

    def __init__(self, status: int, waiting_timeout: float, prefill_wait_start: Optional[float],
                 init_time: Optional[float]):
        self.kv_mgr = _KVManagerState(status, waiting_timeout)
        self.bootstrap_room = 1234
        self.conclude_state = None
        self._prefill_wait_start = prefill_wait_start
        self.init_time = init_time
        self.abort_notified = False
        self.bootstrap_infos = None  # no abort notification to send
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def invalidate_cached_bootstrap_infos(self) -> None:
        pass


@dataclass
class DecodeRules:
    """SGLang 0.5.23's decode-side poll rules, compiled from the shipped source (unchanged):
    `gate` is disaggregation/utils.py:_apply_metadata_gate (polls, decode_reqs, metadata_buffers);
    `poll(receiver)` is common/conn.py CommonKVReceiver._poll (with its _check_waiting_timeout)
    on a ReceiverState, reading `clock` as its `time` module; KVPoll is base/conn.py's."""

    gate: Callable[..., None]
    poll: Callable[[Any], Any]
    KVPoll: Any
    clock: FakeClock


def decode_rules() -> DecodeRules:
    root = package_dir()
    utils = _Source(root, f"{_DISAGG}/utils.py")
    base = _Source(root, f"{_DISAGG}/base/conn.py")
    common = _Source(root, f"{_DISAGG}/common/conn.py")
    kvpoll = base.run([base.top("KVPoll")], _namespace("rules.base.conn"))["KVPoll"]
    gate = utils.run([utils.top("_apply_metadata_gate")], _namespace(
        "rules.utils", KVPoll=kvpoll, _is_fake_transfer=lambda req: False))["_apply_metadata_gate"]
    clock = FakeClock()
    ns = common.run([common.method("CommonKVReceiver", "_poll"),
                     common.method("CommonKVReceiver", "_check_waiting_timeout")],
                    _namespace("rules.common.conn", time=clock, KVPoll=kvpoll, Optional=Optional,
                               logger=_Logger("sglang_oracle.rules")))
    check = ns["_check_waiting_timeout"]
    poll_fn = ns["_poll"]

    def poll(receiver: Any) -> Any:
        receiver._check_waiting_timeout = lambda: check(receiver)
        return poll_fn(receiver)

    return DecodeRules(gate, poll, kvpoll, clock)

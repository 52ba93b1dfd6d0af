"""The schema's vocabulary: the enums a key's values are typed as (users type their member
names; orchestrator.profile.config's sections hold them), the error a user mistake raises
(ConfigError, one line), and the small value rules beside them (a loopback address, a
host:port, the secret's environment variable). It imports nothing of the orchestrator: every
floor (handoff's byte path included) may read it without reading the schema's sections."""

from __future__ import annotations

import ipaddress
import os
import secrets
from enum import Enum
from typing import Any, Mapping, Optional


def is_loopback(host: Optional[str], ipv6: bool = False) -> bool:
    """True for a loopback address: IPv4's 127.0.0.0/8 (every address this tool binds or
    dials is IPv4), with `ipv6` also IPv6's (a listener Mooncake opened); False for anything
    else: None, a host name, "auto", another address."""
    if host is None:
        return False
    try:
        addr = ipaddress.ip_address(host) if ipv6 else ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return addr.is_loopback


class ConfigError(ValueError):
    """A user mistake in the config: rendered as one line, never with a traceback."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={shown(value)} is not allowed: {allowed}.")


SHOWN_ITEMS, SHOWN_CHARS = 8, 200  # what an error line echoes of a long value


def shown(value: Any) -> str:
    """A value as an error line echoes it: a long list as its first few items and its length
    (a 1,999-value list is not printed back in full), a long text cut with its length."""
    if isinstance(value, (list, tuple)) and len(value) > SHOWN_ITEMS:
        head = ", ".join(shown(v) for v in value[:SHOWN_ITEMS])
        return f"[{head}, ... ({len(value):,} values)]"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"


def host_port(text: str) -> Optional[tuple[str, int]]:
    """An IPv4 "HOST:PORT" as (host, port); None for anything else (a host name, no port, port 0)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return None
    return host, int(port)


def secret_from_env(secret_env: str, env: Mapping[str, str]) -> bytes:
    """The secret transport.secret_env names, read from `env`: a set, non-empty variable."""
    value = env.get(secret_env, "")
    if not value:
        raise ConfigError("transport.secret_env", secret_env,
                          "the name of a set, non-empty environment variable holding the secret")
    return value.encode()


def run_secret(secret_env: Optional[str], env: Optional[Mapping[str, str]] = None) -> bytes:
    """The secret of a run: the one transport.secret_env names (read from `env`, else this
    process's environment), or a fresh random one for this run alone."""
    if secret_env is not None:
        return secret_from_env(secret_env, os.environ if env is None else env)
    return secrets.token_bytes(32)


# ---- enums (typed as users type them) ------------------------------------------------------
class MemPoolType(Enum):
    """SGLANG_MOONCAKE_CUSTOM_MEM_POOL values. NONE stands for "no custom pool"."""

    NONE = "NONE"
    NVLINK = "NVLINK"
    BAREX = "BAREX"
    INTRA_NODE_NVLINK = "INTRA_NODE_NVLINK"


class RouteSetting(Enum):
    """transport.route: let the rules decide (auto), or force one route."""

    auto = "auto"
    tcp = "tcp"
    engine = "engine"


class FallbackPolicy(Enum):
    """transport.fallback: stop when the declared path is unavailable, or degrade and log it."""

    strict = "strict"
    degrade = "degrade"


class EngineTransportSetting(Enum):
    """transport.mooncake.transport: which Mooncake transport the engine route should use.

    auto derives it from where the buffers live (CUDA buffers of an INTRA_NODE_NVLINK pool:
    nvlink_intra; host buffers: tcp). rdma is for hosts with an RDMA device.
    """

    auto = "auto"
    tcp = "tcp"
    rdma = "rdma"
    nvlink_intra = "nvlink_intra"


class CompletionSetting(Enum):
    """transport.mooncake.completion: how the transfer thread waits for a batch write.

    spin: Mooncake's batch_transfer_sync_write (what SGLang calls), which busy-polls the
    batch status until it completes; nap: submit asynchronously, sleep `nap_us`, then wait
    for the status. On a small machine the spin takes the core that Mooncake's own transport
    threads need to finish the write. auto: spin with 8 or more cores, nap below.
    """

    auto = "auto"
    spin = "spin"
    nap = "nap"


class StatusMode(Enum):
    """transport.status: how "KV done" travels to decode after a step's sends.

    per_request: SGLang's status message, one per request (an SGLang decode parses it);
    per_step: one message for the whole step (this tool's framing; fewer messages per row).
    """

    per_request = "per_request"
    per_step = "per_step"


class FillMode(Enum):
    """workload.fill: inline runs SGLang's set_buf per request inside the timed loop (what a
    scheduler sustains); ahead fills every slot once before the timed phase, so a request
    then writes only its room and digest (the route alone)."""

    inline = "inline"
    ahead = "ahead"


class SetBufMode(Enum):
    """buffers.set_buf: how a request's row is filled on the prefill. sglang = SGLang 0.5.23's
    set_buf exactly (field by field on the rows' device: on CUDA rows every scalar is a
    kernel and every list a pageable copy, on the scheduler's thread); staged = beyond
    SGLang: the same writes into a pinned host copy of the rows, then one upload of the
    step's rows (host rows: the same as sglang)."""

    sglang = "sglang"
    staged = "staged"


class GateRead(Enum):
    """gate.read: how the decode reads a ready request's bootstrap_room for the readiness
    gate on device rows. sglang = SGLang 0.5.23's `_apply_metadata_gate`: one `.item()` per
    request on the current stream (a device sync each, behind whatever is queued, e.g. the
    next forward); batched = every candidate's room of a poll in one pass with one copy to
    pinned memory (this tool's digest pass, on the current stream); side_stream = that pass
    on a high-priority stream of its own, off the forward's queue. Host rows: all the same."""

    sglang = "sglang"
    batched = "batched"
    side_stream = "side_stream"


# Cores from which `auto` spins (endpoints.poll) and completes by spinning (completion)
SPIN_MIN_CORES = 8


class PollMode(Enum):
    """endpoints.poll: how the endpoints' loops wait for the next message. spin polls without
    sleeping (as SGLang's scheduler loop does; a wake-up costs nothing, a core is busy);
    block sleeps in the poll; auto spins where this process may use >= 8 cores (GPU hosts)
    and blocks elsewhere (a 2-core box; 2 pinned cores or a 2-CPU container quota of a big
    host): its CPU affinity and cgroup quota count, not the host's core count. Where the
    loops block and the engine's batch status can be asked without waiting (both Mooncake
    wheels), the prefill's loop also drives every step's sends itself: steps that overlap are
    not handed to the transfer thread, whose wake-ups cost more than they buy there."""

    auto = "auto"
    spin = "spin"
    block = "block"

    def spins(self, cores: int) -> bool:
        """Whether the loops spin. auto decides by `cores`: the cores this process may use
        (affinity and cgroup quota: platform.usable_cores), never the host's count."""
        if self is not PollMode.auto:
            return self is PollMode.spin
        return cores >= SPIN_MIN_CORES


class BenchPhases(Enum):
    """bench.phases: what `python -m orchestrator.bench` measures. routes = every aux route
    side by side (bench.md); ladder = the cost ladder on the profile's engine route: the
    careful loop climbing to the full run, one component per rung (orchestrator.sweep.ladder,
    ladder.md). `phases=ladder` on the bench's command line is short for bench.phases=ladder."""

    routes = "routes"
    ladder = "ladder"


class MpsMode(Enum):
    """endpoints.mps: CUDA MPS for the run's processes that share a GPU (auto | on | off)."""

    auto = "auto"
    on = "on"
    off = "off"


class DigestKind(Enum):
    """verify.digest: linear = keyed linear digest computed in batch on the device that holds
    the rows (default); blake2b = keyed blake2b per row on the host (host buffers only)."""

    linear = "linear"
    blake2b = "blake2b"


class Role(Enum):
    """role: both sides in one command, or one side of a run split across hosts."""

    both = "both"
    prefill = "prefill"
    decode = "decode"


class FaultKind(Enum):
    """faults.kind: a failure injected on purpose, to show how the run ends (RELIABILITY.md)."""

    none = "none"
    decode_killed = "decode_killed"
    """SIGKILL the decode process after `at_request` handoffs"""
    decode_stopped = "decode_stopped"
    """SIGSTOP it for `duration_s`, then SIGCONT"""
    prefill_killed = "prefill_killed"
    """SIGKILL prefill rank 0 once `at_request` handoffs are done"""
    prefill_stopped = "prefill_stopped"
    """SIGSTOP prefill rank 0 there for `duration_s`, then SIGCONT"""
    silent_control = "silent_control"
    """prefill's control peer accepts TCP and never answers"""
    silent_peer = "silent_peer"
    """the engine session id points at a port that never answers"""
    bad_destination = "bad_destination"
    """one block of the batch aims outside the registration"""
    wrong_session = "wrong_session"
    """the batch goes to a session id nobody serves"""
    stale_room = "stale_room"
    """the room block is not sent; decode keeps stale rooms"""
    corrupt_byte = "corrupt_byte"
    """one byte of the row changes after its digest was taken"""
    status_first = "status_first"
    """decode TP rank `rank`: the status overtakes the aux by margin_us"""
    aux_lost = "aux_lost"
    """from `at_request`, every `every`-th request: the status is delivered, the row never is
    (SGLang 0.5.23's decode would hold such a request in Transferring for ever)"""


class AddressCheck(Enum):
    """transport.address_check: what an unreachable advertised address does in a split run."""

    fail = "fail"
    warn = "warn"
    off = "off"


class HiddenStatesDtype(Enum):
    """buffers.hidden_states_dtype: the dtype of the hidden-states row."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

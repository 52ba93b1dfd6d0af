"""Config schema: the dataclasses Hydra validates every profile and override against.

Everything a user can type lives here, once. The dataclasses are stored in Hydra's
ConfigStore and named first in ``conf/config.yaml``'s defaults list, so Hydra itself rejects
a misspelled key, a value of the wrong type, or an enum value that does not exist (enums are
matched by member NAME, so members are spelled exactly as users type them). What OmegaConf
cannot check (ranges, ports, hosts) sits beside the fields it checks, as each section's
``check()`` method, which raises :class:`ConfigError`: one sentence naming the key, the bad
value and what is allowed. Checks that need more than one section or the machine live in
the rule book, :mod:`orchestrator.profile.rules`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, cast

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

# the schema's vocabulary (enums, ConfigError), defined one floor down and re-exported here
from orchestrator.profile.kinds import SPIN_MIN_CORES as SPIN_MIN_CORES
from orchestrator.profile.kinds import (
    AddressCheck,
    BenchPhases,
    CompletionSetting,
    ConfigError,
    DigestKind,
    EngineTransportSetting,
    FallbackPolicy,
    FaultKind,
    FillMode,
    GateRead,
    HiddenStatesDtype,
    MemPoolType,
    MpsMode,
    PollMode,
    Role,
    RouteSetting,
    SetBufMode,
    StatusMode,
    host_port,
    is_loopback,
)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # conf/config.yaml and its groups


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


def _positive(key: str, value: Any, what: str = "a whole number > 0") -> None:
    _require(value > 0, key, value, what)


MIN_DURATION_S = 0.1  # workload.duration_s: a phase this short may still hand off nothing (a run
# that hands off nothing exits 1 and says so), a shorter one (1e-9) is surely a typo
MAX_WAIT_S = 3600.0  # no wait of the tool is longer: a bigger one is a typo, inf a hang


def _seconds(key: str, value: Any, low: float = 0.0, high: float = MAX_WAIT_S, unit: str = "seconds",
             closed: bool = False) -> None:
    """A finite duration in (low, high] ([low, high] when `closed`)."""
    ok = isinstance(value, (int, float)) and math.isfinite(value) and \
        (value >= low if closed else value > low) and value <= high
    _require(ok, key, value, f"{unit} in {'[' if closed else '('}{low:g}, {high:g}] (finite)")


# ---- sections --------------------------------------------------------------------------------
@dataclass
class MemPoolConfig:
    """mem_pool (conf/mem_pool/*.yaml): the custom memory pool SGLang on Mooncake would use."""

    type: MemPoolType = MemPoolType.NONE
    """SGLANG_MOONCAKE_CUSTOM_MEM_POOL: NONE (no custom pool: host buffers), NVLINK, BAREX or
    INTRA_NODE_NVLINK"""
    description: str = ""
    """what the profile is, in words (e.g. "host buffers, engine route")"""


@dataclass
class FieldConfig:
    """One field of the aux layout (conf/layout/*.yaml)."""

    name: str = "?"
    """the field's name in MetadataBuffers (e.g. output_ids)"""
    dtype: str = "int32"
    """int32, int64, uint64, float32, ... or "hidden" (buffers.hidden_states_dtype)"""
    width: str = "16"
    """a whole number, or the name of a buffers.* key holding the row width"""
    present: str = "always"
    """always | sampling_mask | dsa | kv_checksum (buffers.enable_sampling_mask,
    buffers.output_dsa_topk_indices_dim > 0, buffers.kv_checksum_enabled)"""
    fill: int = 0
    """value of a fresh row (SGLang fills the DSA row with -1)"""
    role: str = ""
    """'room' (bootstrap_room), 'checksum' (kv_checksum) or '' (neither)"""
    get_buf: bool = True
    """part of get_buf()'s tuple (None there when absent)"""


# What a layout field may declare (orchestrator.profile.layout maps the dtype names to torch's)
LAYOUT_DTYPES = ("int8", "uint8", "int16", "int32", "int64", "uint64", "float16", "bfloat16",
                 "float32", "float64")
WIDTH_KEYS = ("hidden_size", "max_top_logprobs_num", "max_sampling_mask_tokens",
              "output_dsa_topk_indices_dim")
PRESENCE = ("always", "sampling_mask", "dsa", "kv_checksum")
ROLES = ("", "room", "checksum")


@dataclass
class LayoutConfig:
    """layout (conf/layout/*.yaml): the aux layout of one SGLang release, one entry per field
    in get_buf_infos() order. A new SGLang release that changes the fields is one new file."""

    name: str = "sglang_0_5_23"
    """the layout's name (its file in conf/layout/)"""
    sglang_version: str = "0.5.23"
    """the SGLang release whose MetadataBuffers this layout matches"""
    fields: List[FieldConfig] = field(default_factory=list)
    """the fields, in get_buf_infos() order"""

    def check(self) -> None:
        """Raise ConfigError for a declaration MetadataBuffers cannot build."""
        key = f"layout ({self.name})"
        if not self.fields:
            raise ConfigError(key, "fields: []", "a list of fields (conf/layout/*.yaml)")
        names = [f.name for f in self.fields]
        for i, f in enumerate(self.fields):
            _check_field(f"layout.fields[{i}] ({f.name})", f)
        if len(set(names)) != len(names):
            raise ConfigError(key, names, "field names that are unique")
        roles = [f.role for f in self.fields if f.role]
        if roles.count("room") != 1 or roles.count("checksum") > 1:
            raise ConfigError(key, roles, "exactly one field with role room (bootstrap_room), at most "
                                          "one with role checksum")
        room = next(f for f in self.fields if f.role == "room")
        if room.present != "always" or room.dtype not in ("uint64", "int64"):
            raise ConfigError(f"layout field {room.name}", room.dtype,
                              "an always-present 64-bit field for the room")


def _check_field(fk: str, f: FieldConfig) -> None:
    if f.dtype != "hidden" and f.dtype not in LAYOUT_DTYPES:
        raise ConfigError(f"{fk}.dtype", f.dtype, f"hidden or one of {', '.join(LAYOUT_DTYPES)}")
    if not (f.width.isdigit() and int(f.width) > 0) and f.width not in WIDTH_KEYS:
        raise ConfigError(f"{fk}.width", f.width, f"a whole number > 0 or one of {', '.join(WIDTH_KEYS)}")
    if f.present not in PRESENCE:
        raise ConfigError(f"{fk}.present", f.present, f"one of {', '.join(PRESENCE)}")
    if f.role not in ROLES:
        raise ConfigError(f"{fk}.role", f.role, "room, checksum or empty")


@dataclass
class BuffersConfig:
    """buffers: the shape of SGLang's MetadataBuffers (the fallback: hidden_size 16 float32,
    1,600 bytes per slot)."""

    size: int = 64
    """slots (rows) per MetadataBuffers"""
    hidden_size: int = 16
    """width of the hidden-states row"""
    hidden_states_dtype: HiddenStatesDtype = HiddenStatesDtype.float32
    """dtype of the hidden-states row (a layout field of dtype "hidden")"""
    max_top_logprobs_num: int = 128
    """width of the two top-logprobs rows"""
    output_dsa_topk_indices_dim: int = 0
    """> 0 adds the DSA top-k field"""
    max_sampling_mask_tokens: int = 256
    """width of the two sampling-mask rows (SGLang 0.5.23's 4th constructor argument)"""
    enable_sampling_mask: bool = False
    """SGLANG_ENABLE_DISAGG_SAMPLING_MASK: three more fields mid-row"""
    kv_checksum_enabled: bool = False
    """the kv_checksum field (SGLang 0.5.23 keyword; the row's digest travels in it)"""
    set_buf: SetBufMode = SetBufMode.sglang
    """sglang: SGLang's set_buf; staged: pinned rows, one upload a step"""

    def check(self) -> None:
        _positive("buffers.size", self.size, "a whole number of slots > 0")
        _positive("buffers.hidden_size", self.hidden_size)
        _positive("buffers.max_top_logprobs_num", self.max_top_logprobs_num)
        _positive("buffers.max_sampling_mask_tokens", self.max_sampling_mask_tokens)
        _require(self.output_dsa_topk_indices_dim >= 0, "buffers.output_dsa_topk_indices_dim",
                 self.output_dsa_topk_indices_dim, "0 (off) or a positive dimension")


@dataclass
class GateConfig:
    """The two halves of SGLang's readiness fix (PR 26394 and its follow-up)."""

    readiness: bool = True
    """downgrade "done" to "transferring" while the slot's room is 0"""
    zero_room_on_free: bool = True
    """zero a freed slot's room (and kv_checksum)"""
    settle_ms: float = 50.0
    """beyond SGLang: with readiness on, a row whose room is right but whose digest is not
    (the room block of a batch write can land before the others) also counts as
    "transferring", for up to this long after its status; 0 = SGLang's room-only gate"""
    read: GateRead = GateRead.batched
    """sglang | batched | side_stream (device rows)"""
    never_landed_s: Optional[float] = None
    """How long a slot is held for a row whose status said done while its room stayed 0;
    then the request fails room_never_landed. null: transport.timeout_s (a slow write is
    never failed early); shorter frees slots sooner when rooms are being zeroed."""

    def check(self) -> None:
        _seconds("gate.settle_ms", self.settle_ms, 0.0, 60_000.0, "milliseconds", closed=True)
        if self.never_landed_s is not None:
            _seconds("gate.never_landed_s", self.never_landed_s, 0.0, 3600.0,
                     "null (transport.timeout_s) or seconds")


@dataclass
class VerifyConfig:
    """verify: how the receiver checks every byte of every row."""

    digest: DigestKind = DigestKind.linear
    """linear: keyed linear digest, computed in batch on the device that holds the rows
    (default); blake2b: keyed blake2b per row on the host (host buffers only)"""


@dataclass
class MooncakeConfig:
    """transport.mooncake: the Mooncake transfer engine of the engine route."""

    metadata_server: str = "P2PHANDSHAKE"
    """P2PHANDSHAKE (no server), http://host:port/metadata (mooncake_http_metadata_server) or
    etcd://host:port"""
    transport: EngineTransportSetting = EngineTransportSetting.auto
    """auto | tcp | rdma | nvlink_intra: the Mooncake transport of the engine route"""
    device_name: str = ""
    """RDMA device list ("" = let Mooncake pick)"""
    tcp_progress_timeout_s: int = 5
    """MC_TCP_PROGRESS_TIMEOUT_SEC: bounds a write to a stopped peer (Mooncake's default is 30 s)."""
    max_blocks_per_batch: int = 1024
    """More blocks than this in one batch write are split (Mooncake's TCP transport failed a
    2,560-block batch)."""
    start_metadata_server: bool = False
    """The runner starts Mooncake's own mooncake_http_metadata_server for an http:// address
    on loopback (single-host runs)."""
    completion: CompletionSetting = CompletionSetting.auto
    """spin (sync write) | nap (async write, sleep, wait) | auto: nap below 8 usable cores"""
    nap_us: float = 50.0
    """completion=nap: sleep this long before waiting for the status"""

    def check(self) -> None:
        ms = self.metadata_server
        forms = "P2PHANDSHAKE, http://HOST:PORT/metadata or etcd://HOST:PORT (lower-case scheme)"
        if ms != "P2PHANDSHAKE":
            # Mooncake matches the scheme case-sensitively (HTTP:// aborts it): spelled exactly
            _require(ms.startswith(("http://", "etcd://")), "transport.mooncake.metadata_server", ms, forms)
            from urllib.parse import urlsplit

            try:
                url = urlsplit(ms)
                port = url.port
            except ValueError:
                url, port = None, None
            ok = (url is not None and url.scheme in ("http", "etcd") and url.hostname and port
                  and (url.scheme != "http" or url.path == "/metadata"))
            _require(bool(ok), "transport.mooncake.metadata_server", ms, forms)
        _positive("transport.mooncake.tcp_progress_timeout_s", self.tcp_progress_timeout_s,
                  "a whole number of seconds > 0")
        _positive("transport.mooncake.max_blocks_per_batch", self.max_blocks_per_batch)
        _require(0 < self.nap_us <= 10_000, "transport.mooncake.nap_us", self.nap_us,
                 "microseconds in (0, 10000]")


@dataclass
class TransportConfig:
    """transport: how the aux rows and the control messages travel between the sides."""

    route: RouteSetting = RouteSetting.auto
    """auto | tcp | engine: let the rules decide (auto), or force one route"""
    fallback: FallbackPolicy = FallbackPolicy.strict
    """strict | degrade: stop when the declared path is unavailable, or degrade and log it"""
    host: str = "127.0.0.1"
    """data and control planes bind here; loopback unless declared"""
    allow_remote: bool = False
    """a non-loopback host must be allowed explicitly"""
    secret_env: Optional[str] = None
    """Name of an environment variable holding a shared secret (multi-host runs). When null,
    each run generates a fresh secret and hands it to its own processes: every message and
    every row digest is authenticated either way."""
    timeout_s: float = 10.0
    """a peer silent this long is declared lost"""
    coalesce: bool = False
    """Grant destination slots in consecutive runs and send a step's rows as one block per
    field per run (tcp route: one AUX_DATA frame per field per run)."""
    status: StatusMode = StatusMode.per_request
    """per_request (SGLang's status message) | per_step (one per step)"""
    max_inflight_sends: int = 16
    """batch writes the transfer thread keeps in flight"""
    max_inflight_blocks: int = 1024
    """blocks (one per field per send) handed to the engine and not finished: Mooncake's TCP
    transport rejects writes past its lane queue ("TCP lane queue-full") and fails them"""
    bootstrap_port: int = 0
    """role=decode: where the bootstrap address listens (0 = any)"""
    bootstrap_file: Optional[str] = None
    """role=decode also writes its bootstrap address to this file; role=prefill without a
    peer waits for the file and reads it (a shared filesystem, e.g. one Slurm sweep dir)"""
    address_check: AddressCheck = AddressCheck.warn
    """Split runs: each side sends at bootstrap the address SGLang 0.5.23 would advertise on
    its host (SGLANG_HOST_IP / HOST_IP, SGLANG_LOCAL_IP_NIC, the default route, the hostname)
    and the peer probes it before any handoff. fail: one it cannot reach ends the run there
    (naming the interface and the variable to set); warn: it is a warning in the summary and
    results.json; off: not probed. This tool's own planes use transport.host either way."""
    mooncake: MooncakeConfig = field(default_factory=MooncakeConfig)
    """the Mooncake transfer engine of the engine route"""

    def check(self) -> None:
        _seconds("transport.timeout_s", self.timeout_s)
        if self.host == "auto":
            _require(self.allow_remote, "transport.host", self.host,
                     "auto (this host's address on its default route) only with "
                     "transport.allow_remote=true")
        else:
            try:
                ipaddress.IPv4Address(self.host)
            except ValueError:
                raise ConfigError("transport.host", self.host,
                                  "an IPv4 address to bind (127.0.0.1 by default), or auto") from None
            _require(is_loopback(self.host) or self.allow_remote, "transport.host", self.host,
                     "a loopback address (127.0.0.0/8), or set transport.allow_remote=true to "
                     "expose the data and control planes on that address")
        _positive("transport.max_inflight_sends", self.max_inflight_sends)
        _positive("transport.max_inflight_blocks", self.max_inflight_blocks)
        _require(0 <= self.bootstrap_port <= 65535, "transport.bootstrap_port",
                 self.bootstrap_port, "0 (any free port) or a TCP port 1-65535")
        self.mooncake.check()


MAX_SEED = (1 << 63) - 1


@dataclass
class WorkloadConfig:
    """workload: the synthetic requests the prefill side hands off."""

    requests: int = 1000
    """per prefill rank"""
    concurrency: int = 8
    """closed loop: requests in flight (arrived, not yet verified)"""
    rate: Optional[float] = None
    """open loop: arrivals per second (per prefill rank); Poisson unless workload.burstiness"""
    batch_size: int = 1
    """requests that finish in one prefill forward step"""
    fill: FillMode = FillMode.inline
    """inline: SGLang's set_buf in the loop | ahead: rows filled before timing"""
    duplicate_rooms: int = 1
    """Requests sharing one bootstrap room: 1 = every room unique, 2 = pairs (client retries),
    n = n-way (n>1 sampling on one room)"""
    return_logprob: bool = True
    """requests carry token logprobs"""
    top_logprobs_num: int = 5
    """top logprobs per request (at most buffers.max_top_logprobs_num)"""
    hidden_states: bool = True
    """requests carry hidden states"""
    sampling_mask: bool = False
    """requests carry sampling masks (needs buffers.enable_sampling_mask)"""
    multimodal: bool = False
    """requests carry image/audio/video token counts"""
    dsa_indices: bool = True
    """speculative requests carry DSA top-k indices (when the field exists)"""
    seed: Optional[int] = None
    """Rooms and synthetic content derive from it. null: every run draws its own (so rooms
    differ between runs), records it in fingerprint.json, and replay reuses it; a pinned
    seed repeats its rooms."""
    duration_s: Optional[float] = None
    """Seconds the handoff phase runs for, instead of a request count (null: workload.requests);
    at least 0.1 (a run that still hands off nothing exits 1 and says why). Arrivals stop once
    the phase (start-up excluded) has run this long; what arrived is finished and is the run's
    count. Workload.requests stays each rank's ceiling (request ids are per rank): a rank that
    reaches it first stops there and the summary warns; raise it for long runs. An open loop
    draws its seeded arrival schedule up to duration_s."""
    burstiness: float = 1.0
    """Open loop: the gamma shape of the gaps between arrivals, as vLLM's --burstiness (1 =
    Poisson, below 1 burstier, above 1 more even). The mean rate stays workload.rate; the gaps
    are seeded per rank (workload.seed), so a replay draws the same arrivals."""

    def check(self, buffers: BuffersConfig) -> None:
        _positive("workload.requests", self.requests,
                  "a whole number > 0 (requests per prefill rank)")
        _positive("workload.concurrency", self.concurrency)
        if self.rate is not None:
            _seconds("workload.rate", self.rate, 0.0, 1e9, "null (closed loop) or requests per second")
        _positive("workload.batch_size", self.batch_size)
        _require(self.batch_size <= buffers.size, "workload.batch_size", self.batch_size,
                 f"at most buffers.size ({buffers.size}) requests per step")
        _positive("workload.duplicate_rooms", self.duplicate_rooms,
                  "1 (unique rooms), 2 (pairs) or n > 2 requests per room")
        _require(0 <= self.top_logprobs_num <= buffers.max_top_logprobs_num,
                 "workload.top_logprobs_num", self.top_logprobs_num,
                 f"0..buffers.max_top_logprobs_num ({buffers.max_top_logprobs_num})")
        _require(not self.sampling_mask or buffers.enable_sampling_mask, "workload.sampling_mask",
                 self.sampling_mask, "false unless buffers.enable_sampling_mask=true")
        _require(self.seed is None or 0 <= self.seed <= MAX_SEED, "workload.seed", self.seed,
                 f"null (drawn per run) or a whole number in 0..{MAX_SEED}")
        if self.duration_s is not None:
            _seconds("workload.duration_s", self.duration_s, high=7 * 24 * 3600.0,
                     unit="null (run workload.requests) or seconds")
            _require(self.duration_s >= MIN_DURATION_S, "workload.duration_s", self.duration_s,
                     f"at least {MIN_DURATION_S:g} s (a shorter phase can end before its first request "
                     "arrives), or null to run workload.requests")
        _require(isinstance(self.burstiness, (int, float)) and math.isfinite(self.burstiness)
                 and 0 < self.burstiness <= 1000, "workload.burstiness", self.burstiness,
                 "a gamma shape in (0, 1000]: 1 = Poisson, < 1 burstier, > 1 more even")
        _require(self.burstiness == 1 or self.rate is not None, "workload.burstiness", self.burstiness,
                 "1 unless workload.rate is set (burstiness shapes an open loop's arrivals)")


@dataclass
class DecodeLoadConfig:
    """endpoints.decode_load: a decode that decodes. step_ms > 0 runs a synthetic forward loop
    on each decode GPU (a CUDA graph of bf16 matmuls taking about step_ms), queued before
    every poll as SGLang's overlap scheduler queues its next forward; CUDA rows only (on host
    rows it is off, with a warning)."""

    step_ms: float = 0.0
    """0 = off; e.g. 8: a CUDA graph of matmuls taking ~8 ms, queued before every poll"""
    idle_s: float = 1.0
    """forward steps/s measured this long without handoffs, at start-up"""

    def check(self) -> None:
        _require(math.isfinite(self.step_ms) and 0 <= self.step_ms <= 1000, "endpoints.decode_load.step_ms",
                 self.step_ms, "0 (off) or milliseconds per forward step up to 1000")
        _require(math.isfinite(self.idle_s) and 0 <= self.idle_s <= 60, "endpoints.decode_load.idle_s",
                 self.idle_s, "seconds in 0..60")


@dataclass
class EndpointsConfig:
    """endpoints: the processes of a run, and where they run."""

    prefill_ranks: int = 1
    """How many prefill processes; every prefill rank hands off to every decode instance
    (round-robin over its requests). workload.requests is per prefill rank."""
    decode_ranks: int = 1
    """How many decode instances."""
    decode_tp: int = 1
    """Ranks of one decode instance (a tensor-parallel group: each rank has its own buffers
    and engine and receives every request's aux; the ranks all-reduce their poll status)."""
    prefill_gpus: Optional[List[int]] = None
    """CUDA device of each prefill rank when buffers live on CUDA (one entry per prefill
    rank); null = auto: prefill ranks on the first GPUs, wrapping around when there are fewer
    GPUs."""
    decode_gpus: Optional[List[int]] = None
    """CUDA device of each decode process when buffers live on CUDA (one entry per decode
    process = decode_ranks x decode_tp); null = auto: decode processes on the GPUs after the
    prefill ranks', wrapping around when there are fewer GPUs."""
    startup_timeout_s: float = 60.0
    """how long a side waits for its processes and its peer to start up"""
    poll: PollMode = PollMode.auto
    """spin | block | auto (spin where this process may use >= 8 cores: affinity and cgroup quota).
    block: the prefill's loop also sends every step itself (no transfer-thread hand-over) where the
    engine's batch status can be asked without waiting (both Mooncake wheels)"""
    mps: MpsMode = MpsMode.auto
    """CUDA MPS for processes of this run that share a GPU. Without it they time-slice the GPU:
    each device touch of one costs a context switch of the other (about 300-400 us on an
    H200), and a one-GPU run measures that instead of the transport. auto: where two of the
    run's processes map to one GPU, join the MPS daemon the user started
    (CUDA_MPS_PIPE_DIRECTORY set), else start one of the run's own when nvidia-cuda-mps-control
    is on PATH (pipe and log dirs in the run dir; stopped at the end, on failure, on an
    interrupt, and by a reaper when the runner itself is killed). on: the same for every GPU
    process, and refused (exit 2) where MPS cannot be had. off: never starts one. No device
    setting (compute mode included) is ever changed. The machine's side of the check is the
    rule book's (profile.sharing)."""
    decode_load: DecodeLoadConfig = field(default_factory=DecodeLoadConfig)
    """a decode that decodes: a synthetic forward loop on each decode GPU (CUDA rows)"""

    @property
    def decode_procs(self) -> int:
        return self.decode_ranks * self.decode_tp

    def check(self) -> None:
        _positive("endpoints.prefill_ranks", self.prefill_ranks, "a whole number of processes > 0")
        _positive("endpoints.decode_ranks", self.decode_ranks, "a whole number of instances > 0")
        _positive("endpoints.decode_tp", self.decode_tp, "a whole number of ranks > 0")
        _seconds("endpoints.startup_timeout_s", self.startup_timeout_s)
        for role, n in (("prefill", self.prefill_ranks), ("decode", self.decode_procs)):
            key = f"endpoints.{role}_gpus"
            gpus = getattr(self, key.split(".")[1])
            _require(gpus is None or (len(gpus) == n and min(gpus) >= 0), key, gpus,
                     f"null (auto) or {n} CUDA device indices >= 0, one per {role} process")
        self.decode_load.check()


@dataclass
class FaultsConfig:
    """faults (conf/faults/*.yaml): a failure injected on purpose, to show how the run ends
    (RELIABILITY.md)."""

    kind: FaultKind = FaultKind.none
    """which failure (none: a clean run)"""
    at_request: int = 50
    """first request (or handoff count) the fault hits"""
    every: int = 10
    """per-request faults: then every Nth request"""
    duration_s: float = 2.0
    """decode_stopped: how long the process stays stopped"""
    margin_us: float = 20000.0
    """status_first: how far the status runs ahead of the aux at most (the aux goes as soon as
    its request's verdict is back: without the gate, after the decode took the row unready)"""
    rank: int = 1
    """status_first: the decode TP rank whose aux is delayed"""

    def check(self) -> None:
        _require(self.at_request >= 0 and self.every > 0 and self.duration_s > 0
                 and self.margin_us >= 0 and self.rank >= 0, "faults",
                 f"at_request={self.at_request} every={self.every} duration_s={self.duration_s} "
                 f"margin_us={self.margin_us} rank={self.rank}",
                 "at_request >= 0, every > 0, duration_s > 0, margin_us >= 0, rank >= 0")
        _seconds("faults.duration_s", self.duration_s)
        _seconds("faults.margin_us", self.margin_us, 0.0, 60e6, "microseconds", closed=True)


LADDER_ROWS = ("R0", "R1", "R2", "R3", "R4", "R5", "R6", "R7", "yardstick")  # bench.ladder_rungs' names


@dataclass
class BenchConfig:
    """python -m orchestrator.bench: sizes of the measurement (ignored by plain runs)."""

    iters: int = 2000
    """send_aux vs raw batch writes, each, per engine path"""
    handoffs: int = 500
    """one-in-flight handoffs per path"""
    requests: int = 4000
    """per throughput row but the batched and coalesced ones (bench.batched_requests)"""
    batched_requests: int = 32000
    """per batched and coalesced row: they move about 10x the per-request rate, so at
    bench.requests they would end within their first ~0.1 s, mostly ramp (on the 2-core box,
    coalesced b64 read 27,937/s over 4,000 requests and 48,605/s over 32,000)"""
    batch_size: int = 64
    """the batched and coalesced rows"""
    bulk_mib: int = 64
    """one-block bandwidth point per engine path (0 = skip)"""
    bulk_reps: int = 20
    """repetitions of each bulk_mib point"""
    phases: BenchPhases = BenchPhases.routes
    """routes | ladder (see BenchPhases)"""
    ladder_handoffs: int = 2000
    """phases=ladder: timed handoffs per rung and round (one in flight; 50 untimed first)"""
    ladder_rounds: int = 5
    """phases=ladder: rounds, each running every rung once (R0..R7, the yardstick), interleaved"""
    ladder_rungs: Optional[List[str]] = None
    """phases=ladder: the rows a round runs, of R0..R7 and yardstick (e.g. [R7,yardstick]: more
    rounds of the goal's pair in the same time); null: every row. The rest are listed, not run."""
    yardstick: Optional[str] = None
    """phases=ladder: the reference loop handoff_yardstick.py, run in every round as the row
    `yardstick`. null: ../shared/tools/handoff_yardstick.py, else .whl/handoff_yardstick.py
    (from the working directory); none found: the row says so. "off": no yardstick row."""

    def check(self) -> None:
        for key in ("iters", "handoffs", "requests", "batched_requests", "batch_size", "bulk_reps", "ladder_handoffs",
                    "ladder_rounds"):
            _positive(f"bench.{key}", getattr(self, key))
        _require(self.bulk_mib >= 0, "bench.bulk_mib", self.bulk_mib, "0 (skip) or MiB > 0")
        if self.ladder_rungs is not None:
            _require(bool(self.ladder_rungs) and all(r in LADDER_ROWS for r in self.ladder_rungs),
                     "bench.ladder_rungs", self.ladder_rungs, f"null or a non-empty list of {', '.join(LADDER_ROWS)}")


MAX_PERCENTILES = 12


@dataclass
class ReportConfig:
    """report: what a run's report holds beyond its fixed numbers."""

    percentiles: List[float] = field(default_factory=lambda: [50.0, 90.0, 99.0, 99.9])
    """Latency percentiles reported with the mean and the max, besides p50/p99/p999 (always).
    They go to results.json (each latency's `percentiles`), summary.csv (`<metric>_p<q>_us`)
    and latency.png's marks. Each in (0, 100], ascending, at most 12."""

    def check(self) -> None:
        qs = list(self.percentiles)
        _require(0 < len(qs) <= MAX_PERCENTILES and all(0 < q <= 100 for q in qs)
                 and all(a < b for a, b in zip(qs, qs[1:])), "report.percentiles",
                 qs, f"1 to {MAX_PERCENTILES} percentiles in (0, 100], ascending, e.g. [50,90,99,99.9]")


@dataclass
class LoggingConfig:
    """logging: where the structured log lines go (always to the run dir)."""

    console: bool = False
    """Also print the structured log lines (JSON in the run dir's *.log files) on the console,
    rendered by structlog. False (default): the console holds the summary and one `warning:`
    line per warning (repeated ones counted on one line after the run: `19 handoffs rejected
    (room_never_landed): see decode.log`); the run dir keeps every line either way."""
    progress: Optional[bool] = None
    """The live progress line on stderr (phase, verified/failed so far, rate): null, true, false.
    Null draws it in place when stderr is a terminal; where it is not (CI, a pipe, a file) it
    writes a line every progress_every_s only with logging.console=true. True: always (those
    lines where stderr is not a terminal); false: never."""
    progress_every_s: float = 5.0
    """Seconds between two progress lines where stderr is not a terminal."""

    def check(self) -> None:
        _seconds("logging.progress_every_s", self.progress_every_s, 0.0, MAX_WAIT_S)


@dataclass
class OrchestratorConfig:
    """The whole config (conf/config.yaml): one section per config group, and the run's role."""

    mem_pool: MemPoolConfig = field(default_factory=MemPoolConfig)
    """the custom memory pool (conf/mem_pool/)"""
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    """the aux layout of one SGLang release (conf/layout/)"""
    buffers: BuffersConfig = field(default_factory=BuffersConfig)
    """the shape of MetadataBuffers"""
    gate: GateConfig = field(default_factory=GateConfig)
    """the decode's readiness gate"""
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    """how every row is checked"""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """routes, addresses, secret and the Mooncake engine"""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """the synthetic requests"""
    endpoints: EndpointsConfig = field(default_factory=EndpointsConfig)
    """the processes and their GPUs"""
    bench: BenchConfig = field(default_factory=BenchConfig)
    """python -m orchestrator.bench's sizes"""
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    """a failure injected on purpose (conf/faults/)"""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """where the structured log lines go"""
    report: ReportConfig = field(default_factory=ReportConfig)
    """the report's chosen latency percentiles"""
    role: Role = Role.both
    """both | prefill | decode (one side of a run across hosts)"""
    peer: Optional[str] = None
    """role=prefill: the decode side's bootstrap address HOST:PORT"""

    def check(self) -> None:
        """Every section's own checks (ranges and forms), in a stable order."""
        self.layout.check()
        self.buffers.check()
        self.transport.check()
        self.workload.check(self.buffers)
        self.endpoints.check()
        self.faults.check()
        self.gate.check()
        self.bench.check()
        self.report.check()
        self.logging.check()
        if self.role is Role.prefill:
            _require((self.peer is not None and host_port(self.peer) is not None)
                     or (self.peer is None and self.transport.bootstrap_file is not None), "peer",
                     self.peer, "the decode side's bootstrap address HOST:PORT (it prints it), "
                     "or null with transport.bootstrap_file naming the file the decode side writes")
        else:
            _require(self.peer is None, "peer", self.peer, "null unless role=prefill")



def with_seed(workload: WorkloadConfig) -> WorkloadConfig:
    """workload.seed=null: a copy of the section with this run's seed drawn; a pinned seed
    gives the section itself."""
    if workload.seed is not None:
        return workload
    return dataclasses.replace(workload, seed=draw_seed())


def draw_seed() -> int:
    """A run's own seed, for workload.seed=null."""
    import secrets

    return secrets.randbelow(MAX_SEED + 1)


def with_host(transport: TransportConfig) -> TransportConfig:
    """transport.host=auto with transport.allow_remote=true: a copy of the section with this
    host's IPv4 address on its default route (no packet sent). Anything else gives the section
    itself (auto without allow_remote is refused by its check)."""
    if transport.host != "auto" or not transport.allow_remote:
        return transport
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the outgoing interface
            host = s.getsockname()[0]
        except OSError:
            raise ConfigError("transport.host", "auto", "an explicit IPv4 address: this host has "
                                                         "no default route to pick one from") from None
    return dataclasses.replace(transport, host=host)


def resolved(cfg: OrchestratorConfig) -> OrchestratorConfig:
    """A new config with transport.host=auto and workload.seed=null resolved (with_host,
    with_seed); `cfg` itself is not changed. Done before the checks, so the checked config is
    the one that runs."""
    return dataclasses.replace(cfg, transport=with_host(cfg.transport), workload=with_seed(cfg.workload))


_SCHEMAS = {c.__name__: c for c in (MemPoolConfig, FieldConfig, LayoutConfig, BuffersConfig,
                                    GateConfig, VerifyConfig, MooncakeConfig, TransportConfig,
                                    WorkloadConfig, EndpointsConfig, BenchConfig, FaultsConfig,
                                    LoggingConfig, ReportConfig, OrchestratorConfig)}


def register_configs() -> None:
    """Store the schema; conf/config.yaml names it first in its defaults list."""
    ConfigStore.instance().store(name="orchestrator_schema", node=OrchestratorConfig)


def _unknown_key(node: Any, schema: type, prefix: str = "") -> Optional[str]:
    """First key of `node` that the dataclass `schema` does not declare (Hydra lets
    `+group.key=value` through on structured nodes)."""
    declared = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        if key not in declared:
            return f"{prefix}{key}"
        ftype = declared[key].type
        sub = _SCHEMAS.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
        if sub is not None and isinstance(node[key], DictConfig):
            found = _unknown_key(node[key], sub, f"{prefix}{key}.")
            if found:
                return found
    return None


def typed(cfg: DictConfig | OrchestratorConfig) -> OrchestratorConfig:
    """The typed config object of any config source (a composed DictConfig, a saved run's
    plain YAML, or an object already). Raises ConfigError for keys or values the schema
    does not take."""
    if isinstance(cfg, OrchestratorConfig):
        return cfg
    unknown = _unknown_key(cfg, OrchestratorConfig)
    if unknown:
        raise ConfigError(unknown, OmegaConf.select(cfg, unknown),
                          "no such key in the schema (see conf/ or --cfg job)")
    try:  # typed even when the source was a plain YAML (a saved run's config)
        merged = OmegaConf.merge(OmegaConf.structured(OrchestratorConfig), cfg)
    except ValidationError as exc:
        key = str(exc.full_key)
        raise ConfigError(key, OmegaConf.select(cfg, key, default=None),
                          cast(str, exc.msg).split("\n")[0]) from None
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def validate(cfg: DictConfig | OrchestratorConfig, resolve: bool = False) -> OrchestratorConfig:
    """The typed config, with every section's range and form checks passed: the one place
    they run. With `resolve`, host and seed are resolved first (:func:`resolved`), so what
    was checked is what runs; nothing changes the config after this.

    Raises ConfigError for the first problem found (one actionable sentence). Whether the
    profile can run on a given machine is the rule book's question (orchestrator.profile.rules),
    which takes the config this returns.
    """
    obj = typed(cfg)
    if resolve:
        obj = resolved(obj)
    obj.check()
    return obj

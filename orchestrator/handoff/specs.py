"""What an endpoint process reads, as frozen values: the specs that cross into a child.

The job builds them once from the checked config and its plan (orchestrator.job.specs, the
only place that reads the config for them) and hands each child its own: a prefill rank a
`PrefillSpec`, a decode process a `DecodeSpec`. Each holds exactly what its component reads,
flat or in a small sub-spec: the buffers' shape and layout and the engine's address
(`SideSpec`, with its `EngineSpec`), the synthetic requests and the configured phase
(`WorkloadSpec`), the readiness gate (`GateSpec`), the injected fault (`FaultSpec`). One spec
here stays in the runner: a split run's bootstrap (`BootstrapSpec`,
orchestrator.handoff.transport.bootstrap). A sub-spec's fields keep their config keys' names
and types (what a value is and where a user sets it is one grep away); an endpoint
spec's own fields name their key in a comment.

No torch here: the runner builds and pickles these without the endpoints' imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orchestrator.profile.kinds import (
    AddressCheck,
    DigestKind,
    FaultKind,
    FillMode,
    GateRead,
    HiddenStatesDtype,
    PollMode,
    SetBufMode,
    StatusMode,
)
from orchestrator.profile.plan import Plan


@dataclass(frozen=True)
class LayoutField:
    """One declared field of the aux layout (layout.fields[i]; profile.layout reads it)."""

    name: str
    dtype: str
    width: str
    present: str
    fill: int
    role: str
    get_buf: bool


@dataclass(frozen=True)
class LayoutSpec:
    """The aux layout MetadataBuffers follows (layout: its name and its fields, in order)."""

    name: str
    fields: tuple[LayoutField, ...]


@dataclass(frozen=True)
class BufferSpec:
    """The shape of a process's MetadataBuffers (buffers.*, set_buf aside)."""

    size: int
    hidden_size: int
    hidden_states_dtype: HiddenStatesDtype
    max_top_logprobs_num: int
    output_dsa_topk_indices_dim: int
    max_sampling_mask_tokens: int
    enable_sampling_mask: bool
    kv_checksum_enabled: bool


@dataclass(frozen=True)
class EngineSpec:
    """What the engine route's backend reads of the transport section: transport.host and
    transport.mooncake's metadata_server, device_name and max_blocks_per_batch."""

    host: str
    metadata_server: str
    device_name: str
    max_blocks_per_batch: int


@dataclass(frozen=True)
class SideSpec:
    """What endpoints.common.build_side reads: the buffers and their layout, and the engine
    route's engine (the tcp route reads no more)."""

    buffers: BufferSpec
    layout: LayoutSpec
    engine: EngineSpec


@dataclass(frozen=True)
class WorkloadSpec:
    """workload.*: the synthetic requests (content and rooms: handoff.workload) and the
    configured phase (how many, how fast: endpoints.prefill_loop.PhaseSpec.of)."""

    requests: int
    concurrency: int
    rate: Optional[float]
    batch_size: int
    fill: FillMode
    duplicate_rooms: int
    return_logprob: bool
    top_logprobs_num: int
    hidden_states: bool
    sampling_mask: bool
    multimodal: bool
    dsa_indices: bool
    seed: Optional[int]
    duration_s: Optional[float]
    burstiness: float


@dataclass(frozen=True)
class GateSpec:
    """gate.*: the decode's readiness gate."""

    readiness: bool
    zero_room_on_free: bool
    settle_ms: float
    read: GateRead
    never_landed_s: Optional[float]


@dataclass(frozen=True)
class FaultSpec:
    """faults.*, as the endpoints' hooks read them (faults.duration_s is the runner's)."""

    kind: FaultKind
    at_request: int
    every: int
    margin_us: float
    rank: int


@dataclass(frozen=True)
class PrefillSpec:
    """What every prefill rank reads (its rank is its own argument)."""

    plan: Plan
    ranks: int  # endpoints.prefill_ranks: names this rank's process and files
    side: SideSpec
    workload: WorkloadSpec
    faults: FaultSpec
    digest: DigestKind  # verify.digest
    poll: PollMode  # endpoints.poll
    timeout_s: float  # transport.timeout_s
    coalesce: bool  # transport.coalesce
    status: StatusMode  # transport.status
    set_buf: SetBufMode  # buffers.set_buf
    max_inflight_sends: int  # transport.max_inflight_sends
    max_inflight_blocks: int  # transport.max_inflight_blocks
    nap_us: float  # transport.mooncake.nap_us
    address_check: AddressCheck  # transport.address_check
    max_batch: int  # the largest step a phase takes: workload.batch_size, or bench.batch_size
    console: bool  # logging.console


@dataclass(frozen=True)
class DecodeLoadSpec:
    """endpoints.decode_load, and the GPUs its forward loop may take on host rows."""

    step_ms: float
    idle_s: float
    gpus: tuple[int, ...]  # endpoints.decode_gpus, or (0,) when null


@dataclass(frozen=True)
class DecodeSpec:
    """What every decode process reads (its instance and TP rank are its own arguments)."""

    plan: Plan
    ranks: int  # endpoints.decode_ranks
    tp: int  # endpoints.decode_tp
    side: SideSpec
    gate: GateSpec
    faults: FaultSpec
    load: DecodeLoadSpec
    digest: DigestKind  # verify.digest
    poll: PollMode  # endpoints.poll
    host: str  # transport.host: where its control and data sockets listen
    timeout_s: float  # transport.timeout_s
    startup_timeout_s: float  # endpoints.startup_timeout_s
    watch_prefills: bool  # role=decode: the leader watches the prefills (the runner cannot)
    console: bool  # logging.console


@dataclass(frozen=True)
class BootstrapSpec:
    """What a split run's bootstrap reads (the runner's own, never a child's): where the decode
    side listens and tells its address, what the prefill side asks, and both sides' peer
    checks (orchestrator.handoff.transport.bootstrap and peercheck). The run's secret is
    handed beside it, never in it."""

    host: str  # transport.host: where the bootstrap listens; the address SGLang would advertise
    bootstrap_port: int  # transport.bootstrap_port (0: any free one)
    bootstrap_file: Optional[str]  # transport.bootstrap_file
    secret_env: Optional[str]  # transport.secret_env: named when the two sides' secrets differ
    timeout_s: float  # transport.timeout_s: bounds the address probe
    address_check: AddressCheck  # transport.address_check
    prefill_ranks: int  # endpoints.prefill_ranks
    startup_timeout_s: float  # endpoints.startup_timeout_s
    layout: str  # layout.name: a peer check
    peer: Optional[str]  # role=prefill: the decode side's address (None: transport.bootstrap_file's)

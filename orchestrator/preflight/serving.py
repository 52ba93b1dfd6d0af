"""The environment a serving engine (SGLang on Mooncake) needs to reproduce a plan. Pure.

:func:`serving_env` maps a :class:`~orchestrator.profile.plan.Plan` to environment variables: a
string means "export this value", ``None`` means "must be unset" (Mooncake tests MC_*
variables for PRESENCE only, so leaving one in the shell with any value, even ``0``, turns
its feature on). ``python -m orchestrator.export_env`` prints the mapping as shell lines or
JSON.

The variables:

``SGLANG_MOONCAKE_CUSTOM_MEM_POOL``
    SGLang's pool type: ``NVLINK``, ``BAREX`` or ``INTRA_NODE_NVLINK``. It decides where
    SGLang puts ``MetadataBuffers`` (INTRA_NODE_NVLINK: CUDA; the others: host) and, for
    ``NVLINK``, that ``send_aux`` takes the tcp route. Unset (``None``) for ``mem_pool=NONE``
    and for a plan that degraded INTRA_NODE_NVLINK to host buffers
    (``transport.fallback=degrade`` without CUDA): SGLang has no fallback of its own, so the
    way to get host buffers and engine writes out of it is to name no pool.

``SGLANG_MOONCAKE_SEND_AUX_TCP``
    ``"1"`` when the plan's route is tcp because ``transport.route=tcp`` forced it
    (``plan.route_reason is Reason.route_forced_tcp``): SGLang only takes the tcp route by
    itself for the NVLINK pool, so a forced tcp route must be asked for. ``None`` otherwise:
    the NVLINK pool already routes over tcp, and every other plan wants the engine route.
    (SGLang 0.5.23 parses it as a boolean: ``1/true/yes/y`` on, ``0/false/no/n`` off; unset
    is simply the unambiguous spelling of off.)

``MOONCAKE_PROTOCOL``
    The protocol string handed to the engine's ``initialize``: the plan's engine transport
    (``tcp``, ``rdma`` or ``nvlink_intra``); ``"tcp"`` for a tcp-route plan, which starts no
    engine for aux. Mooncake does not choose its transport from this string (see MC_* below);
    it is exported so the serving engine records the same protocol as our runs.

``MC_FORCE_TCP``, ``MC_INTRANODE_NVLINK``, ``MC_FORCE_MNNVL``, ``MC_FORCE_HCA``, ``MC_TCP_PROGRESS_TIMEOUT_SEC``
    Exactly ``plan.mc_env``: the variables that make Mooncake bring up the planned transport
    at initialize time (``MC_FORCE_TCP`` -> TCP, ``MC_INTRANODE_NVLINK`` -> intra-node
    NVLink, neither -> RDMA if an HCA is found, else TCP), each set or unset so nothing
    inherited from the shell leaks in; ``MC_TCP_PROGRESS_TIMEOUT_SEC`` bounds a write to a
    stopped peer. A tcp-route plan has no engine, so its ``mc_env`` is empty and no MC_*
    variable is named.

:func:`profile_from_env` is the reverse: the profile (as overrides of ``python -m
orchestrator``) that an environment implies, each variable read as SGLang 0.5.23 and Mooncake
read it. ``serving_env(plan)`` read back plans to the same plan (tests/test_env_import.py).
"""

from __future__ import annotations

from typing import Mapping, Optional

from orchestrator.profile.config import ConfigError, MemPoolType
from orchestrator.profile.plan import Device, EngineTransport, Plan, Reason

POOL_VAR = "SGLANG_MOONCAKE_CUSTOM_MEM_POOL"
# sgl-project/sglang PR #38024 (open, a preview): the backend-neutral name, which reads POOL_VAR
# as a deprecated alias when it is unset itself. SGLang 0.5.23 reads POOL_VAR only.
NEW_POOL_VAR = "SGLANG_CUSTOM_MEM_POOL"
SEND_AUX_TCP_VAR = "SGLANG_MOONCAKE_SEND_AUX_TCP"
PROTOCOL_VAR = "MOONCAKE_PROTOCOL"
SAMPLING_MASK_VAR = "SGLANG_ENABLE_DISAGG_SAMPLING_MASK"
TIMEOUT_VAR = "MC_TCP_PROGRESS_TIMEOUT_SEC"
MOONCAKE_TCP_TIMEOUT_DEFAULT_S = 30  # Mooncake's own, when MC_TCP_PROGRESS_TIMEOUT_SEC is unset
SGLANG_POOLS = ("NVLINK", "BAREX", "INTRA_NODE_NVLINK")  # SUPPORTED_MOONCAKE_CUSTOM_MEM_POOL_TYPES


def serving_env(plan: Plan) -> dict[str, Optional[str]]:
    """The variables a serving engine needs for `plan`: value to export, or None to unset."""
    pool: Optional[str] = plan.mem_pool.value
    if plan.mem_pool is MemPoolType.NONE:
        pool = None
    elif plan.mem_pool is MemPoolType.INTRA_NODE_NVLINK and plan.buffer_device is not Device.cuda:
        pool = None  # degraded to host buffers: SGLang gets that by naming no pool
    env: dict[str, Optional[str]] = {
        POOL_VAR: pool,
        SEND_AUX_TCP_VAR: "1" if plan.route_reason is Reason.route_forced_tcp else None,
        PROTOCOL_VAR: plan.engine_transport.value if plan.engine_transport is not None else "tcp",
    }
    env.update(plan.mc_env)
    return env


def pool_value(env: Mapping[str, str], pr38024: bool = False) -> Optional[str]:
    """The raw pool value SGLang reads: 0.5.23 reads SGLANG_MOONCAKE_CUSTOM_MEM_POOL only; with
    PR #38024 (EnvStrWithAlias), SGLANG_CUSTOM_MEM_POOL, else the old name (a DeprecationWarning)."""
    if pr38024 and env.get(NEW_POOL_VAR) is not None:
        return env[NEW_POOL_VAR]
    return env.get(POOL_VAR)


def sglang_bool(value: Optional[str]) -> Optional[bool]:
    """SGLang's EnvBool: None when unset or unparsable (SGLang then warns and uses False)."""
    if value is None:
        return None
    v = value.lower()
    return True if v in ("true", "1", "yes", "y") else False if v in ("false", "0", "no", "n") else None


def profile_from_env(env: Mapping[str, str]) -> dict[str, str]:
    """The profile `env` implies, as {override key: value} (``key=value`` overrides for
    ``python -m orchestrator``), each variable read the way SGLang 0.5.23 and Mooncake read it:

    - ``SGLANG_MOONCAKE_CUSTOM_MEM_POOL``: ``true`` (any case) means NVLINK; NVLINK, BAREX,
      INTRA_NODE_NVLINK exactly (case-sensitive); unset or anything else is no pool (NONE);
    - ``SGLANG_MOONCAKE_SEND_AUX_TCP`` (a boolean for SGLang) on forces the tcp route;
    - the engine transport by PRESENCE, in Mooncake's order: ``MC_FORCE_TCP`` -> tcp, else
      ``MC_INTRANODE_NVLINK`` -> nvlink_intra, else rdma (Mooncake's auto-discovery: RDMA where
      the node has an HCA, TCP where it has none). ``MOONCAKE_PROTOCOL`` does not choose it;
    - ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (Mooncake's default, 30 s, when unset);
    - ``SGLANG_ENABLE_DISAGG_SAMPLING_MASK`` (a boolean): the three sampling-mask aux fields.

    Every key is named, so the overrides mean the same on top of any other profile. Raises
    ConfigError (the variable, its value, what is allowed) for a value no profile can express.
    """
    raw_pool = pool_value(env)
    pool = MemPoolType.NONE
    if raw_pool is not None and raw_pool.lower() == "true":
        pool = MemPoolType.NVLINK
    elif raw_pool in SGLANG_POOLS:
        pool = MemPoolType(raw_pool)
    forced_tcp = bool(sglang_bool(env.get(SEND_AUX_TCP_VAR))) and pool is not MemPoolType.NVLINK
    if "MC_FORCE_TCP" in env:
        transport = EngineTransport.tcp
    elif "MC_INTRANODE_NVLINK" in env:
        transport = EngineTransport.nvlink_intra
    else:
        transport = EngineTransport.rdma
    timeout = env.get(TIMEOUT_VAR)
    if timeout is None:
        seconds = MOONCAKE_TCP_TIMEOUT_DEFAULT_S
    elif timeout.strip().isdigit() and int(timeout) > 0:
        seconds = int(timeout)
    else:
        raise ConfigError(TIMEOUT_VAR, timeout, "a whole number of seconds > 0, or unset "
                                                f"(Mooncake's default, {MOONCAKE_TCP_TIMEOUT_DEFAULT_S} s)")
    return {
        "mem_pool": pool.value,
        "transport.route": "tcp" if forced_tcp else "auto",
        "transport.mooncake.transport": transport.value,
        "transport.mooncake.tcp_progress_timeout_s": str(seconds),
        "buffers.enable_sampling_mask": "true" if sglang_bool(env.get(SAMPLING_MASK_VAR)) else "false",
    }

"""The environment a serving engine (SGLang on Mooncake) needs to reproduce a plan. Pure.

:func:`serving_env` maps a :class:`~orchestrator.plan.Plan` to environment variables: a
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
    (SGLang tests presence here too, hence unset rather than ``"0"``.)

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
"""

from __future__ import annotations

from typing import Optional

from .config import MemPoolType
from .plan import Device, Plan, Reason

POOL_VAR = "SGLANG_MOONCAKE_CUSTOM_MEM_POOL"
SEND_AUX_TCP_VAR = "SGLANG_MOONCAKE_SEND_AUX_TCP"
PROTOCOL_VAR = "MOONCAKE_PROTOCOL"


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

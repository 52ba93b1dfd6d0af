"""The rule book applied to a whole config: `check_profile` hands orchestrator.profile.rules
the sections it judges (rules.check applies every rule, in the book's order) and returns the
Plan (or raises ConfigError). The bench, the doctor, export_env and the command line's
precheck call it, and the run reaches the same rules.check through job.specs.build_specs
(rules.check_job: the plan and what its specs read of it, in one call), so they can never
disagree; `doctor_spec` is what the
doctor reads of a profile (the rule book bound to it, and what its intended plan is drawn
from)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from orchestrator.profile import rules
from orchestrator.profile.config import (
    EndpointsConfig,
    MemPoolConfig,
    OrchestratorConfig,
    TransportConfig,
)
from orchestrator.profile.kinds import Role
from orchestrator.profile.plan import Plan, Platform


def check_profile(cfg: OrchestratorConfig, platform: Platform) -> Plan:
    """Can `cfg` (validated) run on `platform`, and how: its Plan, or ConfigError naming the
    first rule it breaks (orchestrator.profile.rules, whose docstring lists them in order)."""
    return rules.check(transport=cfg.transport, workload=cfg.workload, endpoints=cfg.endpoints, gate=cfg.gate,
                       mem_pool=cfg.mem_pool, role=cfg.role, faults=cfg.faults, digest=cfg.verify.digest,
                       buffers=cfg.buffers, layout=cfg.layout, platform=platform)


@dataclass(frozen=True)
class DoctorSpec:
    """What the doctor's checks read of a profile: the rule book bound to it (`check`, on the
    platform the doctor sees) and the sections its intended plan comes from when the rule
    book refuses it (preflight.doctor.intended_plan)."""

    check: Callable[[Platform], Plan]
    mem_pool: MemPoolConfig
    transport: TransportConfig
    endpoints: EndpointsConfig
    role: Role


def doctor_spec(cfg: OrchestratorConfig) -> DoctorSpec:
    """The doctor's spec of the validated config `cfg`."""
    return DoctorSpec(functools.partial(check_profile, cfg), cfg.mem_pool, cfg.transport, cfg.endpoints, cfg.role)

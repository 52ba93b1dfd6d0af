"""Shared fixtures: configs composed through Hydra's compose API, exactly as the CLI does."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import pytest
import zmq
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from orchestrator.profile.config import CONF_DIR, OrchestratorConfig, register_configs, validate

if TYPE_CHECKING:  # (the runner imports torch: a cost only the tests that run a job pay)
    from orchestrator.profile.plan import Plan, Platform
    from orchestrator.results.records import RunResult
    from orchestrator.results.report_spec import ReportSpec
    from orchestrator.results.schema import JobResults

ROOT = Path(__file__).resolve().parent.parent
CONF = CONF_DIR

register_configs()

def _destroy_leaked_context(self) -> None:
    """A context a failed test left behind is collected at any later moment; pyzmq's own
    finaliser then waits for its sockets' pending messages forever and hangs the session.
    Close them without lingering instead (the failure itself is already reported)."""
    if not self.closed:
        try:
            self.destroy(linger=0)
        except Exception:  # noqa: BLE001 - a finaliser must not raise
            pass


zmq.Context.__del__ = _destroy_leaked_context

try:  # property tests keep no example database, and hypothesis its caches, in the checkout
    import tempfile

    from hypothesis import settings
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(tempfile.mkdtemp(prefix="hypothesis-"))

    settings.register_profile("orchestrator", database=None)
    settings.load_profile("orchestrator")
except ImportError:
    pass


def compose_cfg(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose(config_name="config", overrides=list(overrides))


def typed_cfg(*overrides: str) -> OrchestratorConfig:
    return validate(compose_cfg(*overrides))


@pytest.fixture
def cfg_factory():
    return typed_cfg


def plan_of(cfg: OrchestratorConfig, platform: Platform) -> Plan:
    """make_plan over the sections of a whole config it reads."""
    from orchestrator.profile.plan import make_plan

    return make_plan(cfg.mem_pool, cfg.transport, cfg.endpoints, cfg.role, platform)


def report_spec(cfg: OrchestratorConfig) -> ReportSpec:
    """The report's spec of `cfg` as a job builds it (job.specs.build_specs), on a bare CPU
    Platform()'s plan (the report's spec reads none of it)."""
    from orchestrator.job.specs import build_specs
    from orchestrator.profile.plan import Platform

    return build_specs(cfg, plan_of(cfg, Platform())).report


class JobRunner:
    """One in-process job, as the CLI runs it: the config composed from `overrides`, planned
    through the rule book (check_profile) on `platform` (default: a bare CPU Platform()), run
    into `run_dir`, and its typed results (report.build_results) returned. The last run's
    config, plan, raw RunResult and the wall time of its handoff phase stay on the runner
    (`cfg`, `plan`, `out`, `wall_s`) for the tests that look at them."""

    def __init__(self) -> None:
        self.cfg: Optional[OrchestratorConfig] = None
        self.plan: Optional[Plan] = None
        self.out: Optional[RunResult] = None
        self.wall_s: Optional[float] = None

    def __call__(self, run_dir: Path, *overrides: str, platform: Optional[Platform] = None) -> JobResults:
        from orchestrator.job.check import check_profile
        from orchestrator.job.runner import run_handoffs
        from orchestrator.job.specs import build_specs
        from orchestrator.profile.plan import Platform
        from orchestrator.results.reporting import build_results

        self.cfg = cfg = typed_cfg(*overrides)
        self.plan = plan = check_profile(cfg, platform or Platform())
        t0 = time.monotonic()
        specs = build_specs(cfg, plan)
        self.out = out = run_handoffs(specs, run_dir)
        self.wall_s = time.monotonic() - t0
        return build_results(specs.report, out)


@pytest.fixture
def run_job() -> JobRunner:
    """`run_job(run_dir, *overrides, platform=None)`: a job's JobResults (see JobRunner)."""
    return JobRunner()


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch sees no GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class DecodeProcess:
    """The real decode endpoint in its own (spawned) process, for tests that play prefill
    themselves with raw sockets (tests/helpers/peers.py). `info` holds its endpoints; stop()
    returns its DecodeResult."""

    def __init__(self, cfg, run_dir, secret=b"test-secret", platform=None):
        import multiprocessing as mp

        from orchestrator.job import protocol
        from orchestrator.job.children import decode_main
        from orchestrator.job.specs import build_specs
        from orchestrator.profile.plan import Platform

        self.plan = plan_of(cfg, platform or Platform())
        self.secret = secret
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        self.conn = protocol.Channel(conn)
        self.proc = ctx.Process(target=decode_main, args=(build_specs(cfg, self.plan).decode, str(run_dir),
                                                          secret, child),
                                daemon=True)
        self.proc.start()
        assert self.conn.poll(60), "decode did not start"
        msg = self.conn.recv()
        assert isinstance(msg, protocol.Ready), msg
        self.info = msg.info

    def stop(self):
        """Stop the decode side; skips its notices to the runner, returns its final stats."""
        from orchestrator.job import protocol

        self.conn.send(protocol.Stop())
        while True:
            assert self.conn.poll(20), "decode did not stop"
            msg = self.conn.recv()
            if not isinstance(msg, (protocol.Bye, protocol.Refused, protocol.PrefillLost)):
                break  # (those are notices for the runner)
        self.proc.join(10)
        assert isinstance(msg, protocol.Stats), msg
        return msg.result

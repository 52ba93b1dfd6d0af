"""One rule book: the run, the doctor and export_env refuse exactly the same profiles, each
with one line naming the same key, and accept the same ones."""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator.job.check import doctor_spec
from orchestrator.preflight import doctor, export_env
from orchestrator.preflight.compose import precheck

from .conftest import ROOT

REFUSED = [  # (overrides, the key the refusal names), on this CPU box
    (["mem_pool=INTRA_NODE_NVLINK"], "mem_pool"),
    (["faults=bad_destination", "transport.route=tcp"], "faults.kind"),
    (["mem_pool=NVLINK", "transport.route=engine"], "transport.route"),
    (["transport.mooncake.transport=nvlink_intra"], "transport.mooncake.transport"),
    (["transport.secret_env=ORCH_RULEBOOK_UNSET"], "transport.secret_env"),
    (["role=prefill", "peer=127.0.0.1:5555"], "transport.secret_env"),
    (["transport.host=10.1.2.3", "transport.allow_remote=true"], "transport.secret_env"),
    (["faults=status_first"], "faults.rank"),
    (["transport.mooncake.start_metadata_server=true"], "transport.mooncake.start_metadata_server"),
    (["buffers.size=0"], "buffers.size"),
    (["workload.requests=0"], "workload.requests"),
    (["transport.host=10.1.2.3"], "transport.host"),
    (["transport.mooncake.transport=rdma"], "transport.mooncake.transport"),  # no HCA here
]
ACCEPTED = [[], ["mem_pool=NVLINK"], ["transport.route=tcp", "workload.batch_size=8"],
            ["mem_pool=INTRA_NODE_NVLINK", "transport.fallback=degrade"],
            ["transport.mooncake.transport=rdma", "transport.fallback=degrade"]]


def _code(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.fixture(autouse=True)
def no_secret(monkeypatch):
    monkeypatch.delenv("ORCH_RULEBOOK_UNSET", raising=False)


@pytest.mark.parametrize("overrides,key", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_run_doctor_and_export_env_refuse_alike(overrides, key, capsys):
    run = precheck(overrides)  # what `python -m orchestrator` checks before starting anything
    assert run is not None and run.startswith(f"{key}=") and "\n" not in run
    assert _code(export_env.main, overrides) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key}=") and err.count("\n") == 1
    code = _code(doctor.main, overrides)
    out = capsys.readouterr()
    assert code in (1, 2)  # 1: the plan check FAILs; 2: the profile itself is broken
    assert f"{key}=" in out.out + out.err


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[" ".join(o) or "default" for o in ACCEPTED])
def test_run_doctor_and_export_env_accept_alike(overrides, capsys):
    assert precheck(overrides) is None
    assert _code(export_env.main, overrides) == 0
    report = doctor.run_checks(doctor_spec(doctor.load_profile(overrides)), overrides)
    assert next(c for c in report.checks if c.name == "plan").status is not doctor.CheckStatus.FAIL


def test_the_real_command_line_refuses_the_same_way(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "faults=bad_destination",
                           "transport.route=tcp", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: faults.kind=") and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # a refused run leaves no run dir


def test_nvlink_stays_on_one_host(cfg_factory):
    """A split run (role=prefill/decode) over a non-loopback host cannot use NVLink: refused
    naming the transport; the same split over loopback (two commands, one host) may."""
    from orchestrator.job.check import check_profile
    from orchestrator.profile.config import ConfigError
    from orchestrator.profile.plan import Platform

    gpu = Platform(cuda_devices=2, mooncake_cuda=True, env={"S": "x" * 32})
    split = ["mem_pool=INTRA_NODE_NVLINK", "role=decode", "transport.secret_env=S"]
    with pytest.raises(ConfigError) as err:
        check_profile(cfg_factory(*split, "transport.host=10.1.2.3", "transport.allow_remote=true"), gpu)
    assert err.value.key == "transport.mooncake.transport" and "one host" in str(err.value)
    assert check_profile(cfg_factory(*split), gpu).engine_transport.value == "nvlink_intra"
    tcp = check_profile(cfg_factory(*split, "transport.host=10.1.2.3", "transport.allow_remote=true",
                                    "transport.mooncake.transport=tcp"), gpu)
    assert tcp.engine_transport.value == "tcp"


def test_rdma_needs_a_device(cfg_factory):
    from orchestrator.job.check import check_profile
    from orchestrator.profile.config import ConfigError
    from orchestrator.profile.plan import Platform

    with pytest.raises(ConfigError) as err:
        check_profile(cfg_factory("transport.mooncake.transport=rdma"), Platform())
    assert "no RDMA device" in str(err.value)
    plan = check_profile(cfg_factory("transport.mooncake.transport=rdma"), Platform(rdma_devices=("mlx5_0",)))
    assert plan.declared_transport == "mooncake-rdma"


def test_a_jobs_specs_carry_the_verdict_it_was_checked_on(cfg_factory):
    """build_specs on a Platform: the rule book's verdict, once. The run's secret is the one
    the rule book judged (read from the platform's env, not this process's), the report's
    plan is the plan's record, and its rows are the profile's fields; a Plan made beforehand
    is taken as given, with a fresh secret when none is named."""
    from orchestrator.job.specs import build_specs
    from orchestrator.profile.kinds import ConfigError, secret_from_env
    from orchestrator.profile.layout import profile_layout
    from orchestrator.profile.plan import Platform

    cfg = cfg_factory("transport.secret_env=ORCH_RULEBOOK_JUDGED")
    platform = Platform(env={"ORCH_RULEBOOK_JUDGED": "the judged one"})
    specs = build_specs(cfg, platform)
    assert specs.secret == secret_from_env("ORCH_RULEBOOK_JUDGED", platform.env)
    assert "the judged one" not in repr(specs)  # never in a log line
    assert specs.report.plan.to_json() == specs.plan.as_dict()
    assert specs.report.plan.gpu_sharing == specs.plan.sharing.as_dict()
    fields = profile_layout(cfg.buffers, cfg.layout)
    assert (specs.report.rows.blocks, specs.report.rows.row_bytes) == (len(fields), sum(f[2] for f in fields))
    with pytest.raises(ConfigError, match="transport.secret_env"):
        build_specs(cfg, Platform(env={}))  # named, not set: refused by the rule book
    bare = cfg_factory()
    given = build_specs(bare, specs.plan)
    assert given.plan is specs.plan and len(given.secret) == 32
    assert build_specs(bare, specs.plan).secret != given.secret  # drawn per job

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

"""The checks made before a sweep goes to Slurm (orchestrator/sweep/slurm.py), on sinfo text as
Slurm prints it, and the metadata-server reason of a failed engine start; no cluster needed.
The same checks against a real cluster: tests/test_cluster.py."""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from orchestrator.handoff.backends.mooncake.engine import _metadata_failure
from orchestrator.sweep import slurm

SINFO = "pdnode1|debug*|2|2048\npdnode2|debug*|2|2048\nbig1|gpu|64|515000\n"


def launcher(**kw):
    base = {"_target_": slurm.SUBMITIT_LAUNCHER, "partition": None, "cpus_per_task": 4,
            "tasks_per_node": 1, "mem_gb": 16}
    return OmegaConf.create({**base, **kw})


def test_parse_sinfo_marks_the_default_partition():
    nodes = slurm.parse_sinfo(SINFO + "garbage line\nn9|debug*|4+|n/a\n")
    assert [(n.name, n.partition, n.default, n.cpus, n.memory_mb) for n in nodes] == [
        ("pdnode1", "debug", True, 2, 2048), ("pdnode2", "debug", True, 2, 2048),
        ("big1", "gpu", False, 64, 515000), ("n9", "debug", True, 4, 0)]


def test_request_larger_than_every_default_node_is_refused():
    with pytest.raises(slurm.LauncherRequestError) as err:
        slurm.check_request(launcher(), slurm.parse_sinfo(SINFO))
    assert err.value.key == "hydra.launcher.cpus_per_task"
    assert str(err.value) == (
        "hydra.launcher.cpus_per_task=4 and hydra.launcher.mem_gb=16 ask for more than any node "
        "has, the jobs would pend forever (sinfo: partition debug (the default), 2 nodes, at most "
        "2 CPUs and 2048 MB per node); allowed: cpus_per_task<=2, mem_gb<=2")


def test_memory_alone_names_mem_gb():
    with pytest.raises(slurm.LauncherRequestError) as err:
        slurm.check_request(launcher(cpus_per_task=1, mem_gb=3), slurm.parse_sinfo(SINFO))
    assert err.value.key == "hydra.launcher.mem_gb"
    assert str(err.value).startswith("hydra.launcher.mem_gb=3 asks for more than any node has")


def test_tasks_per_node_multiply_the_cpus():
    with pytest.raises(slurm.LauncherRequestError, match=r"cpus_per_task=2 \(x tasks_per_node=2\)"):
        slurm.check_request(launcher(cpus_per_task=2, tasks_per_node=2, mem_gb=1), slurm.parse_sinfo(SINFO))


def test_a_request_that_fits_passes_and_the_partition_counts():
    nodes = slurm.parse_sinfo(SINFO)
    assert slurm.check_request(launcher(cpus_per_task=2, mem_gb=1), nodes) is None
    assert slurm.check_request(launcher(partition="gpu"), nodes) is None  # 64 CPUs there
    with pytest.raises(slurm.LauncherRequestError) as err:
        slurm.check_request(launcher(partition="cpu"), nodes)
    assert err.value.key == "hydra.launcher.partition"
    assert str(err.value) == "hydra.launcher.partition=cpu: sinfo lists no such partition; it has debug, gpu"


def test_unknown_memory_is_not_checked_and_no_nodes_warns():
    assert slurm.check_request(launcher(cpus_per_task=1, mem_gb=500),
                               slurm.parse_sinfo("n1|debug*|2|1\n")) is None
    assert "not checked" in slurm.check_request(launcher(), [])


def test_only_the_submitit_slurm_launcher_is_checked():
    assert slurm.is_slurm_launcher(launcher())
    assert not slurm.is_slurm_launcher(OmegaConf.create(
        {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"}))
    assert not slurm.is_slurm_launcher(None)


def test_no_sinfo_is_a_warning_not_an_error(monkeypatch):
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    assert slurm.precheck(launcher()) == "no sinfo on this host: the launcher's request was not checked"


def test_submitit_messages_go_to_the_log_file(tmp_path):
    pytest.importorskip("submitit")
    from submitit.slurm.slurm import SlurmInfoWatcher

    log = tmp_path / ".submitit" / "submitit.log"
    saved = SlurmInfoWatcher._make_command
    logger = logging.getLogger("submitit")
    saved_log = (list(logger.handlers), logger.propagate)
    try:
        slurm.quiet_submitit(log)
        assert logger.propagate is False
        logger.warning("Call #1 - Bypassing sacct error X, status may be inaccurate.")
        assert "Bypassing sacct error X" in log.read_text()
        watcher = SlurmInfoWatcher(delay_s=60)
        assert watcher._make_command() is None  # nothing registered: no call at all
        watcher.register_job("12")
        cmd = watcher._make_command()
        assert cmd[:2] == ["sh", "-c"] and cmd[3:] == ["sacct", "sacct", "-o", "JobID,State,NodeList",
                                                     "--parsable2", "-j", "12"]
        assert str(log) in cmd[2]
        slurm.quiet_submitit(log)  # twice: still one wrapper
        assert SlurmInfoWatcher(delay_s=60)._make_command() is None
        w2 = SlurmInfoWatcher(delay_s=60)
        w2.register_job("3")
        assert w2._make_command().count("sh") == 1
    finally:
        for handler in logger.handlers:
            handler.close()
        logger.handlers[:], logger.propagate = saved_log
        SlurmInfoWatcher._make_command = saved
        if hasattr(SlurmInfoWatcher, "_pd_aux_make_command"):
            del SlurmInfoWatcher._pd_aux_make_command


def test_metadata_failure_reason_from_the_engine_log():
    log = ("W1201 transfer_engine_py.cpp:120] Using default malloc/free for protocol: tcp\n"
           "E1201 09:38:49.383792 15662 transfer_metadata_plugin.cpp:496] EtcdStoragePlugin: unable to "
           "set mooncake/rpc_meta/127.0.0.1:34723 in 127.0.0.1:1: context deadline exceeded\n")
    assert _metadata_failure(log) == ("metadata server not answering: EtcdStoragePlugin: unable to set "
                                      "mooncake/rpc_meta/127.0.0.1:34723 in 127.0.0.1:1: context deadline exceeded")
    assert _metadata_failure("listen: Address already in use") is None
    assert _metadata_failure("") is None


def test_missing_packages_are_a_skip_reason(monkeypatch):
    from tests.helpers import cluster, etcd

    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster, "_which", lambda name: None if name in ("slurmd", "munged") else "/bin/true")
    assert cluster.missing() == ("not installed: munged, slurmd (Debian: apt-get install slurm-wlm munge; "
                                 "`make cluster-deps`)")
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    assert cluster.missing().startswith("the test cluster needs root")
    monkeypatch.setattr(etcd, "etcd_binary", lambda: None)
    assert etcd.missing().startswith("etcd is not installed")

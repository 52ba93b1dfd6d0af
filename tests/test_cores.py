"""endpoints.poll=auto and transport.mooncake.completion=auto decide by the cores this process
may use (its CPU affinity and cgroup CPU quota), not by the host's core count."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.profile.config import PollMode
from orchestrator.profile.platform import cgroup_cpu_limit, usable_cores

SIXTEEN = range(16)


def _tree(tmp_path: Path, cgroup: str, files: dict[str, str]) -> str:
    """A fake root: proc/self/cgroup and the cgroup files given (paths under sys/fs/cgroup)."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        f = tmp_path / "sys/fs/cgroup" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(tmp_path)


def test_v2_quota_cuts_a_big_affinity(tmp_path):
    root = _tree(tmp_path, "0::/job\n", {"job/cpu.max": "200000 100000\n", "cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root) == 2.0
    assert usable_cores(root, SIXTEEN) == 2
    assert not PollMode.auto.spins(usable_cores(root, SIXTEEN))  # 16 host cores, a 2-CPU quota: block


def test_v2_parent_quota_counts_and_no_quota_is_the_affinity(tmp_path):
    root = _tree(tmp_path, "0::/a/b\n", {"a/cpu.max": "150000 100000", "a/b/cpu.max": "max 100000"})
    assert usable_cores(root, SIXTEEN) == 1  # 1.5 CPUs: one whole core
    free = _tree(tmp_path / "free", "0::/a\n", {"a/cpu.max": "max 100000"})
    assert cgroup_cpu_limit(free) is None
    assert usable_cores(free, SIXTEEN) == 16
    assert PollMode.auto.spins(usable_cores(free, SIXTEEN))


def test_v2_namespaced_path_reads_the_mount(tmp_path):
    root = _tree(tmp_path, "0::/\n", {"cpu.max": "400000 100000"})
    assert usable_cores(root, SIXTEEN) == 4


def test_v1_cfs_quota(tmp_path):
    cg = "4:memory:/x\n2:cpu,cpuacct:/docker/c1\n0::/\n"
    root = _tree(tmp_path, cg, {"cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "300000",
                                "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000",
                                "cpu,cpuacct/cpu.cfs_quota_us": "-1",
                                "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(root) == 3.0
    assert usable_cores(root, SIXTEEN) == 3
    unlimited = _tree(tmp_path / "u", "2:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1",
                                                           "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert usable_cores(unlimited, SIXTEEN) == 16


def test_no_cgroup_files_is_no_quota(tmp_path):
    assert cgroup_cpu_limit(str(tmp_path)) is None
    assert usable_cores(str(tmp_path), range(3)) == 3


def test_poll_modes_other_than_auto_ignore_cores():
    assert PollMode.spin.spins(1) and not PollMode.block.spins(64)
    assert PollMode.auto.spins(8) and not PollMode.auto.spins(7)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not os.path.exists("/usr/bin/taskset"),
                    reason="needs 2 usable cores and taskset")
def test_taskset_pins_the_count():
    """One pinned core of a bigger box: os.cpu_count() still says the host's, usable_cores 1."""
    code = ("import os; from orchestrator.profile.platform import usable_cores; "
            "print(os.cpu_count(), usable_cores())")
    cpu = sorted(os.sched_getaffinity(0))[0]
    out = subprocess.run(["taskset", "-c", str(cpu), sys.executable, "-c", code], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    host, usable = map(int, out.stdout.split())
    assert host >= 2
    assert usable == 1

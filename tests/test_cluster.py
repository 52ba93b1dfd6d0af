"""Real Slurm jobs on a cluster the tests start themselves (tests/helpers/cluster.py): munged,
slurmctld in a login namespace, slurmd `pdnode1` (192.0.2.1) and `pdnode2` (192.0.2.2) in two
network namespaces of their own. Every command a user would type runs in the login namespace,
as on a login node; the jobs run on the nodes through sbatch/srun, the way submitit sends them.

- a sweep through `hydra/launcher=slurm`: both jobs ran, summary written, sacct's noise in
  the sweep's .submitit/submitit.log and not on the console;
- docs/slurm.md's two-node recipe, its command line as documented: decode on one node,
  prefill on the other, meeting through the bootstrap file in the sweep dir; the merged report
  says both sides agree;
- `scancel` of that array mid-run: exit 143, and each side's counts add up and agree;
- a launcher request larger than every node: refused before submission, exit 2, one line
  naming the keys and what sinfo says the partition has.
- the page's heterogeneous job script through `sbatch`: one component per node, both sides
  agree.

Needs root, iproute2 and Debian's slurm-wlm and munge (`make cluster-deps`); skips otherwise.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.results.schema import Results

from .conftest import ROOT
from .helpers import cluster as cl

pytestmark = [pytest.mark.cluster, pytest.mark.integration, pytest.mark.slow,
              pytest.mark.xdist_group("cluster")]  # one worker: the cluster is built once

DOC = ROOT / "docs" / "slurm.md"
RUN_TIMEOUT_S = 300  # no command here may run longer; the ones that pass take seconds
# The launcher settings docs/slurm.md gives for nodes smaller than slurm_pd's defaults
# (4 CPUs, 16 GB); the test nodes declare 2 CPUs and 2048 MB each.
SMALL_NODES = ("hydra.launcher.cpus_per_task=2", "hydra.launcher.mem_gb=1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = cl.missing()
    if why:
        pytest.skip(why)
    c = cl.Cluster.start(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        problems = c.stop()
        assert not problems, problems


def orchestrator(cluster: cl.Cluster, overrides: list[str], env: dict | None = None,
                 timeout: float = RUN_TIMEOUT_S, wait: bool = True):
    """`python -m orchestrator OVERRIDES` on the login namespace, as a user would type it."""
    argv = cluster.login_exec([sys.executable, "-m", "orchestrator", *overrides])
    full_env = {**cluster.env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    if not wait:
        return subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return subprocess.run(argv, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def jobs(cluster: cl.Cluster) -> dict[str, tuple[str, str]]:
    """{job id (1_0, ...): (state, node)} of every job the controller still knows."""
    out = cluster.squeue("-h", "-t", "all", "-o", "%i %t %N").stdout
    return {p[0]: (p[1], p[2] if len(p) > 2 else "") for p in (ln.split() for ln in out.splitlines()) if p}


def results(run_dir: Path) -> Results:
    return Results.read(run_dir)


def merged_report(prefill_dir: Path, decode_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.report", str(prefill_dir), str(decode_dir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def recipe_command() -> list[str]:
    """docs/slurm.md's recipe (step 2), continuation lines joined, split as bash would."""
    text = re.sub(r"\\\n\s*", " ", DOC.read_text())
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip().startswith("python -m orchestrator -m hydra/launcher=slurm_pd role=decode,prefill")]
    assert lines, "docs/slurm.md lost its recipe"
    return shlex.split(lines[0])


# ---- the cluster itself ------------------------------------------------------------------------
def test_cluster_has_two_nodes_in_their_own_namespaces(cluster):
    nodes = cluster.sinfo("-h", "-N", "-o", "%N %t %c %m").stdout.split("\n")
    assert sorted(n.split()[0] for n in nodes if n) == ["pdnode1", "pdnode2"]
    script = cluster.base / "where.sh"
    script.write_text("#!/bin/sh\necho \"$(hostname) $(ip -4 -o addr show dev eth0 | awk '{print $4}')\"\n")
    out = cluster.command("srun", "-N2", "-l", "sh", str(script), timeout=60)
    assert out.returncode == 0, out.stderr
    seen = sorted(line.split(":", 1)[1].strip() for line in out.stdout.splitlines())
    assert seen == ["pdnode1 192.0.2.1/24", "pdnode2 192.0.2.2/24"], out.stdout


# ---- what a user meets before anything is submitted --------------------------------------------
def test_launcher_request_larger_than_every_node_is_refused(cluster, tmp_path):
    before = set(jobs(cluster))
    proc = orchestrator(cluster, ["-m", "hydra/launcher=slurm", "workload.requests=10",
                                  f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("error: hydra.launcher.cpus_per_task=4 and hydra.launcher.mem_gb=16 "), line
    assert (f"partition {cl.PARTITION} (the default), 2 nodes, at most {cl.NODE_CPUS} CPUs and "
            f"{cl.NODE_MEMORY_MB} MB per node") in line, line
    assert "allowed: cpus_per_task<=2, mem_gb<=2" in line, line
    assert "Traceback" not in proc.stdout + proc.stderr
    assert set(jobs(cluster)) == before  # nothing was submitted


def test_unknown_partition_is_refused(cluster, tmp_path):
    proc = orchestrator(cluster, ["-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                                  "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
                                  f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("error: hydra.launcher.partition=gpu: sinfo lists no such "
                                   f"partition; it has {cl.PARTITION}"), proc.stderr


# ---- a sweep through hydra/launcher=slurm ------------------------------------------------------
def test_sweep_through_the_slurm_launcher(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    proc = orchestrator(cluster, ["-m", "hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1",
                                  "hydra.launcher.mem_gb=1", "workload.requests=300",
                                  "mem_pool=NONE,NVLINK", f"hydra.sweep.dir={sweep}"])
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console
    assert "Traceback" not in console
    # submitit's polling noise where Slurm keeps no accounting: in the log, not the console
    assert "Bypassing sacct error" not in console and "accounting storage is disabled" not in console, console
    log = (sweep / ".submitit" / "submitit.log").read_text()
    assert "Bypassing sacct error" in log and "Slurm accounting storage is disabled" in log, log
    rows = (sweep / "summary.csv").read_text().splitlines()
    assert len(rows) == 3, rows  # header and one row per job
    for job, pool, route in (("0", "NONE", "engine"), ("1", "NVLINK", "tcp")):
        r = results(sweep / job)
        assert (r.requests, r.verified, r.corrupted, r.failed) == (300, 300, 0, 0), r
        assert r.exit_code == 0 and r.plan.mem_pool == pool and r.routes == {route: 300}
    states = {j: s for j, s in jobs(cluster).items() if s[0] == "CD"}
    assert len(states) >= 2 and all(node.startswith("pdnode") for _, node in states.values()), states


# ---- docs/slurm.md's two-node recipe -----------------------------------------------------------
@pytest.fixture
def recipe_env():
    return {"PD_SECRET": secrets.token_hex(32)}  # step 1: export PD_SECRET=$(openssl rand -hex 32)


def test_the_doc_names_the_small_node_settings():
    text = " ".join(DOC.read_text().split())
    assert " ".join(SMALL_NODES) in text


def test_two_node_recipe_as_documented(cluster, tmp_path, recipe_env):
    sweep = tmp_path / "pd-runs"
    argv = recipe_command()
    assert argv[:3] == ["python", "-m", "orchestrator"]
    overrides = [a.replace("$SWEEP", str(sweep)) for a in argv[3:]] + [*SMALL_NODES, "workload.requests=200"]
    before = set(jobs(cluster))
    proc = orchestrator(cluster, overrides, env=recipe_env)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console
    assert "Traceback" not in console and "Bypassing sacct error" not in console, console

    decode, prefill = results(sweep / "0"), results(sweep / "1")
    assert (decode.role, prefill.role) == ("decode", "prefill")
    assert (prefill.requests, prefill.verified, prefill.corrupted, prefill.failed) == (200, 200, 0, 0)
    assert (decode.requests, decode.verified) == (200, 200) and decode.exit_code == 0
    assert prefill.transports.effective_transport == "mooncake-tcp"
    # decode on one node, prefill on the other: the array's two tasks, one node each
    ran = {j: s for j, s in jobs(cluster).items() if j not in before}
    nodes = {j.split("_")[1]: node for j, (state, node) in ran.items() if "_" in j}
    assert set(nodes) == {"0", "1"} and nodes["0"] != nodes["1"], ran
    host, _, port = decode.bootstrap.partition(":")
    assert host == dict(cl.NODES)[nodes["0"]], (decode.bootstrap, nodes)
    assert json.loads((sweep / "0" / "bootstrap.json").read_text()) == {"address": decode.bootstrap}
    assert decode.prefills_seen == [0]
    # the secret went by name only
    assert recipe_env["PD_SECRET"] not in (sweep / "multirun.yaml").read_text()

    rep = merged_report(sweep / "1", sweep / "0")
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert "requests 200: verified 200, corrupted 0, failed 0" in rep.stdout, rep.stdout
    assert f"decode side at {decode.bootstrap} judged 200: verified 200, corrupted 0, failed 0" in rep.stdout
    assert rep.stdout.rstrip().endswith("both sides agree"), rep.stdout
    print(f"\n[cluster] decode on {nodes['0']}, prefill on {nodes['1']}\n{rep.stdout}")


def _verified_lines(run_dir: Path) -> int:
    path = run_dir / "requests.jsonl"
    try:
        data = path.read_text(errors="replace")
    except OSError:
        return 0
    return data[: data.rfind("\n") + 1].count('"outcome": "verified"')


def test_scancel_mid_run_gives_143_and_honest_counts(cluster, tmp_path, recipe_env):
    sweep = tmp_path / "pd-runs"
    requests = 50_000  # at 500/s: 100 s unless cancelled, which happens after ~200 handoffs
    overrides = [a.replace("$SWEEP", str(sweep)) for a in recipe_command()[3:]] + [
        *SMALL_NODES, f"workload.requests={requests}", "workload.rate=500"]
    before = set(jobs(cluster))
    proc = orchestrator(cluster, overrides, env=recipe_env, wait=False)
    try:
        deadline = time.monotonic() + 120
        while _verified_lines(sweep / "1") < 200:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the prefill side verified nothing within 120 s"
            time.sleep(0.2)
        array = {j.split("_")[0] for j in jobs(cluster) if j not in before and "_" in j}
        assert len(array) == 1, array
        cancel = cluster.command("scancel", array.pop())
        assert cancel.returncode == 0, cancel.stderr
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, out + err  # the worst job's exit code: SIGTERM
    assert "Traceback" not in out + err

    decode, prefill = results(sweep / "0"), results(sweep / "1")
    assert prefill.ending.interrupted is True and prefill.ending.signal == "SIGTERM", prefill
    assert prefill.exit_code == 143 and prefill.corrupted == 0
    # The decode side's SIGTERM comes from slurmd on its own node: on a loaded box the prefill
    # can stop and say bye first, and the decode side then ends on that bye (exit 0, nothing lost)
    if decode.ending.interrupted:
        assert decode.ending.signal == "SIGTERM" and decode.exit_code == 143, decode
    else:
        assert decode.exit_code == 0 and decode.ending.lost == {}, decode
    n = prefill.verified
    assert 200 <= n < requests
    assert prefill.requests == requests
    not_started = prefill.not_started  # never arrived before SIGTERM: no line, not failed
    assert prefill.verified + prefill.corrupted + prefill.failed + not_started == requests
    # What was not verified was in flight, or arrived and was not sent, when SIGTERM came.
    # Slurm signals every process of the step at once; the runner gives its prefill endpoint
    # a grace period to wind down (runner._watch). On a loaded box it can take longer: then
    # the runner ends it (slow_to_stop) and rebuilds its counts from requests.jsonl and the
    # decode's verdicts. Either way no side claims more than it saw.
    reasons = prefill.failure_reasons
    assert set(reasons) <= {"interrupted", "not_sent_interrupted"}, reasons
    assert sum(reasons.values()) == requests - n - not_started, reasons
    assert _verified_lines(sweep / "1") == n  # each verified request has its line
    assert decode.corrupted == 0 and decode.failed == 0, decode
    assert decode.verified >= n, (decode, reasons)  # the prefill side never over-claims
    assert prefill.ending.lost == {}, prefill.ending.lost  # slow to stop is not lost
    stopped_in_time = not prefill.ending.slow_to_stop
    if stopped_in_time:
        # a request in flight may have been judged on the decode side after the prefill
        # side stopped counting
        assert decode.verified <= n + reasons.get("interrupted", 0), (decode, reasons)
    settle = time.monotonic() + 30  # CG (completing) turns into CA once slurmd has reaped the steps
    while True:
        ran = {j: s[0] for j, s in jobs(cluster).items() if j not in before}
        if "CG" not in ran.values() or time.monotonic() > settle:
            break
        time.sleep(0.5)
    assert ran and set(ran.values()) == {"CA"}, ran  # Slurm's view: cancelled

    rep = merged_report(sweep / "1", sweep / "0")
    assert rep.returncode == 1, rep.stdout  # not every request verified
    assert "interrupted (SIGTERM)" in rep.stdout, rep.stdout
    if stopped_in_time:
        assert "both sides agree" in rep.stdout, rep.stdout
    print(f"\n[cluster] scancel after {n} verified of {requests} ({reasons}), decode judged "
          f"{decode.verified}: exit {proc.returncode}; prefill endpoint stopped within its grace: "
          f"{stopped_in_time}\n{rep.stdout}")


# ---- docs/slurm.md's heterogeneous job, without the launcher -----------------------------------
def test_heterogeneous_job_script_as_documented(cluster, tmp_path, recipe_env):
    """The page's pd-het.sbatch, with each component's --cpus-per-task=4 --mem=16G made
    --cpus-per-task=2 --mem=1G (the test nodes' size), submitted with `sbatch`."""
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S) if "#SBATCH hetjob" in b]
    assert len(blocks) == 1
    text = blocks[0]
    assert text.count("--cpus-per-task=4") == 2 and text.count("--mem=16G") == 2
    script = tmp_path / "pd-het.sbatch"
    script.write_text(text.replace("--cpus-per-task=4", "--cpus-per-task=2").replace("--mem=16G", "--mem=1G"))
    run_dir = tmp_path / "het"
    env = {**cluster.env, **recipe_env, "PYTHONPATH": str(ROOT), "PD_RUN_DIR": str(run_dir)}
    sub = subprocess.run(cluster.login_exec(["sbatch", "--parsable", "-D", str(ROOT), "-o",
                                             str(tmp_path / "het-%j.out"), str(script),
                                             "workload.requests=200"]),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:  # both components ended (squeue keeps them MinJobAge=600 s)
        states = {j: s for j, s in jobs(cluster).items() if j.startswith(f"{job}+")}
        if len(states) == 2 and all(s[0] in ("CD", "F", "CA", "TO", "NF", "OOM") for s in states.values()):
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.5)
    out = (tmp_path / f"het-{job}.out").read_text()
    assert {j: s for j, s in states.items()} == {f"{job}+0": ("CD", "pdnode1"),
                                                 f"{job}+1": ("CD", "pdnode2")}, (states, out)
    assert "decode side: node pdnode1, bootstrap address 192.0.2.1:29555" in out, out
    assert "prefill side exit code 0, decode side exit code 0" in out, out
    assert "requests 200: verified 200, corrupted 0, failed 0" in out, out
    assert "decode side at 192.0.2.1:29555 judged 200: verified 200, corrupted 0, failed 0" in out, out
    assert out.rstrip().endswith("both sides agree"), out
    print(f"\n[cluster] heterogeneous job {job}: {states}\n{out}")

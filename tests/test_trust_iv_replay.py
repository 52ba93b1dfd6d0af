"""Issue 36 (Trust IV), items 2, 4 and part of 6: replay runs data, not code; config-dir YAML is
bounded before anything composes it and a signal ends the command while it composes; errors
name their real cause; a run that hands off nothing does not exit 0. (To be merged into
tests/test_trust_iv.py.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import ROOT

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
HANG_GUARD_S = 180  # a wall limit only against a hang: a refusal here takes about a second
RSS_LIMIT_KB = 200 * 1024


def _one_error(text: str, prefix: str = "error: ") -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, text
    assert "Traceback" not in text, text
    return lines[0]


def _measured(args: list[str], timeout: float = HANG_GUARD_S) -> tuple[int, str, str, int]:
    """Run `args` as the only child of a fresh interpreter: exit code, stdout, stderr and the
    command's peak RSS in KB (its ru_maxrss, RUSAGE_CHILDREN of that interpreter; pytest's own
    earlier children are not counted)."""
    probe = ("import json, resource, subprocess, sys\n"
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "print(json.dumps([p.returncode, p.stdout, p.stderr,"
             " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n")
    import json

    proc = subprocess.Popen([sys.executable, "-c", probe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=ENV, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the command too, not only the probe
        proc.communicate()
        raise AssertionError(f"still running after {timeout} s: {args}") from None
    assert proc.returncode == 0, stderr
    code, out, err, rss = json.loads(stdout)
    return code, out, err, rss


# ---- 2. replay runs data, not code ----------------------------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One real run (the CPU smoke profile) whose dir the replay tests copy and tamper with."""
    path = tmp_path_factory.mktemp("trust4") / "run"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "experiment=cpu_smoke", "workload.requests=20",
                           f"hydra.run.dir={path}"], capture_output=True, text=True, cwd=ROOT, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return path


def _tampered(run_dir: Path, tmp_path: Path, extra: str) -> Path:
    copy = tmp_path / "attached"
    shutil.copytree(run_dir, copy)
    with open(copy / ".hydra" / "config.yaml", "a") as f:
        f.write(extra)
    return copy


def _replay(run_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m orchestrator.replay RUN_DIR`; past `timeout` its whole session is killed (the
    job it started too) and the test fails."""
    args = [sys.executable, "-m", "orchestrator.replay", str(run_dir)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"the replay still ran after {timeout} s") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.integration
def test_replay_never_runs_a_hydra_callback_from_the_run_dir(run_dir, tmp_path):
    """issue 36's attack: a hydra.callbacks entry in the attached dir's config.yaml whose
    _target_ is pathlib.Path.write_text. At 3a078eb the replay wrote the victim, printed
    `deterministic outputs: IDENTICAL` and exited 0."""
    victim = tmp_path / "victim.pth"
    attached = _tampered(run_dir, tmp_path, (
        "hydra:\n"
        "  callbacks:\n"
        "    evil:\n"
        "      _target_: pathlib.Path.write_text\n"
        "      self:\n"
        "        _target_: pathlib.Path\n"
        f"        _args_: [{victim}]\n"
        "      data: import os\n"))
    proc = _replay(attached)
    assert not victim.exists(), "the replay ran the run dir's callback"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_error(proc.stderr)
    assert line == (f"error: {attached / '.hydra' / 'config.yaml'}: hydra.callbacks is not replayable: a replay "
                    "takes the task config only (no hydra node, no _target_)"), line
    assert "IDENTICAL" not in proc.stdout
    assert not (attached / "replays").exists()  # refused before anything ran


def _hydra_searchpath(cfg: dict) -> None:
    cfg["hydra"] = {"searchpath": ["file:///tmp"]}


def _defaults(cfg: dict) -> None:
    cfg["defaults"] = [{"override hydra/launcher": "basic"}]


def _target_in_section(cfg: dict) -> None:
    cfg["workload"]["_target_"] = "shutil.rmtree"


def _target_in_list(cfg: dict) -> None:
    cfg["layout"]["fields"][0]["_target_"] = "builtins.open"


@pytest.mark.integration
@pytest.mark.parametrize("tamper,key", [
    (_hydra_searchpath, "hydra.searchpath"),
    (_defaults, "defaults"),
    (_target_in_section, "workload._target_"),
    (_target_in_list, "layout.fields[0]._target_"),
])
def test_replay_refuses_anything_hydra_would_run_naming_the_key(run_dir, tmp_path, tamper, key):
    import yaml

    attached = tmp_path / "attached"
    shutil.copytree(run_dir, attached)
    path = attached / ".hydra" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    tamper(cfg)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = _replay(attached)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_error(proc.stderr).startswith(f"error: {path}: {key} is not replayable"), proc.stderr
    assert not (attached / "replays").exists()


@pytest.mark.integration
def test_replay_validates_the_saved_config_as_data_before_running_it(run_dir, tmp_path):
    """An unknown key or a wrong value is refused with one line, exit 2, before a replay runs
    (at 3a078eb the replay ran, its job was refused, and compare() ended in a traceback)."""
    attached = tmp_path / "attached"
    shutil.copytree(run_dir, attached)
    path = attached / ".hydra" / "config.yaml"
    path.write_text(path.read_text().replace("workload:\n", "workload:\n  requestz: 5\n", 1))
    proc = _replay(attached)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_error(proc.stderr)
    assert line.startswith(f"error: {path}: workload.requestz=") and "no such key" in line, line
    assert not (attached / "replays").exists()


@pytest.mark.integration
def test_replay_bounds_the_saved_config_before_parsing_it(run_dir, tmp_path):
    """A billion-laughs config.yaml in an attached run dir: one line naming it, exit 2, at once
    (at 3a078eb the replay's job composed it: minutes and gigabytes)."""
    attached = _tampered(run_dir, tmp_path, LAUGHS.split("\n", 1)[1])
    proc = _replay(attached, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_error(proc.stderr).startswith(
        f"error: {attached / '.hydra' / 'config.yaml'}: its 37 YAML aliases expand to more than"), proc.stderr


# ---- 4. bounded configs ---------------------------------------------------------------------
LAUGHS = "".join([
    "# @package _global_\n",
    "a: &a [l,l,l,l,l,l,l,l,l]\n",
    *[f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")],
])


def _bomb_dir(root: Path, kind: str) -> tuple[Path, Path]:
    """A config dir with a good experiment and a hostile one: `laughs` (about 300 bytes of 9
    levels of nested aliases, as the issue's 362-byte file: 9^9 nodes once expanded), 50 MB of
    comments, or 50 MB of data."""
    conf = root / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "good.yaml").write_text("# @package _global_\nworkload:\n  requests: 50\n")
    bad = conf / "experiment" / "bad.yaml"
    if kind == "laughs":
        bad.write_text(LAUGHS)
    else:
        line = "# " + "x" * 97 + "\n" if kind == "comments" else None
        with open(bad, "w") as f:
            f.write("# @package _global_\n")
            for i in range(500_000):
                f.write(line or f"k{i:07d}: {'v' * 88}\n")
    return conf, bad


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["laughs", "comments", "data"])
def test_a_hostile_config_dir_file_is_refused_before_composing(tmp_path, kind):
    """A sweep over a --config-dir holding a billion-laughs file, or 50 MB of comments or data:
    one line naming the file, exit 2, no sweep dir, quickly and small. At 3a078eb the first
    grew to 2.4 GB with no output (killed at 600 s), the 50 MB files held the sweep for
    minutes and grew to 2.5 GB."""
    conf, bad = _bomb_dir(tmp_path, kind)
    sweep = tmp_path / "sweep"
    start = time.monotonic()
    code, out, err, rss = _measured([sys.executable, "-m", "orchestrator", "-m", f"--config-dir={conf}",
                                     "experiment=bad,good", f"hydra.sweep.dir={sweep}"])
    took = time.monotonic() - start
    assert code == 2, out + err
    line = _one_error(err)
    assert line.startswith(f"error: {bad}: "), line
    assert ("YAML aliases expand to more than" in line if kind == "laughs"
            else "bytes, over the 1,048,576 (1 MiB) a config file may have" in line), line
    assert not sweep.exists()
    # the bound: what the file adds to the command (its imports are another issue's)
    _, _, _, base = _measured([sys.executable, "-m", "orchestrator", "workload.requests=0"])
    assert rss - base < 64 * 1024, f"the refusal peaked at {rss} KB, a plain refusal at {base} KB ({took:.1f} s)"


@pytest.mark.parametrize("kind", ["laughs", "comments", "data"])
def test_the_bounds_check_stays_under_200_mb(tmp_path, kind):
    """The check itself, in a fresh interpreter: the refusal, and the peak RSS under 200 MB."""
    conf, bad = _bomb_dir(tmp_path, kind)
    code = ("import sys\nfrom orchestrator.preflight.compose import precheck\n"
            f"print(precheck(['-m', '--config-dir={conf}', 'experiment=good,bad']))\n")
    rc, out, err, rss = _measured([sys.executable, "-c", code])
    assert rc == 0, err
    assert out.startswith(f"{bad}: "), out
    assert rss < RSS_LIMIT_KB, f"{rss} KB"


@pytest.mark.integration
def test_a_config_name_that_scans_the_dir_is_refused_quickly(tmp_path):
    """-cn with --config-dir reads every file of the dir before Hydra does (killed at 400 s at
    3a078eb with a 50 MB file there)."""
    conf, bad = _bomb_dir(tmp_path, "comments")
    (conf / "good.yaml").write_text("workload:\n  requests: 5\n")
    code, out, err, _ = _measured([sys.executable, "-m", "orchestrator", f"--config-dir={conf}", "-cn", "good",
                                   f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 2, out + err
    assert _one_error(err).startswith(f"error: {bad}: 50,"), err
    assert not (tmp_path / "run").exists()


def test_aliases_within_the_budget_still_compose(tmp_path):
    """A few anchors and merge keys are ordinary YAML: the bound does not refuse them."""
    from orchestrator.preflight.compose import precheck

    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "anchors.yaml").write_text(
        "# @package _global_\nbase: &base {requests: 40}\nworkload:\n  <<: *base\n")
    problem = precheck(["--config-dir", str(conf), "experiment=anchors"], rules=False)
    assert problem is None or "YAML aliases" not in problem, problem


SLOW_COMPOSE = '''
import pathlib, runpy, sys
from omegaconf import OmegaConf
import orchestrator.preflight.compose as compose

marker = pathlib.Path(sys.argv[1])


def slow_compose(*args, **kwargs):
    """A compose that takes for ever, in OmegaConf's own code (a big config with shared lists,
    as a file of nested aliases builds): where a signal handler's raise lands."""
    marker.write_text("composing")
    leaf = ["x"] * 9
    for _ in range(3):
        leaf = [leaf] * 9
    while True:
        OmegaConf.create({"a": leaf})


compose.load_profile = slow_compose
sys.argv = ["orchestrator", *sys.argv[2:]]
runpy.run_module("orchestrator", run_name="__main__", alter_sys=True)
'''


@pytest.mark.integration
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_the_command_while_it_composes(tmp_path, sig, code):
    """`timeout 60` sends TERM during a long compose: at 3a078eb the handler's raise landed in
    OmegaConf, whose clean-up turned it into a config error that compose caught, and the command
    went on (until SIGKILL). Now the signal ends it: 130/143 and one line. The slow compose is
    forced by a wrapper (a hook in the test only)."""
    wrapper, marker = tmp_path / "slow_compose.py", tmp_path / "composing"
    wrapper.write_text(SLOW_COMPOSE)
    proc = subprocess.Popen([sys.executable, str(wrapper), str(marker), "workload.requests=10",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the compose never started"
            time.sleep(0.05)
        time.sleep(0.5)  # inside OmegaConf's loop by now
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [f"interrupted ({sig.name}): no job was running"], err
    assert not (tmp_path / "run").exists()


# ---- 6. errors name their real cause; nothing handed off is not a success --------------------
def test_buffers_that_do_not_fit_are_blamed_on_the_row_key_with_the_product():
    """At 3a078eb buffers.hidden_size=... was refused as `buffers.size=64 is not allowed`."""
    from orchestrator.preflight.compose import precheck

    problem = precheck(["buffers.hidden_size=100000000000"])
    assert problem is not None and problem.startswith("buffers.hidden_size=100000000000 is not allowed: "), problem
    assert "buffers.size=64 slots of" in problem and "(buffers.hidden_size=100,000,000,000)" in problem, problem
    problem = precheck(["buffers.size=100000000000"])
    assert problem is not None and problem.startswith("buffers.size=100000000000 is not allowed: fewer slots"), problem


def test_a_long_value_is_not_echoed_back_in_full():
    """A 1,999-value report.percentiles was printed back whole (13,894 characters)."""
    from orchestrator.preflight.compose import precheck

    values = [round(0.01 + i * 0.05, 2) for i in range(1999)]
    problem = precheck([f"report.percentiles=[{','.join(map(str, values))}]"])
    assert problem is not None and problem.startswith(
        "report.percentiles=[0.01, 0.06, 0.11, 0.16, 0.21, 0.26, 0.31, 0.36, ... (1,999 values)] is not allowed: "
        "1 to 12 percentiles"), problem
    assert len(problem) < 300, problem


def test_a_duration_no_request_can_arrive_in_is_refused_before_start(tmp_path):
    """workload.duration_s=1e-9 handed off nothing and exited 0 at 3a078eb."""
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "workload.duration_s=1e-9",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT,
                          env=ENV, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_error(proc.stderr) == (
        "error: workload.duration_s=1e-09 is not allowed: at least 0.1 s (a shorter phase can end before its "
        "first request arrives), or null to run workload.requests."), proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.integration
def test_a_run_that_hands_off_nothing_exits_1_and_says_why(tmp_path):
    """An open loop whose seeded schedule has no arrival inside workload.duration_s (seed 1 at
    0.01/s: the first arrives at 37.7 s) ran, handed off nothing and exited 0 at 3a078eb."""
    from orchestrator.handoff.workload import arrival_offsets
    from orchestrator.results.schema import Results

    assert len(arrival_offsets(0.01, 1, 100, 0, 1.0, 0.1)) == 0  # the premise
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "experiment=cpu_smoke", "workload.duration_s=0.1",
                           "workload.rate=0.01", "workload.seed=1", f"hydra.run.dir={run}"],
                          capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("ERROR: no request was handed off (workload.duration_s=0.1 s at workload.rate=0.01/s: no arrival "
            "of the seeded schedule fell inside it" in proc.stdout + proc.stderr), proc.stdout + proc.stderr
    res = Results.read(run)
    assert res.requests == 0 and res.exit_code == 1


class _WritesVictim:
    """A pickle whose loading writes a file (as a stranger's config.pickle can)."""

    def __init__(self, victim: Path):
        self.victim = victim

    def __reduce__(self):
        return (Path.write_text, (self.victim, "import os\n"))


def test_hydra_experimental_rerun_is_refused_not_unpickled(tmp_path):
    """`--experimental-rerun FILE` makes Hydra pickle.load the file: at 3a078eb the command
    loaded it (the victim written) before anything else; now one line, exit 2."""
    import pickle

    victim, rerun = tmp_path / "victim.pth", tmp_path / "config.pickle"
    rerun.write_bytes(pickle.dumps(_WritesVictim(victim)))
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "--experimental-rerun", str(rerun)],
                          capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=HANG_GUARD_S)
    assert not victim.exists(), "the command unpickled the file"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_error(proc.stderr).startswith(f"error: --experimental-rerun {rerun} is not supported"), proc.stderr

"""The sweep launchers (conf/hydra/launcher/*.yaml) and the two-node recipe of docs/slurm.md.

The launcher nodes are composed through Hydra's compose API against the plugins' schemas.
The recipe's command lines are taken from docs/slurm.md and run through Hydra's own sweeper
and the submitit plugin's launch(), up to the point where `sbatch` would be called (no Slurm
is needed; nothing is submitted): the sbatch script submitit wrote is checked, and every
job's config is built the way the plugin builds it on the node and validated by the app.
Everything is written under pytest's tmp dirs.
"""

from __future__ import annotations

import contextlib
import copy
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from orchestrator.job.check import check_profile
from orchestrator.profile.config import ConfigError, Role, validate
from orchestrator.profile.plan import Platform

from .conftest import CONF, ROOT, compose_cfg

DOC = ROOT / "docs" / "slurm.md"
SECRET_ENV = "PD_SECRET"
# What docs/slurm.md's recipe puts on the command line besides the role sweep.
SPLIT = ("transport.host=auto", "transport.allow_remote=true", f"transport.secret_env={SECRET_ENV}",
         "transport.bootstrap_file=${hydra:sweep.dir}/bootstrap.json")


def _has_submitit() -> bool:
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401
        import submitit  # noqa: F401
    except ImportError:
        return False
    return True


needs_submitit = pytest.mark.skipif(
    not _has_submitit(),
    reason="hydra-submitit-launcher is not installed (pip install -e '.[slurm]'): "
           "hydra/launcher=slurm and slurm_pd take its schema")


def hydra_cfg(*overrides: str) -> DictConfig:
    """The composed config with its hydra node (hydra.launcher, hydra.sweep, ...)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


@contextlib.contextmanager
def hydra_config_of(cfg: DictConfig):
    """HydraConfig set from `cfg`, as Hydra sets it around a job (`${hydra:...}` resolves
    against it); the previous one restored afterwards."""
    instance = HydraConfig.instance()
    saved = instance.cfg
    instance.set_config(cfg)
    try:
        yield
    finally:
        instance.cfg = saved


@contextlib.contextmanager
def as_job(sweep_cfg: DictConfig):
    """The config the task function gets in a job: HydraConfig set from the job's config
    and the hydra node removed from a copy (hydra.core.utils.run_job)."""
    with hydra_config_of(sweep_cfg):
        task_cfg = copy.deepcopy(sweep_cfg)
        with read_write(task_cfg), open_dict(task_cfg):
            del task_cfg["hydra"]
        yield task_cfg


def launcher_type(cfg: DictConfig) -> str:
    return OmegaConf.get_type(cfg.hydra.launcher).__name__


# ---- the launcher configs ----------------------------------------------------------------------
def test_local_parallel_composes():
    cfg = hydra_cfg("hydra/launcher=local_parallel")
    launcher = cfg.hydra.launcher
    assert launcher_type(cfg) == "JobLibLauncherConf"
    assert launcher._target_.endswith("joblib_launcher.JoblibLauncher")
    assert (launcher.n_jobs, launcher.backend, launcher.prefer) == (2, "loky", "processes")


@needs_submitit
def test_slurm_composes_with_the_plugin_schema(tmp_path):
    cfg = hydra_cfg("hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}")
    launcher = cfg.hydra.launcher
    assert launcher_type(cfg) == "SlurmQueueConf"
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.nodes, launcher.tasks_per_node, launcher.cpus_per_task, launcher.mem_gb) == (1, 1, 4, 16)
    assert launcher.gpus_per_node is None and launcher.timeout_min == 20
    assert launcher.max_num_timeout == 0 and launcher.array_parallelism == 64
    assert launcher.submitit_folder == f"{tmp_path}/.submitit/%j"


@needs_submitit
def test_slurm_pd_composes_with_the_plugin_schema(tmp_path):
    cfg = hydra_cfg("hydra/launcher=slurm_pd", f"hydra.sweep.dir={tmp_path}")
    launcher = cfg.hydra.launcher
    assert launcher_type(cfg) == "SlurmQueueConf"
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher.array_parallelism >= 2  # both sides of a run at once
    assert (launcher.nodes, launcher.tasks_per_node) == (1, 1)  # one node and one orchestrator per side
    assert (launcher.cpus_per_task, launcher.mem_gb, launcher.timeout_min) == (4, 16, 30)
    assert launcher.gpus_per_node is None  # CPU default: host buffers over Mooncake's TCP transport
    assert launcher.max_num_timeout == 0  # a side resubmitted alone has no peer
    assert launcher.partition is None and launcher.account is None
    assert OmegaConf.to_container(launcher.additional_parameters) == {"exclusive": True}
    assert launcher.submitit_folder == f"{tmp_path}/.submitit/%j"
    assert launcher.name == "orchestrator-pd"


@needs_submitit
def test_slurm_pd_takes_settings_from_the_command_line():
    cfg = hydra_cfg("hydra/launcher=slurm_pd", "hydra.launcher.partition=cpu",
                    "hydra.launcher.gpus_per_node=1", "~hydra.launcher.additional_parameters.exclusive",
                    'hydra.launcher.setup=["export PD_SECRET=$(cat ~/.pd_secret)"]')
    launcher = cfg.hydra.launcher
    assert (launcher.partition, launcher.gpus_per_node) == ("cpu", 1)
    assert OmegaConf.to_container(launcher.additional_parameters) == {}
    assert list(launcher.setup) == ["export PD_SECRET=$(cat ~/.pd_secret)"]


@needs_submitit
@pytest.mark.parametrize("override", ["hydra.launcher.nodes=two", "hydra.launcher.array_parallelism=all"])
def test_slurm_pd_is_checked_by_the_plugin_schema(override):
    with pytest.raises(Exception, match="Error merging override") as err:
        hydra_cfg("hydra/launcher=slurm_pd", override)
    assert "could not be converted to Integer" in str(err.value.__cause__)


# ---- each side's config, as a job of the sweep gets it -------------------------------------
@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_each_role_of_the_split_sweep_validates(role, tmp_path):
    with hydra_config_of(hydra_cfg(f"hydra.sweep.dir={tmp_path}")):
        obj = validate(compose_cfg(f"role={role}", *SPLIT))
    assert obj.role is Role(role) and obj.peer is None
    assert obj.transport.bootstrap_file == f"{tmp_path}/bootstrap.json"
    assert (obj.transport.host, obj.transport.allow_remote, obj.transport.secret_env) == (
        "auto", True, SECRET_ENV)
    check_profile(obj, Platform(env={SECRET_ENV: "s3cr3t"}))  # the rule book passes too
    with pytest.raises(ConfigError) as err:  # the secret did not reach the job
        check_profile(obj, Platform(env={}))
    assert err.value.key == "transport.secret_env"


def test_prefill_without_peer_or_bootstrap_file_is_refused():
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("role=prefill", *SPLIT[:3]))
    assert err.value.key == "peer"


def test_the_sweep_dir_is_read_with_the_hydra_resolver(tmp_path):
    """A job's config has no hydra node: `${hydra.sweep.dir}` fails there, the resolver
    form `${hydra:sweep.dir}` (the one docs/slurm.md uses) reads the job's Hydra config."""
    dotted = hydra_cfg(f"hydra.sweep.dir={tmp_path}", "role=decode", *SPLIT[:3],
                       "transport.bootstrap_file=${hydra.sweep.dir}/bootstrap.json")
    with as_job(dotted) as job, pytest.raises(Exception, match="hydra"):
        validate(job)
    resolver = hydra_cfg(f"hydra.sweep.dir={tmp_path}", "role=decode", *SPLIT)
    with as_job(resolver) as job:
        assert validate(job).transport.bootstrap_file == f"{tmp_path}/bootstrap.json"


# ---- the recipe of docs/slurm.md through the sweeper and the plugin ---------------------------
def doc_commands() -> list[str]:
    """Every `python -m orchestrator -m hydra/launcher=slurm_pd ...` command of docs/slurm.md,
    continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOC.read_text())
    prefix = "python -m orchestrator -m hydra/launcher=slurm_pd"
    return [line.strip() for line in text.splitlines() if line.strip().startswith(prefix)]


class _Submitted(Exception):
    """Raised where submitit would run sbatch."""


def _task(cfg):  # the sweep's task function; never runs here (it only has to pickle)
    raise AssertionError("no job runs in these tests")


def sweep_until_sbatch(overrides: list[str], monkeypatch) -> tuple[str, list[DictConfig]]:
    """Run `python -m orchestrator -m OVERRIDES` as Hydra does (compose in MULTIRUN mode, the
    configured sweeper, the configured launcher's launch()) until submitit calls sbatch.
    Returns the sbatch script and each job's config as the plugin builds it on the node
    (ConfigLoader.load_sweep_config)."""
    import submitit.slurm.slurm as slurm
    from hydra._internal.callbacks import Callbacks
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode

    scripts: list[str] = []

    def submit(self, command):
        scripts.append(self._make_submission_file_text(command, "test"))
        raise _Submitted

    monkeypatch.setattr(slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # as if srun exists
    monkeypatch.setattr(slurm.SlurmExecutor, "_submit_command", submit)
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        gh = GlobalHydra.instance().hydra
        master = gh.compose_config("config", [*overrides, "hydra.mode=MULTIRUN"],
                                   run_mode=RunMode.MULTIRUN, from_shell=False)
        sweeper = Plugins.instance().instantiate_sweeper(
            config=master, task_function=_task,
            hydra_context=HydraContext(config_loader=gh.config_loader, callbacks=Callbacks()))
        arguments = OmegaConf.to_container(master.hydra.overrides.task, resolve=False)
        with pytest.raises(_Submitted):
            sweeper.sweep(arguments=arguments)
        jobs = type(sweeper).split_arguments(OverridesParser.create().parse_overrides(arguments), None)[0]
        configs = [gh.config_loader.load_sweep_config(master, list(job)) for job in jobs]
    assert len(scripts) == 1, "one sbatch call: the sweep is one job array"
    return scripts[0], configs


def test_the_doc_has_the_recipe():
    commands = doc_commands()
    assert len(commands) >= 2
    assert "'transport.bootstrap_file=${hydra:sweep.dir}/bootstrap.json'" in commands[0]
    for part in ("role=decode,prefill", *SPLIT[:3]):
        assert part in commands[0].split()


@needs_submitit
@pytest.mark.parametrize("command", doc_commands(),
                         ids=[f"doc-command-{i}" for i in range(len(doc_commands()))])
def test_doc_recipe_launches_one_array_and_every_job_validates(command, tmp_path, monkeypatch):
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "orchestrator", "-m"]
    overrides = [arg.replace("$SWEEP", str(tmp_path)) for arg in argv[4:]]
    script, configs = sweep_until_sbatch(overrides, monkeypatch)

    n = len(configs)
    lines = set(script.splitlines())
    assert f"#SBATCH --array=0-{n - 1}%{n}" in lines  # every job of the sweep at once
    for flag in ("--nodes=1", "--ntasks-per-node=1", "--exclusive", "--cpus-per-task=4",
                 "--mem=16GB", "--time=30", "--job-name=orchestrator-pd",
                 f"--output={tmp_path}/.submitit/%A_%a/%A_%a_0_log.out"):
        assert f"#SBATCH {flag}" in lines
    assert not any("gpu" in line for line in lines)
    assert (tmp_path / "multirun.yaml").is_file()

    pairs: dict[str, list[str]] = {}
    roles = []
    for cfg in configs:
        assert cfg.hydra.sweep.dir == str(tmp_path)
        with as_job(cfg) as job:
            obj = validate(job)
        check_profile(obj, Platform(env={SECRET_ENV: "s3cr3t"}))
        assert (obj.transport.host, obj.transport.allow_remote, obj.transport.secret_env) == (
            "auto", True, SECRET_ENV)
        assert obj.peer is None and obj.endpoints.startup_timeout_s == 600
        path = Path(obj.transport.bootstrap_file)
        assert path.parent == tmp_path
        pairs.setdefault(path.name, []).append(obj.role.value)
        roles.append(obj.role)
    # one decode and one prefill per bootstrap file; the decode jobs come first (job 0, ...)
    assert all(sorted(sides) == ["decode", "prefill"] for sides in pairs.values())
    assert roles == [Role.decode] * (n // 2) + [Role.prefill] * (n // 2)


def test_heterogeneous_job_script_is_valid_bash(tmp_path):
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    script = [b for b in blocks if "#SBATCH hetjob" in b]
    assert len(script) == 1
    text = script[0]
    for part in ("srun --het-group=0", "srun --het-group=1", "role=decode", "role=prefill",
                 'peer="$DECODE_IP:$PORT"', "transport.secret_env=PD_SECRET",
                 '"$PY" -m orchestrator.report'):
        assert part in text
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash here")
    path = tmp_path / "pd-het.sbatch"
    path.write_text(text)
    subprocess.run([bash, "-n", str(path)], check=True, capture_output=True, timeout=10)

"""A sweep over the files of a --config-dir, some of which cannot be composed (not YAML, an
unknown key, a wrong type): those files fail only the jobs that pick them. Their values are
taken out of the sweep before Hydra starts, the other jobs run, and each job that picked a bad
file is a refused row of the sweep (results.json with the one line naming file and key).

A file every value of a key fails on, or one the sweep does not choose (the dir's config.yaml,
a choice not swept), still refuses the whole sweep before start (compose.precheck)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import yaml

from orchestrator.job import failure
from orchestrator.job.failure import RefusedJob
from orchestrator.preflight.compose import (
    ProfileError,
    cli_overrides,
    config_dirs,
    hydra_args,
    load_profile,
    yaml_problem,
)
from orchestrator.results import reporting
from orchestrator.results.rundir import write_atomic
from orchestrator.results.schema import NotRun


def _choice_files(dirs: Sequence[Path], key: str, value: str) -> list[Path]:
    return [p for d in dirs for p in (d / key / f"{value}.yaml", d / key / f"{value}.yml") if p.is_file()]


def choice_problem(dirs: Sequence[Path], key: str, value: str, fixed: Sequence[str]) -> Optional[str]:
    """Why the config-dir file that `key=value` picks cannot be composed (with the sweep's fixed
    overrides), when the line names that file; None if it composes or the fault is elsewhere."""
    files = _choice_files(dirs, key.lstrip("+~"), value)
    if not files:
        return None
    names = {str(p) for f in files for p in (f, f.resolve())}
    for d in dirs:
        problem = yaml_problem(d, [f"{key}={value}"])
        if problem is not None:
            return problem if any(problem.startswith(n) for n in names) else None
    try:
        load_profile([*fixed, f"{key}={value}"], dirs)
    except ProfileError as exc:
        return str(exc) if any(str(exc).startswith(n) for n in names) else None
    return None


def split_sweep(argv: Sequence[str]) -> tuple[list[str], list[RefusedJob]]:
    """argv with every swept config-dir choice that cannot be composed taken out of its sweep,
    and one RefusedJob per job of the whole sweep that picked one (Hydra's job order). argv
    unchanged, and no job, where nothing is bad, where it is not a sweep over a config dir's
    files, or where every value of a key is bad (then precheck refuses the whole sweep)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        multirun = hydra_args(argv).multirun
    except ProfileError:
        return list(argv), []
    overrides, dirs = cli_overrides(argv), config_dirs(argv)
    if not multirun or not overrides or not dirs:
        return list(argv), []
    ours = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        parsed = OverridesParser.create().parse_overrides(ours)
    except Exception:  # noqa: BLE001 - a syntax error: precheck says it
        return list(argv), []
    fixed = [text for text, o in zip(ours, parsed) if not o.is_sweep_override()]
    bad: dict[str, str] = {}  # "key=value" of a bad choice -> why
    kept: dict[str, str] = {}  # the override's text -> the same sweep without its bad values
    for text, o in zip(ours, parsed):
        key = text.split("=", 1)[0]
        if not o.is_sweep_override() or "." in key or "/" in key:
            continue
        try:
            values = [str(v) for v in o.sweep_string_iterator()]
        except Exception:  # noqa: BLE001 - a range or glob: Hydra expands it itself
            continue
        why = {v: choice_problem(dirs, key, v, fixed) for v in values}
        good = [v for v in values if why[v] is None]
        if not good:
            return list(argv), []  # every value fails: the whole sweep is refused
        if len(good) < len(values):
            bad.update({f"{key}={v}": w for v, w in why.items() if w is not None})
            kept[text] = f"{key}={','.join(good)}"
    if not bad:
        return list(argv), []
    jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    first = sum(1 for job in jobs if not any(o in bad for o in job))
    refused = [job for job in jobs if any(o in bad for o in job)]
    out = [RefusedJob(first + i, tuple(job), next(bad[o] for o in job if o in bad))
           for i, job in enumerate(refused)]
    return [kept.get(a, a) for a in argv], out


def write_refused(sweep_dir: Path, jobs: Sequence[RefusedJob]) -> None:
    """Each refused job's dir: its overrides and a results.json that says why (exit 2)."""
    for job in jobs:
        job_dir = Path(sweep_dir) / str(job.num)
        (job_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        write_atomic(job_dir / ".hydra" / "overrides.yaml", yaml.safe_dump(list(job.overrides)))
        code = failure.ending(failure.Refusal(job.error)).code
        reporting.write(job_dir, NotRun(code, job.error, refused=job.error))

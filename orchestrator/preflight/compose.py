"""Loading a profile outside the main app (doctor, export_env, the bench, and the main
entry's check of Hydra's own errors): compose conf/ with overrides exactly as the CLI does,
validate, and turn anything Hydra, OmegaConf or validate rejects into one line.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence

from orchestrator.job import failure
from orchestrator.profile.config import CONF_DIR, ConfigError, OrchestratorConfig, register_configs, validate


class ProfileError(Exception):
    """The profile cannot be composed or validated; str() is one line for `error: ...`."""


def config_keys() -> list[str]:
    """Every key of the schema, dotted (buffers.size, transport.mooncake.transport, ...)."""
    from orchestrator.profile.keys import schema_keys

    return [k.name for k in schema_keys()]


def closest_key(key: str) -> Optional[str]:
    import difflib

    keys = config_keys()
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not match:  # a typo in the last part only: compare within the group
        group, _, leaf = key.rpartition(".")
        names = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == group}
        near = difflib.get_close_matches(leaf, list(names), n=1, cutoff=0.5)
        match = [names[near[0]]] if near else []
    return match[0] if match else None


def _no_append_hint(text: str) -> str:
    """Hydra answers a misspelt key with "To append to your config use +KEY=V", which only
    leads to the next error (the schema has no such key): name the closest real key instead."""
    import re

    m = re.search(r"To append to your config use \+([\w.]+)=\S*", text)
    if m is None:
        return text
    near = closest_key(m.group(1))
    hint = f"There is no key {m.group(1)}" + (f"; did you mean {near}?" if near else "")
    return text[:m.start()] + hint + text[m.end():]


def ambiguous(override: str) -> str:
    """The line for KEY=A,B where no sweep is asked for (Hydra's own message is five lines
    that end in a hint to set HYDRA_FULL_ERROR)."""
    key, _, value = override.partition("=")
    return (f"{override} is ambiguous: a sweep over {value} needs -m (python -m orchestrator -m "
            f"{override}), a list is {key}=[{value}], a string {key}='{value}'")


def _ambiguous_hint(text: str) -> str:
    import re

    m = re.match(r"Ambiguous value for argument '([^']*)'", text)
    return ambiguous(m.group(1)) if m else text


def one_line(exc: BaseException) -> str:
    return _ambiguous_hint(_no_append_hint(_one_line(exc)))


def _one_line(exc: BaseException) -> str:
    """A Hydra / OmegaConf / ConfigError message as one line: option lists joined with commas,
    Hydra's search-path and documentation-link lines dropped, the cause's first line added."""
    parts: list[str] = []
    for raw in str(exc).splitlines():
        line = raw.strip()
        if raw.startswith("Config search path"):
            break
        if not line or line.startswith("See https://hydra.cc"):
            continue
        if raw.startswith("\t") and parts and not parts[-1].endswith(":"):
            parts[-1] += f", {line}"  # another option of a list
        elif raw.startswith("\t") and parts:
            parts[-1] += f" {line}"  # the first option after "Available options in ...:"
        else:
            parts.append(line)
    text = ""
    for part in parts:
        text += part if not text else (" " if text.endswith((".", ":")) else "; ") + part
    text = text or type(exc).__name__
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        text += f": {str(cause).strip().splitlines()[0].strip()}"
    return text


def load_profile(overrides: Sequence[str], config_dirs: Sequence[Path] = (),
                 resolve: bool = False) -> OrchestratorConfig:
    """Compose conf/ with `overrides` (as tests/conftest.py does) and validate it (with
    `resolve`: host and seed resolved first, as the run does); the directories of
    --config-dir join the search path as they do on the command line.

    Raises ProfileError with a one-line message for anything Hydra or validate rejects; a
    mistake in a file of a config dir names the file and the key.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    dirs = [Path(d).resolve() for d in config_dirs]
    for d in dirs:  # before Hydra reads a file of them: size and aliases bounded
        problem = dir_bounds(d)
        if problem is not None:
            raise ProfileError(problem)
    extra = [f"hydra.searchpath=[{','.join(f'file://{d}' for d in dirs)}]"] if dirs else []
    used: list[Path] = []
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            cfg = compose(config_name="config", overrides=list(overrides) + extra, return_hydra_config=bool(dirs))
        if dirs:
            used = _used_files(dirs, cfg.hydra.runtime.choices)
            from omegaconf import OmegaConf

            cfg = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])
        return validate(cfg, resolve)
    except ConfigError as exc:
        raise ProfileError(in_file(exc, used, overrides)) from None
    except Exception as exc:  # noqa: BLE001 - Hydra/OmegaConf errors: one line, no traceback
        raise ProfileError(_composed_in(exc, dirs) or one_line(exc)) from None
    finally:
        GlobalHydra.instance().clear()


def composed_defaults() -> dict[str, Any]:
    """Every key's default as a run without overrides gets it: the composed conf/, dotted key
    -> value (profile.keys.keys: --help's defaults)."""
    from operator import attrgetter

    from orchestrator.profile.keys import schema_keys

    cfg = load_profile([])
    return {k.name: attrgetter(k.name)(cfg) for k in schema_keys()}


def _used_files(dirs: Sequence[Path], choices: Any) -> list[Path]:
    """The files of `dirs` a composed profile read: GROUP/CHOICE.yaml for each choice."""
    out = []
    for group, choice in (choices or {}).items():
        if choice is None or str(group).startswith("hydra/"):
            continue
        for d in dirs:
            for ext in (".yaml", ".yml"):
                path = d / str(group) / f"{choice}{ext}"
                if path.is_file():
                    out.append(path)
    return out


def _sets(path: Path, key: str) -> bool:
    """Whether the YAML file `path` sets dotted `key` (as a _global_ package, or under its
    group's own package)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    text = path.read_text()
    parts = key.split(".")
    if "@package _global_" not in text and parts and parts[0] == path.parent.name:
        parts = parts[1:]
    for part in parts:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def in_file(exc: ConfigError, used: Sequence[Path], overrides: Sequence[str] = ()) -> str:
    """A validate / rule-book refusal, prefixed with the config-dir file that set its key
    (unless the command line set it: that value won)."""
    if any(o.lstrip("+~").partition("=")[0] == exc.key for o in overrides):
        return str(exc)
    for path in used:
        if _sets(path, exc.key):
            return f"{path}: {exc}"
    return str(exc)


def job_refusal(exc: ConfigError, runtime: Any, overrides: Sequence[str]) -> str:
    """A running job's refusal (a sweep's row), prefixed with the --config-dir file that set
    its key, as precheck names it: `runtime` is the job's hydra.runtime."""
    dirs = [Path(str(s.path)) for s in runtime.config_sources
            if s.schema == "file" and s.provider != "main"]
    return in_file(exc, _used_files(dirs, runtime.choices), overrides)


def _composed_in(exc: BaseException, dirs: Sequence[Path]) -> Optional[str]:
    """Hydra's "In 'GROUP/NAME': ... full_key: KEY" about a file of a config dir, as one
    line naming the file and the key, else None."""
    import re

    text = str(exc)
    m = re.search(r"In '([^']+)': \w+ raised while composing config:\n(.+)", text)
    if m is None:
        return None
    name, detail = m.group(1), m.group(2).strip()
    path = next((d / f"{name}{ext}" for d in dirs for ext in (".yaml", ".yml") if (d / f"{name}{ext}").is_file()),
                None)
    if path is None:
        return None
    key = re.search(r"full_key: (\S+)", text)
    return f"{path}: {key.group(1) + ': ' if key else ''}{detail}"


def profile_label(overrides: Sequence[str]) -> str:
    return shlex.join(overrides) if overrides else "(defaults)"


def overrides_dict(overrides: Sequence[str]) -> dict[str, Optional[str]]:
    """{"mem_pool": "NVLINK", ...} for the JSON output (a bare key maps to None)."""
    out: dict[str, Optional[str]] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        out[key] = value if sep else None
    return out


def error_exit(message: str) -> NoReturn:
    """Refused: `message` on one line (`error: ...`), exit 2 (job.failure's table)."""
    failure.leave(failure.Refusal(" ".join(message.split())))


# ---- the main command line's overrides, checked before Hydra runs anything -------------------
_WITH_VALUE = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name",
               "-cd", "--config-dir", "--experimental-rerun", "-sc", "--shell-completion"}
_OTHER_CONFIG = {"-cp", "--config-path", "-cn", "--config-name", "--experimental-rerun"}


def cli_overrides(argv: Sequence[str]) -> Optional[list[str]]:
    """The Hydra overrides on a command line, or None when it names another primary config
    (a replay's saved config, for one: Hydra checks that itself)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in _OTHER_CONFIG:
            return None
        if arg in _WITH_VALUE:
            skip = True
        elif flag in _WITH_VALUE:  # --config-dir=DIR
            continue
        elif not arg.startswith("-") and ("=" in arg or arg.startswith("~")):
            out.append(arg)
    return out


def config_dirs(argv: Sequence[str]) -> list[Path]:
    """The directories --config-dir / --config-path (and -cd / -cp) name."""
    out, want = [], False
    for arg in argv:
        flag, sep, value = arg.partition("=")
        if want:
            out.append(Path(arg))
            want = False
        elif flag in ("-cd", "--config-dir", "-cp", "--config-path"):
            if sep:
                out.append(Path(value))
            else:
                want = True
    return out


def _named_files(directory: Path, overrides: Sequence[str]) -> list[Path]:
    """The files of a config dir that `overrides` pick (GROUP=NAME, +GROUP=NAME; every
    value of a sweep), and the dir's own config.yaml: the ones a run would read first."""
    out = [directory / "config.yaml"]
    for o in overrides:
        key, sep, value = o.lstrip("+~").partition("=")
        if not sep or "." in key:
            continue
        for name in value.split(","):
            out += [directory / key / f"{name.strip()}.yaml", directory / key / f"{name.strip()}.yml"]
    return [p for p in out if p.is_file()]


MAX_CONFIG_BYTES = 1 << 20
"""A config-dir YAML file over this many bytes is refused before anything parses it."""
MAX_ALIASES = 100
"""YAML alias uses (*name, <<: *name) a config-dir file may have."""
MAX_NODES = 100_000
"""Nodes a config-dir file may build once its aliases are expanded (what OmegaConf builds: a
362-byte file of nested aliases would expand to 9^9 nodes)."""


def _yaml_walk(path: Path) -> Optional[str]:
    """The alias budget of a file of at most MAX_CONFIG_BYTES, read as a stream of YAML events
    (no document is built): stops at the first alias over MAX_ALIASES, or once the expanded
    node count passes MAX_NODES. A YAML syntax error is yaml_problem's to name: None here."""
    import yaml

    parser = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    sizes: dict[str, int] = {}  # anchor -> its node's expanded size
    open_nodes: list[list] = []  # per open collection: [anchor, expanded size so far]
    aliases = nodes = 0
    with open(path, "rb") as stream:
        try:
            for event in yaml.parse(stream, Loader=parser):
                size = 0
                if isinstance(event, yaml.AliasEvent):
                    aliases += 1
                    if aliases > MAX_ALIASES:
                        return f"{path}: more than {MAX_ALIASES} YAML aliases (a config file may use {MAX_ALIASES})"
                    size = sizes.get(str(event.anchor), 1)
                elif isinstance(event, yaml.ScalarEvent):
                    size = 1
                    if event.anchor is not None:
                        sizes[str(event.anchor)] = 1
                elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                    open_nodes.append([event.anchor, 1])
                    nodes += 1
                elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)) and open_nodes:
                    anchor, done = open_nodes.pop()
                    if anchor is not None:
                        sizes[str(anchor)] = done
                    if open_nodes:
                        open_nodes[-1][1] += done
                    continue
                nodes += size
                if open_nodes and size:
                    open_nodes[-1][1] += size
                if nodes > MAX_NODES:
                    what = f"its {aliases} YAML aliases expand to" if aliases else "it holds"
                    return f"{path}: {what} more than {MAX_NODES:,} nodes (a config file may build {MAX_NODES:,})"
        except yaml.YAMLError:
            return None
    return None


_BOUNDS: dict[tuple[str, int, int, int], Optional[str]] = {}  # (path, inode, size, mtime) -> why


def yaml_bounds(path: Path) -> Optional[str]:
    """Why the config file `path` is refused before any parser reads it, else None: not a
    regular file (a FIFO would hang the read), over MAX_CONFIG_BYTES (by stat: a 50 MB file
    is never read), or YAML aliases over their budget (an event scan that stops early)."""
    import stat

    try:
        st = path.stat()
    except OSError as exc:
        return f"{path}: cannot be read ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return f"{path}: not a regular file (a config file must be one)"
    if st.st_size > MAX_CONFIG_BYTES:
        return (f"{path}: {st.st_size:,} bytes, over the {MAX_CONFIG_BYTES:,} (1 MiB) a config file "
                "may have")
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _BOUNDS:
        try:
            _BOUNDS[key] = _yaml_walk(path)
        except OSError as exc:
            return f"{path}: cannot be read ({exc.strerror})"
    return _BOUNDS[key]


def _yaml_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.yaml")) + sorted(directory.rglob("*.yml"))


def dir_bounds(directory: Path) -> Optional[str]:
    """The first YAML file under a config dir over its bounds (yaml_bounds), else None: every
    file, since a defaults list can pull in one the command line does not name."""
    if not directory.is_dir():
        return None
    for path in _yaml_files(directory):
        problem = yaml_bounds(path)
        if problem is not None:
            return problem
    return None


def yaml_problem(directory: Path, overrides: Optional[Sequence[str]] = None) -> Optional[str]:
    """The first YAML file under `directory` that does not parse, as one line naming the
    file and the line (Hydra would print a traceback for it), else None. With `overrides`,
    only the files they pick: a bad file fails only the runs that use it."""
    import yaml

    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        return f"--config-dir {directory}: {what} (a directory of YAML configs)"
    paths = (_named_files(directory, overrides) if overrides is not None else
             sorted(directory.rglob("*.yaml")) + sorted(directory.rglob("*.yml")))
    for path in paths:
        bounds = yaml_bounds(path)
        if bounds is not None:
            return bounds
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[:exc.start].count(b"\n") + 1
            return f"{path}:{line}: not UTF-8 text (byte {exc.start} is 0x{raw[exc.start]:02x})"
        try:
            yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            return f"{where}: not valid YAML ({problem})"
    return None


_MODES = (("run", "--run"), ("multirun", "-m"), ("cfg", "--cfg"), ("info", "--info"),
          ("shell_completion", "--shell-completion"))


class _ArgError(Exception):
    pass


def hydra_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line as Hydra's own parser reads it; ProfileError (one line) for what it
    or Hydra would refuse with a usage text or a traceback: an unknown flag, two modes at
    once (--cfg with -m), --resolve without --cfg."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def fail(message: str) -> None:
        raise _ArgError(message)

    setattr(parser, "error", fail)  # noqa: B010 - argparse prints usage and exits otherwise
    try:
        args = parser.parse_args(list(argv))
    except _ArgError as exc:
        raise ProfileError(f"{exc} (--help lists the flags and keys)") from None
    modes = [flag for dest, flag in _MODES if getattr(args, dest) not in (None, False)]
    if len(modes) > 1:
        hint = (" (--cfg job with the values of one job, without -m, prints what that job gets)"
                if {"-m", "--cfg"} <= set(modes) else "")
        raise ProfileError(f"{' and '.join(modes)} cannot be given together: one of --run, -m, --cfg, "
                           f"--info, --shell-completion{hint}")
    if args.resolve and args.cfg is None and not args.help:
        raise ProfileError("--resolve goes with --cfg (or --help)")
    return args


def flags_first(argv: Sequence[str]) -> list[str]:
    """The command line with Hydra's flags (and their values) before every override, as
    Hydra's parser needs them: `KEY=V --cfg job` and `--cfg job KEY=V` (and an override the
    entry adds after a trailing flag) mean the same; the order within each kind is kept."""
    from hydra._internal.utils import get_args_parser

    actions = {s: a for a in get_args_parser()._actions for s in a.option_strings}
    flags: list[str] = []
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        action = actions.get(arg)
        if action is None or not arg.startswith("-"):
            (flags if arg.startswith("-") else rest).append(arg)
        else:
            flags.append(arg)
            takes = action.nargs is None or (action.nargs == "?" and i + 1 < len(args)
                                              and args[i + 1] in (action.choices or ()))
            if takes and i + 1 < len(args):
                flags.append(args[i + 1])
                i += 1
        i += 1
    return flags + rest


# conf/config.yaml's hydra.run.dir and hydra.sweep.dir (a run without the override writes there)
_OUTPUT_DIRS = {"hydra.run.dir": "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S-%f}",
                "hydra.sweep.dir": "outputs/multirun/${now:%Y-%m-%d}/${now:%H-%M-%S-%f}"}


def output_dir_problem(key: str, value: str) -> Optional[str]:
    """Why Hydra could not create the output dir `value` of `key` (hydra.run.dir,
    hydra.sweep.dir): a part of it that is not a directory, or a directory that cannot be
    written (/proc, a read-only mount, no permission), as one line; else None. Only the part
    before its first ${...} is probed, by creating and removing a scratch dir: nothing is left."""
    import os
    import tempfile

    static = value.split("${", 1)[0]
    path = Path(static.rsplit("/", 1)[0] if "${" in value else static or ".")
    path = Path(os.path.abspath(path if str(path) else "."))
    probe = path
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        what = (f"{probe} is not a directory" if probe == path else
                f"{probe} is not a directory, so {path} cannot be made")
        return f"{key}={value}: {what}"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=probe))
    except OSError as exc:
        return f"{key}={value}: cannot create a directory in {probe} ({exc.strerror or exc})"
    return None


def _files_problem(overrides: Optional[list[str]], dirs: list[Path], sweep: bool = False) -> Optional[str]:
    """A --config-dir YAML file that does not parse (only those the run reads), an output dir
    Hydra could not create (run dir or sweep dir: not a directory, not writable), or a run dir
    another live run holds (before Hydra writes into it)."""
    for directory in dirs:
        problem = yaml_problem(directory, overrides) or dir_bounds(directory)
        if problem is not None:
            return problem
    given = {o.lstrip("+").partition("=")[0]: o.partition("=")[2] for o in overrides or ()}
    for key in ("hydra.sweep.dir",) if sweep else ("hydra.run.dir",):
        problem = output_dir_problem(key, given.get(key, _OUTPUT_DIRS[key]))
        if problem is not None:
            return problem if key in given else f"{problem} (the default; set {key}=DIR to write elsewhere)"
    for o in overrides or ():
        if o.startswith("hydra.run.dir=") and "${" not in o:
            from orchestrator.results.rundir import run_dir_busy

            busy = run_dir_busy(Path(o.split("=", 1)[1]))
            if busy is not None:
                return busy
    return None


def precheck(argv: Sequence[str], rules: bool = True) -> Optional[str]:
    """One line naming what Hydra or validate would refuse in these overrides, else None.
    Every value of a sweep (a=1,2) is checked, each with the others at their first value. A
    single run also goes through the rule book here (a sweep's refused job is a row; --cfg,
    --info and --help only compose, and so does `rules=False`: does it parse at all). YAML
    files of a --config-dir that do not parse are named with their line: only those the run
    reads (a bad file fails only the runs that use it); a mistake in one names the file and
    the key."""
    try:
        args = hydra_args(argv)
    except ProfileError as exc:
        return str(exc)
    if args.experimental_rerun is not None:  # Hydra unpickles it: code, from whoever wrote the file
        return (f"--experimental-rerun {args.experimental_rerun} is not supported: Hydra would unpickle "
                "the file (code runs as it loads); python -m orchestrator.replay RUN_DIR re-runs a run "
                "dir from its task config, read as data")
    if args.help or args.hydra_help or args.shell_completion:
        return None
    overrides = cli_overrides(argv)
    dirs = config_dirs(argv)
    problem = None if args.cfg or args.info else _files_problem(overrides, dirs, sweep=args.multirun)
    if problem is not None:
        return problem
    if overrides is None or any("${hydra:" in o for o in overrides):
        return None  # another primary config, or values only a running job can resolve
    from hydra.core.override_parser.overrides_parser import OverridesParser

    ours = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        parsed = OverridesParser.create().parse_overrides(ours)
    except Exception as exc:  # noqa: BLE001 - a syntax error in an override
        return one_line(exc)
    choices = []
    for text, override in zip(ours, parsed):
        if override.is_sweep_override() and not args.multirun:
            return ambiguous(text)
        if override.is_sweep_override():
            key = text.split("=", 1)[0]
            try:
                choices.append([f"{key}={v}" for v in override.sweep_string_iterator()])
            except Exception:  # noqa: BLE001 - a range or glob sweep: Hydra expands it itself
                return None
        else:
            choices.append([text])
    base = [c[0] for c in choices]
    combos = [base] + [base[:i] + [v] + base[i + 1:] for i, c in enumerate(choices) for v in c[1:]]
    one = len(combos) == 1 and not args.multirun and args.cfg is None and args.info is None
    return _composes(combos, dirs, one, rules and one)


def _composes(combos: list[list[str]], dirs: list[Path], one: bool, rules: bool) -> Optional[str]:
    """precheck's last step: what composing each combination of overrides refuses (`one`: the
    only job, its host resolved as the run does), then (`rules`) what the rule book refuses in
    the last one, named in the file that set it; None when nothing is."""
    for combo in combos:
        try:
            cfg = load_profile(combo, dirs, resolve=one)
        except ProfileError as exc:
            return str(exc)
    if rules:
        from orchestrator.job.check import check_profile
        from orchestrator.profile.platform import detect

        base = combos[0]
        try:
            check_profile(cfg, detect())
        except ConfigError as exc:
            return in_file(exc, [f for d in dirs for f in _named_files(d, base)], base)
    return None

class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage mistake said as every refusal is: one `error:` line, exit 2."""

    def error(self, message: str) -> NoReturn:
        error_exit(f"{message} ({self.prog} --help lists the flags)")
        raise AssertionError("unreachable")


def profile_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An argument parser whose positional arguments are the Hydra overrides of a profile."""
    parser = OneLineParser(prog=prog, description=description)
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides selecting the profile, e.g. mem_pool=INTRA_NODE_NVLINK")
    return parser


def _one_repository_for_help() -> None:
    """Hydra's --help lists every config group's options, each through a fresh copy of the
    whole config repository (copy.deepcopy: 100 of them, 2-4 s of a --help); the listing
    reads the same search path with the same overrides every time, so --help reuses one."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    made = ConfigLoaderImpl._parse_overrides_and_create_caching_repo
    seen: dict[Any, Any] = {}

    def once(self: Any, config_name: Optional[str], overrides: list[str]) -> Any:
        key = (id(self), config_name, tuple(overrides))
        if key not in seen:
            seen[key] = made(self, config_name, overrides)
        return seen[key]

    setattr(ConfigLoaderImpl, "_parse_overrides_and_create_caching_repo", once)  # noqa: B010 - --help only


def hydra_command(main: Callable[[], Any], argv: Sequence[str], started: Callable[[], bool],
                  checked: Optional[Callable[[argparse.Namespace], None]] = None) -> None:
    """How a Hydra command (python -m orchestrator, orchestrator.bench) starts: anything
    Hydra or the rule book would refuse is one `error:` line and exit 2 before Hydra writes
    a run dir; --help adds every key with its default and meaning (profile.keys); Hydra's
    own exit 1 before `started()` (a refusal precheck did not foresee) becomes 2."""
    sys.argv[1:] = flags_first(sys.argv[1:])  # --cfg/--help in any position, as Hydra's own
    argv = flags_first(argv)
    problem = precheck(argv)
    if problem is not None:  # Hydra's own errors too: one line, exit 2, nothing started
        error_exit(problem)
    if checked is not None:  # the command line passed: what a run needs may start (warmstart)
        checked(hydra_args(argv))
    asked_help = "--help" in argv or "-h" in argv
    if asked_help:
        _one_repository_for_help()
    try:
        main()
    except SystemExit as exc:
        if asked_help and exc.code in (0, None):
            from orchestrator.profile.keys import help_text, keys

            print("\n" + help_text(keys(composed_defaults())), flush=True)
        mapped = failure.hydra_exit(exc, started())
        if mapped is not exc:
            raise mapped from None
        raise

"""`python -m orchestrator.export_env [overrides] [--format sh|json] [--assume-gpus N]`: the
environment a serving engine (SGLang on Mooncake) needs to reproduce a profile.

The profile is composed and validated like the main CLI does, judged by the rule book
(:func:`orchestrator.job.check.check_profile`, which the run and the doctor apply too) against
this machine, or with ``--assume-gpus N`` against N CUDA devices and a CUDA Mooncake build
(so a GPU profile can be exported from a laptop), and mapped by the pure
:func:`orchestrator.preflight.serving.serving_env`.

``--format sh`` (default) prints a comment naming the profile, then ``export NAME=value``
lines and ``unset NAME`` lines, each group sorted by name, values shell-quoted; apply them
with ``eval "$(python -m orchestrator.export_env ...)"``. ``--format json`` prints
``{"set": {...}, "unset": [...]}``. A profile that cannot be composed, validated or planned
(e.g. INTRA_NODE_NVLINK on a CPU box under ``fallback=strict``) prints one ``error: ...``
line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from typing import Optional, Sequence

from orchestrator.job.check import check_profile
from orchestrator.preflight.compose import ProfileError, error_exit, load_profile, profile_label, profile_parser
from orchestrator.preflight.serving import serving_env
from orchestrator.profile.config import ConfigError
from orchestrator.profile.plan import Plan, Platform


def assumed_platform(gpus: int) -> Platform:
    """A machine with `gpus` CUDA devices and a CUDA Mooncake build; this shell's environment."""
    return Platform(cuda_devices=gpus, mooncake_cuda=True, env=dict(os.environ))


def split_env(env: dict[str, Optional[str]]) -> tuple[dict[str, str], list[str]]:
    """(variables to export, sorted by name; names to unset, sorted)."""
    to_set = {k: v for k, v in sorted(env.items()) if v is not None}
    to_unset = sorted(k for k, v in env.items() if v is None)
    return to_set, to_unset


def render_sh(env: dict[str, Optional[str]], header: str) -> str:
    to_set, to_unset = split_env(env)
    lines = [f"# {' '.join(header.split())}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in to_set.items()]
    lines += [f"unset {k}" for k in to_unset]
    return "\n".join(lines)


def render_json(env: dict[str, Optional[str]]) -> str:
    to_set, to_unset = split_env(env)
    return json.dumps({"set": to_set, "unset": to_unset}, indent=2)


def header_for(overrides: Sequence[str], plan: Plan, gpus: Optional[int]) -> str:
    where = (f"planned for {gpus} GPU(s) and a CUDA Mooncake build" if gpus is not None
             else "planned on this machine")
    text = (f"serving env for profile: {profile_label(overrides)}; {where}; buffers on "
            f"{plan.buffer_device.value}, route {plan.route.value} ({plan.route_reason.value}), "
            f"transport {plan.declared_transport}")
    for event in plan.events:
        text += f"; {event.event}: {event.detail}"
    return text


def _gpus(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is below 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line (main's; tests/test_docs.py parses every documented command with it)."""
    parser = profile_parser(
        "python -m orchestrator.export_env",
        "Print the environment a serving engine (SGLang on Mooncake) needs to reproduce "
        "a profile. Exit 2 when the profile cannot be composed, validated or planned.")
    parser.add_argument("--format", choices=("sh", "json"), default="sh",
                        help="sh: export/unset lines (default); json: {\"set\": {...}, \"unset\": [...]}")
    parser.add_argument("--assume-gpus", type=_gpus, metavar="N", default=None,
                        help="plan for a machine with N CUDA devices and a CUDA Mooncake build "
                             "instead of detecting this one")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_profile(args.overrides)
    except ProfileError as exc:
        error_exit(str(exc))
    gpus = args.assume_gpus
    if gpus is not None:
        platform = assumed_platform(gpus)
    else:
        from orchestrator.profile.platform import detect

        platform = detect()
    try:
        plan = check_profile(cfg, platform)
    except ConfigError as exc:
        message = str(exc)
        if gpus is None:
            try:  # would a GPU machine plan it? then say how to export it from here
                check_profile(cfg, assumed_platform(8))
                message += " (to export it for a GPU machine from here, add --assume-gpus N)"
            except ConfigError:
                pass
        error_exit(message)
    env = serving_env(plan)
    if args.format == "json":
        print(render_json(env))
    else:
        print(render_sh(env, header_for(args.overrides, plan, args.assume_gpus)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What each side runs (the Mooncake wheel and its version, torch, the SGLang aux layout, this
tool's version), and what a skew between a prefill's and a decode's means.

Both sides send :func:`local` at bootstrap; :func:`skew` judges the pair: a FAIL where a known
incompatibility applies, a WARN for any other difference. ``doctor`` prints this side's as one
line (:func:`as_text`), which the other side's ``doctor --peer-versions`` reads back
(:func:`from_text`).

The known incompatibility: Mooncake sessions between a side on Mooncake < 0.3.11 and a side on
0.3.11 or later fail with "Failed to get segment descriptor" (reported as SGLang #26008 and
Mooncake #2177, after one side of a running deployment was upgraded).
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass, fields, replace
from typing import Optional

MOONCAKE_WHEELS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13",
                   "mooncake-transfer-engine")
KEYS = ("mooncake_wheel", "mooncake", "torch", "layout", "orchestrator")
SEGMENT_DESCRIPTOR_BREAK = (0, 3, 11)  # Mooncake #2177 / SGLang #26008
NONE = "none"
# a test hook: a line as as_text prints it, which this process then reports as its own (a
# version skew between two sides of one install can only be shown so)
TEST_HOOK_VAR = "ORCHESTRATOR_TEST_VERSIONS"


@dataclass(frozen=True)
class Versions:
    """What one side runs, a field per key of KEYS (None: a peer that did not say; this
    side's own say "none" for what is not installed). The bootstrap's `versions` object
    (orchestrator.handoff.transport.wire: the keys said, in KEYS order)."""

    mooncake_wheel: Optional[str] = None
    mooncake: Optional[str] = None
    torch: Optional[str] = None
    layout: Optional[str] = None
    orchestrator: Optional[str] = None

    @classmethod
    def from_json(cls, d: dict[str, str]) -> "Versions":
        """A JSON object that passed the wire's check (keys of KEYS, short strings)."""
        return cls(**d)

    def to_json(self) -> dict[str, str]:
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None}


def installed_version(dist: str) -> Optional[str]:
    """The installed distribution `dist`'s version; None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def local(layout: str) -> Versions:
    """This side's versions (every key of KEYS; "none" when not installed)."""
    import os

    wheel = next((d for d in MOONCAKE_WHEELS if installed_version(d) is not None), None)
    mine = Versions(mooncake_wheel=wheel or NONE,
                    mooncake=(installed_version(wheel) if wheel else None) or NONE,
                    torch=installed_version("torch") or NONE,
                    layout=layout,
                    orchestrator=installed_version("pd-aux-orchestrator") or NONE)
    hook = os.environ.get(TEST_HOOK_VAR)
    if hook:
        mine = replace(mine, **dict(item.partition("=")[::2] for item in hook.split()))
    return mine


def _said(v: Versions, key: str) -> str:
    """The value of `key` as a line shows it ("none" when not said)."""
    value: Optional[str] = getattr(v, key)
    return NONE if value is None else value


def as_text(v: Versions) -> str:
    """One line, key=value pairs (what --peer-versions reads)."""
    return " ".join(f"{k}={_said(v, k)}" for k in KEYS)


def from_text(text: str) -> Versions:
    """The line as_text printed; ValueError naming what is wrong."""
    out: dict[str, str] = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or key not in KEYS or not value:
            raise ValueError(f"{item!r}: expected key=value with a key of {', '.join(KEYS)}")
        out[key] = value
    missing = [k for k in KEYS if k not in out]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (paste the line the other side's doctor prints)")
    return Versions(**out)


def release(version: str) -> Optional[tuple[int, ...]]:
    """The leading release numbers of a version string (0.3.13.post1 -> (0, 3, 13))."""
    m = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def skew(mine: Versions, peer: Versions) -> list[tuple[bool, str]]:
    """(fail, text) per difference between this side's versions and the peer's."""
    out: list[tuple[bool, str]] = []
    a, b = _said(mine, "mooncake"), _said(peer, "mooncake")
    ra, rb = release(a), release(b)
    if ra is not None and rb is not None and (ra < SEGMENT_DESCRIPTOR_BREAK) != (rb < SEGMENT_DESCRIPTOR_BREAK):
        out.append((True, f"Mooncake {a} here, {b} on the peer: across 0.3.11, sessions fail with "
                          "\"Failed to get segment descriptor\" (SGLang #26008, Mooncake #2177); "
                          "install the same Mooncake wheel on both sides"))
    elif a != b:
        out.append((False, f"Mooncake {a} here, {b} on the peer: no known incompatibility, but the "
                           "two engines were not tested together; install the same version on both"))
    if mine.mooncake_wheel != peer.mooncake_wheel and a == b:
        out.append((False, f"Mooncake wheel {mine.mooncake_wheel} here, "
                           f"{peer.mooncake_wheel} on the peer (same version, other build)"))
    for key, what in (("torch", "torch"), ("orchestrator", "this tool"), ("layout", "the SGLang aux layout")):
        if getattr(mine, key) != getattr(peer, key):
            extra = (": the layouts are compared field by field too, and a run refuses a "
                     "difference" if key == "layout" else "")
            out.append((False, f"{what} {getattr(mine, key)} here, {getattr(peer, key)} on the peer{extra}"))
    return out

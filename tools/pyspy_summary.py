"""Where a run's processes spend their samples, from `py-spy record --format raw
--subprocesses` output (what `tools/gpu-check.sh ... pyspy` writes to profile-ahead.raw).

    python tools/pyspy_summary.py PROFILE.raw [--top 12]

Per endpoint process (prefill, decode; the runner is left out), the share of samples by the
innermost orchestrator frames (caller > callee), then by leaf frame. Samples are
wall-clock stacks of the threads that were running; a sampled run is slower than an
unsampled one, so read shares, not times.
"""

from __future__ import annotations

import argparse
import collections
import re

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^():]+?)(?::\d+)?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    return f"{m['fn']} [{m['file'].rsplit('/', 1)[-1]}]" if m else frame[:80]


def _ours(frame: str) -> bool:
    return "orchestrator/" in frame


def summarise(path: str, top: int) -> str:
    procs: collections.Counter = collections.Counter()
    paths: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path) as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            n, frames = int(count), stack.split(";")
            role = ("prefill" if "prefill_main" in stack else "decode" if "decode_main" in stack else None)
            if role is None:
                continue
            procs[role] += n
            ours = [_short(f) for f in frames if _ours(f)]
            paths[role][" > ".join(ours[-2:]) if ours else _short(frames[-1])] += n
            leaves[role][_short(frames[-1])] += n
    out = []
    for role in ("prefill", "decode"):
        total = procs[role]
        if not total:
            continue
        out.append(f"== {role}: {total} samples, by innermost orchestrator frames")
        out += [f"{100 * n / total:5.1f}%  {k}" for k, n in paths[role].most_common(top)]
        out.append(f"-- {role}, by leaf frame")
        out += [f"{100 * n / total:5.1f}%  {k}" for k, n in leaves[role].most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    print(summarise(args.profile, args.top))


if __name__ == "__main__":
    main()

"""Run every configured fault through the real command line and print RELIABILITY.md's table:
python tools/fault_table.py [outdir]. Timeouts are short (transport.timeout_s=2) so the whole
table takes about a minute on a 2-core box.

python tools/fault_table.py --kinds prints orchestrator.profile.fault_table.FAULTS instead (what each kind
is: where it acts, what it needs), running nothing."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.results.schema import Results  # noqa: E402

FAST = ["transport.timeout_s=2", "transport.mooncake.tcp_progress_timeout_s=2"]
CASES = [
    ("corrupt_byte (engine route)", ["faults=corrupt_byte", "workload.requests=300"]),
    ("corrupt_byte (tcp route)", ["faults=corrupt_byte", "transport.route=tcp", "workload.requests=300"]),
    ("bad_destination", ["faults=bad_destination", "faults.every=20", "workload.requests=300"]),
    ("wrong_session", ["faults=wrong_session", "faults.every=20", "workload.requests=300"]),
    ("stale_room", ["faults=stale_room", "faults.every=15", "buffers.size=8", "workload.concurrency=4",
                    "workload.requests=300"]),
    ("decode_killed", ["faults=decode_killed", "faults.at_request=500", "workload.requests=3000"]),
    ("decode_stopped 0.5 s (< timeout)", ["faults=decode_stopped", "faults.at_request=500",
                                          "faults.duration_s=0.5", "transport.timeout_s=4", "workload.requests=3000"]),
    ("decode_stopped 6 s (> timeout)", ["faults=decode_stopped", "faults.at_request=500",
                                        "faults.duration_s=6", "workload.requests=3000"]),
    ("prefill_killed", ["faults=prefill_killed", "faults.at_request=500", "workload.requests=3000"]),
    ("prefill_stopped 3 s (2 prefill ranks)", ["faults=prefill_stopped", "faults.at_request=500",
                                               "faults.duration_s=3", "endpoints.prefill_ranks=2",
                                               "workload.requests=1500"]),
    ("status_first, TP 2, gate on", ["faults=status_first", "endpoints.decode_tp=2", "workload.requests=1000",
                                     "workload.batch_size=8", "workload.concurrency=32"]),
    ("status_first, TP 2, gate off", ["faults=status_first", "endpoints.decode_tp=2", "gate.readiness=false",
                                      "workload.requests=1000", "workload.batch_size=8",
                                      "workload.concurrency=32"]),
    ("silent_control", ["faults=silent_control", "workload.requests=300"]),
    ("silent_peer (Mooncake handshake)", ["faults=silent_peer", "workload.requests=300"]),
]


def kinds() -> None:
    """orchestrator.profile.fault_table.FAULTS as a markdown table."""
    from orchestrator.profile.fault_table import FAULTS

    print("| fault | acts at | per request | engine route only | split run | victim | signal |")
    print("|---|---|---|---|---|---|---|")
    yes = {True: "yes", False: "no"}
    for kind, t in FAULTS.items():
        sites = ", ".join(sorted(s.value for s in t.sites)) or "-"
        signal = ("SIGKILL" if t.kills else "SIGSTOP") if t.victim else "-"
        print(f"| {kind.value} | {sites} | {yes[t.per_request]} | {yes[t.engine_only]} | {yes[t.split]} | "
              f"{t.victim or '-'} | {signal} |")


def main() -> int:
    if sys.argv[1:] == ["--kinds"]:
        kinds()
        return 0
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/faults")
    print("| fault | requests | verified | corrupted | failed | why (counts) | exit | wall s | traceback |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, overrides in CASES:
        slug = re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_")  # no commas: Hydra would sweep
        run_dir = out / slug / str(len(list((out / slug).glob("*"))) if (out / slug).exists() else 0)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "orchestrator", *FAST, *overrides,
                               f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300)
        wall = time.monotonic() - t0
        r = Results.read(run_dir)
        why = ", ".join(f"{k}={v}" for k, v in sorted((r.failure_reasons or {}).items())) or "-"
        if r.error:
            why += f"; run error: {r.error[:90]}"
        tb = "yes" if "Traceback" in proc.stdout + proc.stderr else "no"
        print(f"| {name} | {r.requests} | {r.verified} | {r.corrupted} | {r.failed} | "
              f"{why} | {proc.returncode} | {wall:.1f} | {tb} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

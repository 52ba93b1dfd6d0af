"""One run split across two network namespaces on this machine (root): the decode side in one,
the prefill side in the other, joined only by a veth pair (192.0.2.1 <-> 192.0.2.2). Prints
both sides' summaries and the merged report, then removes the namespaces; the two run dirs
stay (outputs/netns-pair/<date>/<time>/{prefill,decode}, or --out DIR).

    python tools/netns_pair.py [--requests 2000] [OVERRIDES ...]      (from the checkout root)

The overrides go to both sides (e.g. transport.route=tcp, or
transport.mooncake.metadata_server=http://192.0.2.2:PORT/metadata with a server started there).
The numbers in BENCHMARKS.md's "across namespaces" rows come from this.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers.netns import DECODE_IP, PREFILL_IP, NetnsPair  # noqa: E402

SECRET_ENV = "PD_AUX_NETNS_PAIR_SECRET"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--port", type=int, default=47000)
    parser.add_argument("--out", type=Path, default=None,
                        help="where the two run dirs go (default: outputs/netns-pair/<date>/<time>, kept)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    env = {**os.environ, SECRET_ENV: secrets.token_hex(32), "PYTHONUNBUFFERED": "1"}
    common = ["transport.allow_remote=true", f"transport.secret_env={SECRET_ENV}", *args.overrides]
    # run dirs the summaries can point at afterwards (not a temp dir)
    base = (args.out or ROOT / "outputs" / "netns-pair" / time.strftime("%Y-%m-%d/%H-%M-%S")).resolve()
    base.mkdir(parents=True, exist_ok=True)
    pair = NetnsPair.create()
    try:
        decode = subprocess.Popen(
            pair.exec_args(pair.decode_ns, [sys.executable, "-m", "orchestrator", "role=decode",
                                            f"transport.host={DECODE_IP}",
                                            f"transport.bootstrap_port={args.port}", *common,
                                            f"hydra.run.dir={base / 'decode'}"]),
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(0.5)
        prefill = subprocess.run(
            pair.exec_args(pair.prefill_ns, [sys.executable, "-m", "orchestrator", "role=prefill",
                                             f"peer={DECODE_IP}:{args.port}",
                                             f"transport.host={PREFILL_IP}",
                                             f"workload.requests={args.requests}", *common,
                                             f"hydra.run.dir={base / 'prefill'}"]),
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        out, _ = decode.communicate(timeout=60)
        print(f"== decode side (namespace {pair.decode_ns}, {DECODE_IP}), exit {decode.returncode}")
        print(out.strip())
        print(f"== prefill side (namespace {pair.prefill_ns}, {PREFILL_IP}), exit {prefill.returncode}")
        print((prefill.stdout + prefill.stderr).strip())
        print("== python -m orchestrator.report PREFILL_DIR DECODE_DIR")
        merged = subprocess.run([sys.executable, "-m", "orchestrator.report", str(base / "prefill"),
                                 str(base / "decode")], cwd=ROOT, capture_output=True, text=True)
        print((merged.stdout + merged.stderr).strip())
        print(f"run dirs: {base / 'prefill'} and {base / 'decode'}")
        return prefill.returncode or decode.returncode or merged.returncode
    finally:
        pair.destroy()


if __name__ == "__main__":
    raise SystemExit(main())

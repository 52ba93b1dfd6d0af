"""SGLang 0.5.23's own set_buf timed alone, beside ours, on the default profile's rows and
requests (issue 39: the inline default run's floor on the scheduler thread).

    python tools/setbuf_floor.py [N]     # N requests a round (default 4000), 3 rounds, p50 us

SGLang's MetadataBuffers is compiled from the installed wheel's own source
(tests/helpers/sglang_oracle.py: `make` installs sglang==0.5.23 with --no-deps); ours is
orchestrator.MetadataBuffers. Both write the same synthetic requests (handoff.workload's pool,
the default workload: logprobs with top 5, hidden states, DSA indices off) into 64 host slots
of hidden size 16, float32 (conf/buffers/default.yaml), one process, nothing else running: a
run's `set_buf p50` above this is the box's contention, not the call."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from orchestrator import MetadataBuffers
from orchestrator.handoff.specs import WorkloadSpec
from orchestrator.handoff.workload import RequestPool, Shapes
from orchestrator.profile.kinds import FillMode
from tests.helpers.sglang_oracle import load


def _p50(buffers: object, pool: RequestPool, n: int) -> float:
    times = []
    for i in range(n):
        req = pool.get(i + 1, i % 64)
        t0 = time.perf_counter()
        buffers.set_buf(req)  # type: ignore[attr-defined]
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
    args = (64, 16, torch.float32, 256, 128, None, 0)
    theirs = load().MetadataBuffers(*args, kv_checksum_enabled=False)
    ours = MetadataBuffers(*args, kv_checksum_enabled=False, enable_sampling_mask=False)
    w = WorkloadSpec(n, 8, None, 1, FillMode.inline, 1, True, 5, True, False, False, True, 7, None, 1.0)
    pool = RequestPool(w, Shapes(16, torch.float32, 0, 256, "cpu"))
    print(f"set_buf p50 us, {n} requests a round, default rows (1,600 B), host slots:")
    for _ in range(3):  # interleaved rounds
        print(f"  SGLang 0.5.23's own {_p50(theirs, pool, n):7.1f}   ours {_p50(ours, pool, n):7.1f}")


if __name__ == "__main__":
    main()

"""A decode that decodes (endpoints.decode_load): a synthetic forward loop on the decode GPU.

SGLang's overlap scheduler queues forward N+1 on the GPU before it polls its transfers and
processes the results of forward N, so every readiness-gate read on the scheduler's stream
waits behind a queued forward. This loop reproduces that shape: one CUDA graph of bf16
matmuls calibrated to `step_ms`, kept queued (two in flight at most) on the decode's default
stream; `tick()` runs before every poll. Forward steps/s are measured for `idle_s` at
start-up with nothing else on the GPU, then while the decode serves handoffs.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Optional

import torch

_N = 4096


class ForwardLoop:
    def __init__(self, device: torch.device, step_ms: float):
        self.device = device
        a = torch.randn(_N, _N, device=device, dtype=torch.bfloat16)
        b = torch.randn(_N, _N, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(a)
        for _ in range(3):
            torch.matmul(a, b, out=out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        per_ms = max(start.elapsed_time(end) / 10, 1e-3)
        self.matmuls = max(1, round(step_ms / per_ms))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.matmul(a, b, out=out)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(self.matmuls):
                torch.matmul(a, b, out=out)
        torch.cuda.synchronize(device)
        self._keep = (a, b, out)
        self.queued: collections.deque = collections.deque()
        self.done = 0
        self.t0: Optional[float] = None
        self.step_ms_measured: Optional[float] = None
        self.idle_per_s: Optional[float] = None

    def tick(self) -> None:
        """Count finished forwards; keep two queued (the next one behind the running one)."""
        while self.queued and self.queued[0].query():
            self.queued.popleft()
            self.done += 1
        while len(self.queued) < 2:
            self.graph.replay()
            ev = torch.cuda.Event()
            ev.record()
            self.queued.append(ev)

    def measure_idle(self, seconds: float) -> None:
        """Forward steps/s with nothing else on the GPU (before serving starts)."""
        if seconds <= 0:
            return
        t0, done0 = time.perf_counter(), self.done
        while time.perf_counter() - t0 < seconds:
            self.tick()
            time.sleep(0.0005)
        elapsed = time.perf_counter() - t0
        self.idle_per_s = (self.done - done0) / elapsed
        self.step_ms_measured = 1e3 / self.idle_per_s if self.idle_per_s else None

    def start(self) -> None:
        self.t0, self.done_at_start = time.perf_counter(), self.done

    def summary(self, step_ms: float) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.t0 if self.t0 is not None else 0.0
        serving = (self.done - self.done_at_start) / elapsed if elapsed > 0 else None
        return {"step_ms": step_ms, "matmuls_per_step": self.matmuls,
                "step_ms_measured": None if self.step_ms_measured is None else round(self.step_ms_measured, 3),
                "forward_steps_per_s_idle": None if self.idle_per_s is None else round(self.idle_per_s, 2),
                "forward_steps_per_s_serving": None if serving is None else round(serving, 2),
                "serving_over_idle": (round(serving / self.idle_per_s, 3)
                                      if serving and self.idle_per_s else None)}

"""Latency statistics shared by the report, the endpoints and the benchmark.

Runs record latencies in a LatencyHistogram: fixed memory however long the run (a soak of
millions of handoffs stays flat), percentiles within 0.25% of the exact value. Exact
per-request values are in requests.jsonl; the benchmark keeps exact samples of its own.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

_BASE_US = 0.1
_RATIO = 1.005  # bucket width: 0.5%; values are reported at the bucket's geometric middle
_LOG_RATIO = math.log(_RATIO)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in 0..100) of exact samples; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return round(ordered[rank - 1], 2)


class LatencyHistogram:
    """Log-bucketed counts of latencies in microseconds (at most ~4,200 buckets from 0.1 us
    to 100 s)."""

    BUFFER = 4096  # values kept before they are folded into buckets (vectorized)

    def __init__(self, values: Iterable[float] = ()):
        self.counts: dict[int, int] = {}
        self.n = 0
        self.total = 0.0
        self.max: Optional[float] = None  # exact (the buckets round)
        self._pending: list[float] = []
        self._repeats: Optional[list[int]] = None  # how often each pending value counts (extend_runs)
        self._extra = 0  # pending values beyond len(_pending) (their repeats)
        for v in values:
            self.add(v)

    def add(self, us: float) -> None:
        self._pending.append(us)
        if self._repeats is not None:
            self._repeats.append(1)
        if len(self._pending) + self._extra >= self.BUFFER:
            self.fold()

    def extend(self, values: Sequence[float]) -> None:
        """Many values at once (as add() each)."""
        self._pending.extend(values)
        if self._repeats is not None:
            self._repeats += [1] * len(values)
        if len(self._pending) + self._extra >= self.BUFFER:
            self.fold()

    def extend_runs(self, values: Sequence[float], repeats: Sequence[int]) -> None:
        """Each of `values` as often as `repeats` says, in order (as extend() of them spelled
        out: folded at the same points into the same buckets, the same total)."""
        if self._repeats is None:
            self._repeats = [1] * len(self._pending)
        self._pending.extend(values)
        self._repeats.extend(repeats)
        self._extra += sum(repeats) - len(repeats)
        if len(self._pending) + self._extra >= self.BUFFER:
            self.fold()

    def fold(self) -> "LatencyHistogram":
        """Fold buffered values into the buckets (one vectorized pass)."""
        if not self._pending:
            return self
        import numpy as np  # here: a refusal or --help reads this module without numpy

        v = np.asarray(self._pending, dtype=np.float64)
        b = np.where(v > _BASE_US, np.log(np.maximum(v, _BASE_US) / _BASE_US) / _LOG_RATIO, 0).astype(np.int64)
        repeats = self._repeats
        self._pending, self._repeats, self._extra = [], None, 0
        if repeats is None:
            keys, counts = np.unique(b, return_counts=True)
        else:  # runs: each distinct value's bucket taken once, counted as often as it repeats
            keys, at = np.unique(b, return_inverse=True)
            counts = np.bincount(at, weights=repeats).astype(np.int64)
            v = np.repeat(v, repeats)  # (the total summed as extend() of them spelled out)
        for k, c in zip(keys.tolist(), counts.tolist()):
            self.counts[k] = self.counts.get(k, 0) + c
        self.n += len(v)
        self.total += float(v.sum())
        top = float(v.max())
        self.max = top if self.max is None else max(self.max, top)
        return self

    def __getstate__(self) -> dict[str, Any]:
        self.fold()
        return self.__dict__

    def merge(self, other: "LatencyHistogram") -> "LatencyHistogram":
        self.fold()
        other.fold()
        for b, c in other.counts.items():
            self.counts[b] = self.counts.get(b, 0) + c
        self.n += other.n
        self.total += other.total
        if other.max is not None:
            self.max = other.max if self.max is None else max(self.max, other.max)
        return self

    def percentile(self, q: float) -> Optional[float]:
        self.fold()
        if not self.n:
            return None
        rank = max(1, math.ceil(q / 100 * self.n))
        seen = 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen >= rank:  # the bucket's middle, never past the largest value seen
                mid = _BASE_US * _RATIO ** (b + 0.5)
                return round(min(mid, self.max) if self.max is not None else mid, 2)
        return None  # unreachable

    def summary(self) -> dict[str, Optional[float]]:
        return {"p50": self.percentile(50), "p99": self.percentile(99),
                "p999": self.percentile(99.9)}

    def chosen(self, qs: Sequence[float]) -> dict[str, Optional[float]]:
        """{"p<q>": value} for each q (report.percentiles), named as `q` prints: p90, p99.9."""
        return {f"p{q:g}": self.percentile(q) for q in qs}

    @property
    def peak(self) -> Optional[float]:
        """The largest value, exactly, rounded as the percentiles are."""
        self.fold()
        return None if self.max is None else round(self.max, 2)

    @property
    def mean(self) -> Optional[float]:
        self.fold()
        return round(self.total / self.n, 2) if self.n else None

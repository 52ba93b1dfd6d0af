"""The decode instance's tensor-parallel group: what its ranks agree on each step.

A single-rank instance has nothing to agree on (Group). A group of several ranks
(TorchGroup, endpoints.decode_tp > 1) runs on torch.distributed (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from typing import Any


class Group:
    """One rank, nobody to agree with."""

    size = 1
    rank = 0

    def share_grants(self, endpoint: Any) -> None:
        endpoint.new_grants.clear()

    def agree(self, endpoint: Any, polls: list[int]) -> list[int]:
        return polls

    def combine(self, endpoint: Any, judged: list) -> list:
        return judged

    def any(self, flag: bool) -> bool:
        return flag


_SINGLE = Group()


def single() -> Group:
    return _SINGLE


def join(plan, rendezvous, tp_rank: int, tp: int, timeout_s: float, gpu):
    raise NotImplementedError("decode TP groups")

"""Synthetic prefill results: SGLang-shaped request objects, deterministic from (seed, index).

The sender fills its MetadataBuffers row from one of these exactly as SGLang's set_buf
would from a finished prefill request; the receiver never sees the generator, only bytes, and
checks them against the checksum the sender computed over its own row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .config import WorkloadConfig

_ROOM_MASK = (1 << 63) - 1


@dataclass
class AuxRequest:
    """The attributes of SGLang's Req that MetadataBuffers.set_buf reads."""

    rid: int
    bootstrap_room: Optional[int]
    output_ids: list[int]
    cached_tokens: int
    cached_tokens_device: int
    cached_tokens_host: int
    cached_tokens_storage: int
    return_logprob: bool
    output_token_logprobs_val: list[list[float]] = field(default_factory=list)
    output_token_logprobs_idx: list[list[int]] = field(default_factory=list)
    output_top_logprobs_val: list[list[float]] = field(default_factory=list)
    output_top_logprobs_idx: list[list[int]] = field(default_factory=list)
    hidden_states_tensor: Optional[torch.Tensor] = None
    output_topk_p: Optional[torch.Tensor] = None
    output_topk_index: Optional[torch.Tensor] = None
    metadata_buffer_index: int = -1


def room_for(seed: int, index: int) -> int:
    """A nonzero 63-bit bootstrap room, unique per (seed, index) with overwhelming odds."""
    g = torch.Generator().manual_seed((seed << 32) ^ (index * 0x9E3779B1))
    room = int(torch.randint(1, _ROOM_MASK, (1,), generator=g, dtype=torch.int64).item())
    return room or 1


def make_request(w: WorkloadConfig, index: int, hidden_size: int) -> AuxRequest:
    g = torch.Generator().manual_seed(w.seed * 1_000_003 + index)
    vocab = 152_000
    prompt = int(torch.randint(16, 8192, (1,), generator=g).item())
    cached = int(torch.randint(0, prompt, (1,), generator=g).item())
    device_part = int(torch.randint(0, cached + 1, (1,), generator=g).item())
    req = AuxRequest(
        rid=index,
        bootstrap_room=room_for(w.seed, index),
        output_ids=[int(torch.randint(0, vocab, (1,), generator=g).item())],
        cached_tokens=cached,
        cached_tokens_device=device_part,
        cached_tokens_host=cached - device_part,
        cached_tokens_storage=0,
        return_logprob=w.return_logprob,
    )
    if w.return_logprob:
        k = w.top_logprobs_num
        top = torch.sort(-torch.rand(k, generator=g) * 10).values.tolist()
        req.output_token_logprobs_val = [[top[0] if k else -float(torch.rand(1, generator=g))]]
        req.output_token_logprobs_idx = [[req.output_ids[0]]]
        req.output_top_logprobs_val = [top]
        req.output_top_logprobs_idx = [torch.randint(0, vocab, (k,), generator=g).tolist()]
    if w.hidden_states:
        req.hidden_states_tensor = torch.randn(hidden_size, generator=g)
        req.output_topk_p = torch.softmax(torch.randn(16, generator=g), 0)
        req.output_topk_index = torch.randint(0, vocab, (16,), generator=g, dtype=torch.int64)
    return req

"""This project's SGLang-compatible code held against SGLang 0.5.23's OWN released code.

The oracle (tests/helpers/sglang_oracle.py) compiles SGLang's MetadataBuffers, AuxDataCodec, KVPoll,
status encoder/parser and Mooncake's aux send/receive methods (with its decode-thread
dispatch loop) from the installed sglang==0.5.23 wheel's source, unchanged. These tests
compare, over a grid of buffer configurations:
  * the layout (field order, shapes, dtypes, item and data lengths, absent fields) and the API
    (constructor forms, attributes, clear_slot, kv checksums) of both MetadataBuffers;
  * set_buf then get_buf on identical SGLang-shaped requests, every branch of set_buf;
  * AUX_DATA frames both ways over real ZMQ sockets on 127.0.0.1 (ours -> SGLang's receiver,
    with and without our MAC frame; SGLang's send_aux_tcp -> wire.parse/write_rows; a
    coalesced frame of ours landing in consecutive rows of SGLang's receiver), and SGLang's
    sender into our real decode process, which refuses its unsigned frames;
  * status messages both ways, and KVPoll;
  * the layout-mismatch hazard: SGLang's receiver has no bounds check, wire.parse refuses.
Skipped (not failed) when sglang 0.5.23 is not installed.
"""

from __future__ import annotations

import ctypes
import inspect
import itertools
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest
import torch
import zmq

from orchestrator.handoff.buffers import MetadataBuffers as OurBuffers
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator
from orchestrator.handoff.workload import (
    AuxRequest,
    Logprob,
    SamplingMaskChunk,
    SamplingMaskRows,
    Shapes,
    make_request,
)
from orchestrator.profile.config import WorkloadConfig
from orchestrator.profile.layout import describe, first_difference, load_layout
from orchestrator.results.outcomes import KVPoll as OurKVPoll

from .helpers.sglang_oracle import load_or_skip

pytestmark = pytest.mark.integration

sgl = load_or_skip()

ENV_MASK = "SGLANG_ENABLE_DISAGG_SAMPLING_MASK"
ENV_POOL = "SGLANG_MOONCAKE_CUSTOM_MEM_POOL"
FIELDS = ["output_ids", "cached_tokens", "output_token_logprobs_val", "output_token_logprobs_idx",
          "output_top_logprobs_val", "output_top_logprobs_idx", "output_token_sampling_mask_len",
          "output_token_sampling_mask_idx", "output_token_sampling_logprobs", "output_topk_p",
          "output_topk_index", "output_hidden_states", "output_dsa_topk_indices",
          "bootstrap_room", "kv_checksum"]
WAIT_S = 5.0


# ---- the configuration grid ---------------------------------------------------------------------
@dataclass(frozen=True)
class Cfg:
    hidden: int
    dtype: torch.dtype
    dsa: int
    size: int
    mask: Optional[int]  # max_sampling_mask_tokens with the sampling mask on; None: off
    checksum: bool
    top: int

    @property
    def mask_tokens(self) -> int:
        return self.mask or 64

    def __str__(self) -> str:
        return (f"h{self.hidden}-{str(self.dtype).removeprefix('torch.')}-dsa{self.dsa}-n{self.size}"
                f"-mask{self.mask or 'off'}-ck{int(self.checksum)}-top{self.top}")


AXES = {"hidden": [16, 4096, 7168], "dtype": [torch.float32, torch.bfloat16], "dsa": [0, 2048],
        "size": [1, 64, 257], "mask": [None, 64, 4096], "checksum": [False, True], "top": [128, 20]}


def _pairwise(axes: dict[str, list]) -> list[Cfg]:
    """A deterministic all-pairs cover of the axes (every value of every axis, and every pair
    of values of two axes, appears in some configuration): 432 combinations in a dozen."""
    names = list(axes)
    todo = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
            for va in range(len(axes[a])) for vb in range(len(axes[b]))}
    combos = list(itertools.product(*(range(len(axes[n])) for n in names)))
    chosen = []
    while todo:
        def gain(c, todo=todo):
            return sum((a, c[names.index(a)], b, c[names.index(b)]) in todo
                       for a, b in itertools.combinations(names, 2))
        best = max(combos, key=gain)
        todo -= {(a, best[names.index(a)], b, best[names.index(b)])
                 for a, b in itertools.combinations(names, 2)}
        chosen.append(Cfg(**{n: axes[n][i] for n, i in zip(names, best)}))
    return chosen


GRID = _pairwise(AXES)


def test_the_grid_covers_every_value_and_pair():
    assert len(GRID) <= 16
    for name, values in AXES.items():
        assert {getattr(c, name) for c in GRID} == set(values)
    for c in GRID:  # every optional field appears on and off
        assert c.size and c.hidden
    assert {c.dsa > 0 for c in GRID} == {c.mask is not None for c in GRID} == {True, False}
    assert {c.checksum for c in GRID} == {True, False}


grid = pytest.mark.parametrize("cfg", GRID, ids=str)


# ---- helpers -------------------------------------------------------------------------------------
@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(ENV_POOL, raising=False)
    monkeypatch.delenv(ENV_MASK, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # a failed test's sockets must not hang the session


def sglang_buffers(env, cfg: Cfg):
    """SGLang's MetadataBuffers as its scheduler builds it (the mask flag from its env)."""
    env.setenv(ENV_MASK, "1" if cfg.mask else "0")
    return sgl.MetadataBuffers(cfg.size, cfg.hidden, cfg.dtype, cfg.mask_tokens, cfg.top,
                               None, cfg.dsa, kv_checksum_enabled=cfg.checksum)


def our_buffers(cfg: Cfg, **extra):
    return OurBuffers(cfg.size, cfg.hidden, cfg.dtype, cfg.mask_tokens, cfg.top, None, cfg.dsa,
                      kv_checksum_enabled=cfg.checksum, enable_sampling_mask=cfg.mask is not None,
                      **extra)


def pair(env, cfg: Cfg):
    return sglang_buffers(env, cfg), our_buffers(cfg)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def field_names(buf) -> list[str]:
    """get_buf_infos() order, as attribute names (by data pointer)."""
    by_ptr = {t.data_ptr(): n for n in FIELDS if (t := getattr(buf, n, None)) is not None}
    return [by_ptr[p] for p in buf.get_buf_infos()[0]]


def differing_fields(a, b) -> list[str]:
    """Fields whose bytes differ (all rows), with the first differing row."""
    out = []
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is None:
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        elif not torch.equal(raw(x), raw(y)):
            rows = (raw(x) != raw(y)).reshape(x.shape[0], -1).any(1).nonzero().flatten().tolist()
            out.append(f"{name}: rows {rows[:8]} differ")
    return out


def assert_same_get_buf(a: tuple, b: tuple) -> None:
    assert len(a) == len(b) == 14
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None:
            assert y is None, f"get_buf[{i}]: SGLang None, ours {y}"
            continue
        assert y is not None, f"get_buf[{i}]: ours None"
        assert (x.dtype, tuple(x.shape)) == (y.dtype, tuple(y.shape)), f"get_buf[{i}]"
        assert torch.equal(raw(x), raw(y)), f"get_buf[{i}]: {x} vs {y}"


def workload(cfg: Cfg, **kw) -> WorkloadConfig:
    base = dict(return_logprob=True, top_logprobs_num=min(cfg.top, 20), hidden_states=True,
                sampling_mask=cfg.mask is not None, multimodal=True, dsa_indices=True, seed=7)
    base.update(kw)
    return WorkloadConfig(**base)


def shapes(cfg: Cfg) -> Shapes:
    return Shapes(cfg.hidden, cfg.dtype, cfg.dsa, cfg.mask_tokens)


def request(cfg: Cfg, index: int, slot: int, **kw) -> AuxRequest:
    req = make_request(workload(cfg, **kw), index, shapes(cfg))
    req.metadata_buffer_index = slot
    return req


def fill_random_row(bufs, slot: int, seed: int) -> None:
    """Random bytes over one whole row of every field (rooms kept below 2**63)."""
    rng = np.random.default_rng(seed)
    ptrs, _, lens = bufs.get_buf_infos()
    for p, n in zip(ptrs, lens):
        data = bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        ctypes.memmove(p + n * slot, bytes(data), n)
    bufs.bootstrap_room[slot, 0] = int(rng.integers(1, 1 << 62))


def fill(bufs, cfg: Cfg, same_as=None) -> list[int]:
    """The slots the frame tests move: set_buf rows at the ends, random bytes in between."""
    slots = sorted({0, cfg.size // 2, cfg.size - 1})
    for i, slot in enumerate(slots):
        if i == 1:
            fill_random_row(bufs, slot, seed=slot)
        else:
            bufs.set_buf(request(cfg, i, slot))
            if cfg.checksum:
                bufs.set_kv_checksum(SimpleNamespace(metadata_buffer_index=slot), 1000 + slot, 77)
    return slots


def recv_all(sock: zmq.Socket, n: int) -> list[list[bytes]]:
    out = []
    while len(out) < n:
        assert sock.poll(int(WAIT_S * 1000)), f"received {len(out)} of {n} messages"
        out.append(sock.recv_multipart())
    return out


def pull_socket(ctx: zmq.Context) -> tuple[zmq.Socket, int]:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, sock.bind_to_random_port("tcp://127.0.0.1")


def push_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDTIMEO, int(WAIT_S * 1000))
    sock.connect(endpoint)
    return sock


# ---- layout ----------------------------------------------------------------------------------------
@grid
def test_layout(env, cfg):
    theirs, ours = pair(env, cfg)
    assert field_names(ours) == field_names(theirs)
    t_ptrs, t_data, t_items = theirs.get_buf_infos()
    o_ptrs, o_data, o_items = ours.get_buf_infos()
    assert (o_items, o_data, len(o_ptrs)) == (t_items, t_data, len(t_ptrs))
    for name in FIELDS:
        x, y = getattr(theirs, name), getattr(ours, name)
        assert (x is None) == (y is None), f"{name}: SGLang {x is None and 'None'}, ours {y is None and 'None'}"
        if x is not None:
            assert (y.dtype, tuple(y.shape), y.device.type) == (x.dtype, tuple(x.shape), x.device.type), name
    # which SGLang attributes are None, from its instance (not from FIELDS)
    for k, v in vars(theirs).items():
        if v is None:
            assert getattr(ours, k, "missing") is None, k
    assert not differing_fields(theirs, ours)  # fresh rows: zeros, DSA rows -1
    for attr in ("custom_mem_pool", "enable_sampling_mask", "output_dsa_topk_indices_dim"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert (ours.kv_checksum is None) == (theirs.kv_checksum is None) == (not cfg.checksum)
    assert (ours.output_dsa_topk_indices is None) == (cfg.dsa == 0)


# ---- API -------------------------------------------------------------------------------------------
def test_constructor_signature_is_sglangs():
    theirs = list(inspect.signature(sgl.MetadataBuffers.__init__).parameters.values())
    ours = list(inspect.signature(OurBuffers.__init__).parameters.values())
    strip = [(p.name, p.kind, p.default) for p in theirs]
    assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == strip
    extra = ours[len(theirs):]
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra)


CFG_API = Cfg(hidden=32, dtype=torch.bfloat16, dsa=8, size=4, mask=64, checksum=True, top=20)


@pytest.mark.parametrize("form", ["positional", "scheduler", "keywords", "defaults"])
def test_constructor_forms(env, form):
    env.setenv(ENV_MASK, "true")
    c = CFG_API
    calls = {
        "positional": ((c.size, c.hidden, c.dtype, c.mask, c.top, None, c.dsa), {}),
        # SGLang's scheduler (disaggregation set-up) call shape
        "scheduler": ((c.size, c.hidden, c.dtype, c.mask),
                      dict(custom_mem_pool=None, output_dsa_topk_indices_dim=c.dsa,
                           kv_checksum_enabled=c.checksum)),
        "keywords": ((), dict(size=c.size, hidden_size=c.hidden, hidden_states_dtype=c.dtype,
                              max_sampling_mask_tokens=c.mask, max_top_logprobs_num=c.top,
                              custom_mem_pool=None, output_dsa_topk_indices_dim=c.dsa,
                              kv_checksum_enabled=c.checksum)),
        "defaults": ((c.size, c.hidden, c.dtype, c.mask), {}),
    }
    args, kwargs = calls[form]
    theirs, ours = sgl.MetadataBuffers(*args, **kwargs), OurBuffers(*args, **kwargs)
    assert field_names(ours) == field_names(theirs)
    assert ours.get_buf_infos()[1:] == theirs.get_buf_infos()[1:]
    assert not differing_fields(theirs, ours)
    for attr in ("custom_mem_pool", "enable_sampling_mask", "output_dsa_topk_indices_dim"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr


def test_kv_checksum_enabled_is_keyword_only_in_both(env):
    for cls in (sgl.MetadataBuffers, OurBuffers):
        with pytest.raises(TypeError):
            cls(2, 16, torch.float32, 64, 128, None, 0, True)


@pytest.mark.parametrize("value", [None, "1", "true", "YES", "y", "0", "False", "n", "bogus"])
def test_sampling_mask_env_var_is_read_like_sglang(env, value):
    """enable_sampling_mask=None reads SGLANG_ENABLE_DISAGG_SAMPLING_MASK as SGLang's
    envs.SGLANG_ENABLE_DISAGG_SAMPLING_MASK.get() does (EnvBool, default False)."""
    if value is not None:
        env.setenv(ENV_MASK, value)
    outcome = {}
    for who, cls in (("sglang", sgl.MetadataBuffers), ("ours", OurBuffers)):
        try:
            with warnings.catch_warnings():  # SGLang warns on an invalid value
                warnings.simplefilter("ignore")
                buf = cls(2, 16, torch.float32, 64)
            outcome[who] = ("built", buf.enable_sampling_mask, field_names(buf))
        except Exception as exc:  # compared below, whatever it is
            outcome[who] = ("raised", type(exc).__name__)
    assert outcome["ours"] == outcome["sglang"], \
        f"{ENV_MASK}={value!r}: SGLang {outcome['sglang'][:2]}, ours {outcome['ours'][:2]}"


@pytest.mark.parametrize("pool", [None, "NONE", "INTRA_NODE"])
def test_mem_pool_env_places_rows_like_sglang(env, pool):
    if pool is not None:
        env.setenv(ENV_POOL, pool)
    theirs, ours = sgl.MetadataBuffers(2, 16, torch.float32, 64), OurBuffers(2, 16, torch.float32, 64)
    assert {getattr(ours, n).device.type for n in field_names(ours)} == \
        {getattr(theirs, n).device.type for n in field_names(theirs)} == {"cpu"}


@pytest.mark.parametrize("checksum", [False, True])
def test_clear_slot_and_kv_checksum(env, checksum):
    cfg = Cfg(hidden=16, dtype=torch.float32, dsa=4, size=3, mask=64, checksum=checksum, top=20)
    theirs, ours = pair(env, cfg)
    for b in (theirs, ours):
        for slot in range(cfg.size):
            b.set_buf(request(cfg, slot, slot))
    if not checksum:
        for b in (theirs, ours):
            with pytest.raises(TypeError):
                b.set_kv_checksum(SimpleNamespace(metadata_buffer_index=0), 1, 2)
            with pytest.raises(TypeError):
                b.get_kv_checksum(0)
    else:
        for b in (theirs, ours):
            assert b.get_kv_checksum(1) == (0, 0)  # nothing written
            b.set_kv_checksum(SimpleNamespace(metadata_buffer_index=1), 0xDEADBEEF, (1 << 63) - 1)
            b.set_kv_checksum(SimpleNamespace(metadata_buffer_index=2), 5, 1)
        assert ours.get_kv_checksum(1) == theirs.get_kv_checksum(1) == (0xDEADBEEF, (1 << 63) - 1)
        assert ours.get_kv_checksum(2) == theirs.get_kv_checksum(2) == (5, 1)
    assert not differing_fields(theirs, ours)
    for b in (theirs, ours):
        b.clear_slot(1)
    assert not differing_fields(theirs, ours)
    assert int(ours.bootstrap_room[1, 0]) == int(theirs.bootstrap_room[1, 0]) == 0
    if checksum:
        assert ours.get_kv_checksum(1) == theirs.get_kv_checksum(1) == (0, 0)
        assert ours.get_kv_checksum(2) == theirs.get_kv_checksum(2) == (5, 1)


@pytest.mark.parametrize("value", [(1 << 63) - 1, 1 << 63, (1 << 64) - 1])
def test_64bit_room_and_checksum_values_behave_alike(env, value):
    """Rooms and digests near and above 2**63 (SGLang's own producers stay below 2**63:
    kv_layout_signature is `>> 1 | 1`; a room is whatever the request carries)."""
    cfg = Cfg(hidden=16, dtype=torch.float32, dsa=0, size=2, mask=None, checksum=True, top=20)
    theirs, ours = pair(env, cfg)
    outcome = {}
    for who, b in (("sglang", theirs), ("ours", ours)):
        req = request(cfg, 0, 1, hidden_states=False)
        req.bootstrap_room = value
        result = []
        for call in (lambda b=b, req=req: b.set_buf(req),
                     lambda b=b, req=req: b.set_kv_checksum(req, value, value)):
            try:
                call()
                result.append("ok")
            except Exception as exc:
                result.append(type(exc).__name__)
        result.append(int.from_bytes(bytes(raw(b.bootstrap_room[1, :1]).numpy()), "little"))
        result.append(b.get_kv_checksum(1))
        outcome[who] = result
    assert outcome["ours"] == outcome["sglang"], \
        f"value {value:#x} [set_buf, set_kv_checksum, room row, get_kv_checksum]: " \
        f"SGLang {outcome['sglang']}, ours {outcome['ours']}"


# ---- set_buf / get_buf -----------------------------------------------------------------------------
def _speculative_without_dsa(cfg, slot):
    req = request(cfg, 20, slot, dsa_indices=False)
    assert req.hidden_states_tensor is not None and req.output_dsa_topk_indices is None
    return req


def _no_hidden_state(cfg, slot):
    req = request(cfg, 21, slot, hidden_states=False)
    assert req.hidden_states_tensor is None
    return req


def _room_none(cfg, slot):
    req = request(cfg, 22, slot)
    req.bootstrap_room = None
    return req


def _empty_logprobs(cfg, slot):
    req = request(cfg, 23, slot)
    req.logprob = Logprob([], [], [], [])
    return req


def _top_logprobs_at_capacity(cfg, slot):
    req = request(cfg, 24, slot, top_logprobs_num=cfg.top)
    assert len(req.logprob.output_top_logprobs_val[0]) == cfg.top
    return req


def _logprobs_off(cfg, slot):
    req = request(cfg, 25, slot, return_logprob=False, multimodal=False)
    req.logprob = Logprob([1.0], [2], [[3.0]], [[4]])  # present but not asked for: not written
    return req


def _short_topk(cfg, slot):
    req = request(cfg, 26, slot)
    req.output_topk_p, req.output_topk_index = req.output_topk_p[:4], req.output_topk_index[:4]
    return req


def _full_sampling_mask(cfg, slot):
    req = request(cfg, 27, slot)
    if cfg.mask:
        n = cfg.mask
        req.sampling_mask_rows = SamplingMaskRows(SamplingMaskChunk(
            np.arange(n, dtype=np.int32) * 3, -np.linspace(0, 5, n, dtype=np.float32)))
    return req


def _too_many_top_logprobs(cfg, slot):
    req = request(cfg, 28, slot, top_logprobs_num=cfg.top)
    req.logprob.output_top_logprobs_val[0].append(-99.0)
    req.logprob.output_top_logprobs_idx[0].append(1)
    return req


def _mask_on_a_maskless_buffer(cfg, slot):
    req = request(cfg, 29, slot, sampling_mask=True)
    return req


REQUESTS = [("full", lambda cfg, slot: request(cfg, 10, slot)),
            ("speculative_without_dsa", _speculative_without_dsa),
            ("full_again", lambda cfg, slot: request(cfg, 11, slot)),
            ("no_hidden_state", _no_hidden_state),
            ("room_none", _room_none),
            ("empty_logprobs", _empty_logprobs),
            ("top_logprobs_at_capacity", _top_logprobs_at_capacity),
            ("logprobs_off", _logprobs_off),
            ("short_topk", _short_topk),
            ("full_sampling_mask", _full_sampling_mask),
            ("too_many_top_logprobs", _too_many_top_logprobs),
            ("mask_on_a_maskless_buffer", _mask_on_a_maskless_buffer)]


@grid
def test_set_buf_get_buf(env, cfg):
    theirs, ours = pair(env, cfg)
    for step, (name, make) in enumerate(REQUESTS):
        slot = (step // 2) % cfg.size  # pairs share a slot: each second request overwrites
        raised = {}
        for who, b in (("sglang", theirs), ("ours", ours)):
            req = make(cfg, slot)  # a fresh, identical request for each side
            try:
                b.set_buf(req)
                raised[who] = None
            except Exception as exc:
                raised[who] = type(exc).__name__
        assert raised["ours"] == raised["sglang"], f"{name}: set_buf outcome"
        if name == "too_many_top_logprobs":
            assert raised["sglang"] == "RuntimeError"
        if name == "mask_on_a_maskless_buffer":
            assert (raised["sglang"] is None) == (cfg.mask is not None)
        assert_same_get_buf(theirs.get_buf(slot), ours.get_buf(slot))
        assert not differing_fields(theirs, ours), f"after {name}"
        if name == "speculative_without_dsa" and cfg.dsa:
            assert (ours.output_dsa_topk_indices[slot] == -1).all()
        if name == "no_hidden_state" and cfg.dsa:  # the row keeps the previous request's DSA
            assert (ours.output_dsa_topk_indices[slot] != -1).any()
        if name == "room_none":
            assert int(ours.bootstrap_room[slot, 0]) == 0
    # the multimodal counts went to cached_tokens[4:7]
    req = request(cfg, 30, 0)
    for b in (theirs, ours):
        b.set_buf(req)
    assert ours.cached_tokens[0, 4:7].tolist() == theirs.cached_tokens[0, 4:7].tolist() == list(req.mm_tokens)


# ---- AUX_DATA frames over ZMQ ----------------------------------------------------------------------
@grid
@pytest.mark.parametrize("signed", [False, True], ids=["plain", "mac"])
def test_ours_to_sglang_receiver(env, zctx, cfg, signed):
    """Our prefill's frames (one per field, payload = the row via wire.read_rows, as
    router.py sends them), landed by SGLang's decode loop + _handle_aux_data."""
    ours = our_buffers(cfg)
    theirs_src = sglang_buffers(env, cfg)  # the same requests through SGLang's set_buf
    slots = fill(ours, cfg)
    fill(theirs_src, cfg)
    assert not differing_fields(theirs_src, ours)
    dst = sglang_buffers(env, cfg)
    d_ptrs, _, d_lens = dst.get_buf_infos()
    receiver = sgl.receiver(zctx, d_ptrs, d_lens)
    auth = Authenticator(b"k" if signed else None)
    push = push_socket(zctx, receiver.endpoint)
    try:
        ptrs, _, lens = ours.get_buf_infos()
        sent = 0
        for slot in slots:
            room = ours.room(slot)
            for i, payload in enumerate(wire.read_rows(ptrs, lens, slot)):
                frames = auth.sign(wire.encode_aux(room, i, slot, payload))
                assert len(frames) == 6 + signed
                push.send_multipart(frames)
                sent += 1
        assert receiver.run(sent, WAIT_S) == sent
        assert receiver.statuses == []  # every message went the AUX_DATA way
    finally:
        push.close()
        receiver.close()
    assert not differing_fields(dst, ours)
    for slot in slots:
        assert_same_get_buf(dst.get_buf(slot), ours.get_buf(slot))


@grid
def test_sglang_sender_to_ours(env, zctx, cfg):
    """SGLang's send_aux_tcp (src slot s -> dst slot size-1-s) into wire.parse + write_rows."""
    theirs = sglang_buffers(env, cfg)
    slots = fill(theirs, cfg)
    ours = our_buffers(cfg)
    fresh = our_buffers(cfg)
    o_ptrs, _, o_lens = ours.get_buf_infos()
    sender = sgl.sender(zctx, *theirs.get_buf_infos()[::2])
    pull, port = pull_socket(zctx)
    try:
        for slot in slots:
            room = int(theirs.bootstrap_room[slot, 0])
            assert sender.send_aux_tcp("127.0.0.1", port, room, slot, cfg.size - 1 - slot, o_ptrs) == 0
        messages = recv_all(pull, len(slots) * len(o_lens))
    finally:
        pull.close()
        sender.close()
    for frames in messages:
        msg = wire.parse(frames, o_lens, cfg.size)
        assert isinstance(msg, wire.AuxData) and msg.rows == 1
        wire.write_rows(o_ptrs, o_lens, msg)
    for name in field_names(theirs):
        t, o, f = getattr(theirs, name), getattr(ours, name), getattr(fresh, name)
        for slot in range(cfg.size):
            src = cfg.size - 1 - slot
            want = t[src] if src in slots else f[slot]
            assert torch.equal(raw(o[slot]), raw(want)), f"{name}[{slot}]"
    for slot in slots:
        assert_same_get_buf(theirs.get_buf(slot), ours.get_buf(cfg.size - 1 - slot))


def test_sglang_sender_into_our_real_decode_is_refused(env, zctx, tmp_path):
    """The same path as a run: SGLang 0.5.23's own send_aux_tcp and status sender into our
    decode PROCESS (not wire.parse). Its frames carry no MAC, so a run's decode refuses
    every one of them (rejected_auth) and nothing lands: the row stays empty, and the
    request's authentic status then finds no room (room_never_landed). Our parser takes
    SGLang's frames (test_sglang_sender_to_ours); our decode, in a run, does not."""
    from orchestrator.results.outcomes import Detail, Outcome

    from .conftest import typed_cfg
    from .helpers.peers import PrefillPeer

    cfg = typed_cfg("mem_pool=NVLINK", "transport.timeout_s=1")
    peer = PrefillPeer(cfg, tmp_path)
    try:
        room, tag = peer.fill(1)
        slot = peer.arrive(1, room)
        ptrs, _, lens = peer.buffers.get_buf_infos()
        port = int(peer.info.data_endpoint.rsplit(":", 1)[1])
        sender = sgl.sender(zctx, ptrs, lens)
        try:
            assert sender.send_aux_tcp("127.0.0.1", port, room, 0, slot, peer.bootstrap.aux_ptrs) == 0
            sender.send_status("127.0.0.1", port, room, int(OurKVPoll.Success))
        finally:
            sender.close()
        assert peer.quiet(700)  # no verdict from SGLang's status
        peer.status(room, 1, slot, tag)
        assert peer.verdict(1) == (Outcome.failed, Detail.room_never_landed)
    finally:
        stats = peer.close()
    assert stats.refused.rejected_auth == len(lens) + 1  # every AUX_DATA frame and the status


@grid
def test_coalesced_frames_land_in_consecutive_rows_of_sglang(env, zctx, cfg):
    ours = our_buffers(cfg)
    first = min(3, cfg.size - 1)
    n = min(5, cfg.size - first)
    for k in range(n):
        ours.set_buf(request(cfg, k, first + k))
    dst = sglang_buffers(env, cfg)
    receiver = sgl.receiver(zctx, *dst.get_buf_infos()[::2])
    push = push_socket(zctx, receiver.endpoint)
    ptrs, _, lens = ours.get_buf_infos()
    try:
        for i, payload in enumerate(wire.read_rows(ptrs, lens, first, n)):
            assert len(payload) == n * lens[i]
            push.send_multipart(wire.encode_aux(ours.room(first), i, first, payload))
        assert receiver.run(len(lens), WAIT_S) == len(lens)
    finally:
        push.close()
        receiver.close()
    assert not differing_fields(dst, ours)


# ---- status messages ---------------------------------------------------------------------------------
def test_kvpoll_values_are_sglangs():
    names = [n for n in vars(sgl.KVPoll) if not n.startswith("_")]
    assert names == [m.name for m in OurKVPoll]
    assert {n: getattr(sgl.KVPoll, n) for n in names} == {m.name: int(m) for m in OurKVPoll}


STATUSES = [(0, 0, 0, ""), (1, int(OurKVPoll.Success), 3, ""), ((1 << 63) - 1, 0, 7, "KV transfer failed"),
            (123456789, int(OurKVPoll.Transferring), 1 << 20, "ünïcode reason")]


@pytest.mark.parametrize("signed", [False, True], ids=["plain", "mac"])
def test_our_bare_status_parsed_by_sglang(zctx, signed):
    auth = Authenticator(b"k" if signed else None)
    receiver = sgl.receiver(zctx, [], [])
    push = push_socket(zctx, receiver.endpoint)
    try:
        for room, status, rank, reason in STATUSES:
            frames = auth.sign(wire.encode_status(room, OurKVPoll(status), rank, reason=reason))
            assert sgl.parse_status(frames) == (room, status, rank, reason or None)
            push.send_multipart(frames)
        assert receiver.run(len(STATUSES), WAIT_S) == len(STATUSES)
    finally:
        push.close()
        receiver.close()
    assert receiver.statuses == [(r, s, k, why or None) for r, s, k, why in STATUSES]


@pytest.mark.parametrize("signed", [False, True], ids=["plain", "mac"])
def test_our_status_frame_is_dropped_by_sglang(zctx, signed):
    """What our prefill sends since issue 39: one binary frame with the request's identity
    (its MAC inside). SGLang's decode drops it as a malformed status (it needs 3 frames of
    ASCII numbers) and applies nothing: a stock SGLang decode cannot take our statuses."""
    auth = Authenticator(b"k" if signed else None)
    receiver = sgl.receiver(zctx, [], [])
    push = push_socket(zctx, receiver.endpoint)
    frames = [[auth.sign_frame(wire.status_frame(rank, [(k, room, k, status, k * 11)]))]
              for k, (room, status, rank, _) in enumerate(STATUSES)]
    try:
        for f in frames:
            assert sgl.parse_status(f) is None
            push.send_multipart(f)
        assert receiver.run(len(frames), WAIT_S) == len(frames)
    finally:
        push.close()
        receiver.close()
    assert receiver.statuses == []


def test_sglang_status_parsed_by_ours(zctx):
    assert (sgl.kv_status_msg_tag, sgl.kv_status_msg_carries_reason) == (None, False)  # Mooncake
    for room, status, rank, reason in STATUSES:
        frames = sgl.encode_status(room, status, rank, reason)
        assert frames == [str(room).encode(), str(status).encode(), str(rank).encode()]
        msg = wire.parse(frames, [64], 1)
        assert isinstance(msg, wire.Status)
        assert (msg.room, msg.status, msg.prefill_rank, msg.reason) == (room, status, rank, "")
        assert sgl.parse_status(frames) == (room, status, rank, None)
    # over the socket, from SGLang's send_kv_status_message
    pull, port = pull_socket(zctx)
    sender = sgl.sender(zctx, [], [], prefill_rank=5)
    try:
        for room, status, _, reason in STATUSES:
            sender.send_status("127.0.0.1", port, room, status, reason or None)
        got = [wire.parse(f, [64], 1) for f in recv_all(pull, len(STATUSES))]
    finally:
        pull.close()
        sender.close()
    assert [(m.room, m.status, m.prefill_rank, m.reason) for m in got] == \
        [(room, status, 5, "") for room, status, _, _ in STATUSES]


# ---- the layout-mismatch hazard ----------------------------------------------------------------------
def test_sglang_receiver_has_no_bounds_check_wire_parse_refuses(env, zctx):
    """A prefill on the older aux layout (no sampling-mask fields) sending to a decode on
    0.5.23 with sampling masks on. SGLang's receiver writes every frame wherever field index
    and slot point: rows land in the wrong fields and an over-long payload runs past its row
    into the next. wire.parse refuses the frames that do not fit the receiver's rows; the
    same-size ones it cannot tell apart are what the bootstrap layout check refuses."""
    hidden, size = 100, 4  # 400 B hidden rows vs 256 B sampling-logprob rows
    old = OurBuffers(size, hidden, torch.float32, 64, 20, layout=load_layout("sglang_pre_0_5_23"),
                     enable_sampling_mask=False)
    cfg = Cfg(hidden=hidden, dtype=torch.float32, dsa=0, size=size, mask=64, checksum=False, top=20)
    old.set_buf(request(cfg, 1, 0, sampling_mask=False))
    dst = sglang_buffers(env, cfg)
    fresh = sglang_buffers(env, cfg)
    d_ptrs, _, d_lens = dst.get_buf_infos()
    receiver = sgl.receiver(zctx, d_ptrs, d_lens)
    push = push_socket(zctx, receiver.endpoint)
    ptrs, _, lens = old.get_buf_infos()
    frames = [wire.encode_aux(old.room(0), i, 0, p) for i, p in enumerate(wire.read_rows(ptrs, lens, 0))]
    try:
        for f in frames:
            push.send_multipart(f)
        assert receiver.run(len(frames), WAIT_S) == len(frames)
        # a field index past the receiver's list: SGLang's handler raises out of its decode loop
        push.send_multipart(wire.encode_aux(1, len(d_lens), 0, b"\0" * 64))
        with pytest.raises(IndexError):
            receiver.run(1, WAIT_S)
    finally:
        push.close()
        receiver.close()

    def as_bytes(t):
        return bytes(raw(t).numpy())

    old_fields = field_names(old)
    assert old_fields[6:10] == ["output_topk_p", "output_topk_index", "output_hidden_states", "bootstrap_room"]
    # SGLang: wrong fields, past the row, and the room never lands where decode reads it
    assert as_bytes(dst.output_token_sampling_mask_len[0]) == as_bytes(old.output_topk_p[0])
    assert as_bytes(dst.output_token_sampling_mask_idx[0])[:128] == as_bytes(old.output_topk_index[0])
    landed = as_bytes(dst.output_token_sampling_logprobs[0:2])[:400]
    assert landed == as_bytes(old.output_hidden_states[0])
    assert as_bytes(dst.output_token_sampling_logprobs[1]) != as_bytes(fresh.output_token_sampling_logprobs[1])
    assert as_bytes(dst.output_topk_p[0]) == as_bytes(old.bootstrap_room[0])
    assert int(dst.bootstrap_room[0, 0]) == 0 and old.room(0) != 0
    assert as_bytes(dst.output_hidden_states) == as_bytes(fresh.output_hidden_states)

    # ours: the decode side's strict parse against its own layout
    ours = our_buffers(cfg)
    verdicts = []
    for f in frames:
        try:
            wire.parse(f, ours.item_lens, ours.size)
            verdicts.append("accepted")
        except wire.WireError:
            verdicts.append("refused")
    assert verdicts[7] == verdicts[8] == "refused"  # 128 B into 256 B rows; 400 B into 256 B rows
    assert verdicts[6] == verdicts[9] == "accepted"  # 64 B into 64 B rows: same size, other field
    with pytest.raises(wire.WireError):
        wire.parse(wire.encode_aux(1, len(d_lens), 0, b"\0" * 64), ours.item_lens, ours.size)
    # ...and the pair never gets that far: bootstrap compares the layouts
    diff = first_difference(describe(ours.specs), describe(old.specs))
    assert diff is not None and diff.startswith("field 6:")

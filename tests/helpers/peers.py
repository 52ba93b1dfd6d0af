"""A hand-written prefill for tests: real sockets against a real decode process, every
message built with the project's own encoders (and the secret given), so a test can also
send what a well-behaved prefill never would."""

from __future__ import annotations

import zmq

from orchestrator import MetadataBuffers
from orchestrator.handoff.digest import SIGNATURE, Keys, RowDigest
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator, new_nonce
from orchestrator.handoff.workload import RequestPool, Shapes
from orchestrator.profile.layout import describe, fingerprint
from orchestrator.results.outcomes import Detail, KVPoll, Outcome

from ..conftest import DecodeProcess


class PrefillPeer:
    """Plays prefill rank `rank` against a DecodeProcess."""

    def __init__(self, cfg, tmp_path, rank: int = 0, secret: bytes = b"test-secret", decode=None,
                 nonce=None):
        self.cfg, self.rank = cfg, rank
        self.decode = decode or DecodeProcess(cfg, tmp_path, secret)
        self.info, self.plan = self.decode.info, self.decode.plan
        self.secret = secret
        self.base = self.auth = Authenticator(secret)  # until bootstrap: then the session's
        self.nonce = new_nonce() if nonce is None else nonce
        self.keys = Keys(secret, self.nonce)
        self.z = zmq.Context()
        self.control = self.z.socket(zmq.DEALER)
        self.control.connect(self.info.control_endpoint)
        self.push = self.z.socket(zmq.PUSH)
        self.push.connect(self.info.data_endpoint)
        b = cfg.buffers
        self.buffers = MetadataBuffers(b.size, b.hidden_size, b.hidden_states_dtype.value,
                                       b.max_sampling_mask_tokens, b.max_top_logprobs_num, None,
                                       b.output_dsa_topk_indices_dim, layout=cfg.layout,
                                       kv_checksum_enabled=b.kv_checksum_enabled,
                                       enable_sampling_mask=b.enable_sampling_mask, device="cpu")
        self.digest = RowDigest(self.buffers, self.keys)
        self.pool = RequestPool(cfg.workload, Shapes(b.hidden_size, self.buffers.sizes.hidden_states_dtype))
        layout = describe(self.buffers.specs)
        self.grants: dict[int, int] = {}
        self.hello = wire.encode("hello", rank=rank, layout=layout, fingerprint=fingerprint(layout),
                                 nonce=self.nonce)
        self.sealed_hello = self.base.seal(self.hello)  # what a listener on the wire could copy
        self.control.send(self.sealed_hello)
        self.bootstrap = self.recv()
        if self.bootstrap.TYPE == "bootstrap":
            self.auth = self.base.session(rank, self.nonce, self.bootstrap.nonce, "prefill")
        self.verdicts: dict[int, tuple[Outcome, Detail]] = {}

    # ---- control --------------------------------------------------------------------------
    def send_control(self, payload: bytes) -> None:
        self.control.send(self.auth.seal(payload))

    def recv(self, timeout_ms: int = 20000) -> wire.Message:
        assert self.control.poll(timeout_ms), "decode did not answer"
        body = self.auth.unseal(self.control.recv())
        assert body is not None, "the decode's reply is not authentic"
        msg = wire.decode(body)
        if msg.TYPE == "update":
            self.grants.update({rid: slot for rid, slot in msg.grants})
            self.verdicts.update({rid: (Outcome.of(o), Detail.of(d)) for rid, o, d, *_ in msg.v})
        return msg

    def arrive(self, rid: int, room: int) -> int:
        """Announce a request; returns the slot decode granted it."""
        self.send_control(wire.encode("arrive", reqs=[[rid, room]], contiguous=False))
        while rid not in self.grants:
            self.recv()
        return self.grants[rid]

    def quiet(self, ms: int) -> bool:
        """True when nothing but the decode's heartbeats (empty updates) arrives for `ms`."""
        import time

        deadline = time.monotonic() + ms / 1000
        while (left := deadline - time.monotonic()) > 0:
            if not self.control.poll(int(left * 1000) + 1):
                break
            msg = self.recv()
            if msg.TYPE != "update" or msg.grants or msg.v:
                return False
        return True

    def verdict(self, rid: int, timeout_ms: int = 20000) -> tuple[Outcome, Detail]:
        while rid not in self.verdicts:
            self.recv(timeout_ms)
        return self.verdicts[rid]

    # ---- rows ---------------------------------------------------------------------------
    def fill(self, rid: int, slot: int = 0, room=None) -> tuple[int, int]:
        """Fill local row `slot` for request `rid` (its own room unless `room` is given);
        returns (room, tag) of the row as the real prefill would digest it."""
        req = self.pool.get(rid, slot)
        if room is not None:
            req.bootstrap_room = room
        self.buffers.set_buf(req)
        (tag,), _ = self.digest.sign([slot], [(self.rank, rid)])
        if self.buffers.checksum_field is not None:
            self.buffers.write_checksums([slot], [tag], SIGNATURE)
        return req.bootstrap_room, tag

    def rows(self, slot: int = 0) -> list[bytes]:
        ptrs, _, lens = self.buffers.get_buf_infos()
        return wire.read_rows(ptrs, lens, slot)

    def send_frames(self, room: int, dst_slot: int, rows, skip=(), sign: bool = True, rid=None) -> None:
        if rid is None:
            rid = next((r for r, s in reversed(list(self.grants.items())) if s == dst_slot), 0)
        ad = rid.to_bytes(8, "little")  # the slot's tenant, which the decode knows
        for i, payload in enumerate(rows):
            if i not in skip:
                frames = wire.encode_aux(room, i, dst_slot, payload)
                self.push.send_multipart(self.auth.sign(frames, ad) if sign else frames)

    def status(self, room: int, rid: int, dst_slot: int, tag: int, status=KVPoll.Success,
               sign: bool = True) -> None:
        raw = wire.status_frame(self.rank, [(rid, room, dst_slot, int(status), tag)])  # as the real prefill
        self.push.send(self.auth.sign_frame(raw) if sign else raw)

    def handoff(self, rid: int, corrupt=None) -> tuple[Outcome, Detail]:
        """A whole tcp-route handoff of request `rid` from local row 0."""
        room, tag = self.fill(rid)
        slot = self.arrive(rid, room)
        rows = self.rows()
        if corrupt is not None:
            field, offset = corrupt
            rows[field] = rows[field][:offset] + bytes([rows[field][offset] ^ 0xFF]) + rows[field][offset + 1:]
        self.send_frames(room, slot, rows)
        self.status(room, rid, slot, tag)
        return self.verdict(rid)

    def close(self):
        try:
            return self.decode.stop()
        finally:
            self.control.close(0)
            self.push.close(0)
            self.z.term()

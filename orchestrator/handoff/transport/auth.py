"""Message authentication for everything that can change a verdict.

Every run has a secret: the one named by `transport.secret_env` (multi-host runs, where both
sides must share it), or else a fresh one the runner generates and hands to its own child
processes in memory (never on a command line, in the environment or in the run dir). With
it, every control message, status message and AUX_DATA frame carries a keyed blake2b MAC: as
one extra, last frame on SGLang's multipart formats (sign/open), appended inside the frame on
our own single-frame ones (the control channel's seal/unseal, the data plane's status frame:
sign_frame/open_frame); a message without a valid one is rejected and counted, never acted on.
The same secret keys the row digests (orchestrator.handoff.digest), so a row written into registered
memory by anyone else (Mooncake authenticates nobody) cannot pass verification either.

An extra last frame keeps SGLang's formats readable by SGLang: its AUX_DATA handler reads
frames 0-5 and its status parser frames 0-3, and both ignore what follows.

Binding to the run (issue 19). A secret shared by several runs (transport.secret_env) must
not let one run's messages open in another: every prefill process draws a nonce, every
decode process draws its own, and they swap them at bootstrap (hello / bootstrap). From then
on each (prefill rank, decode process) pair talks under a Session whose keys derive from the
secret AND both nonces, one key per direction (a message reflected back never opens).
Control messages under a session carry a sequence number inside the MAC: one seen again or
out of order is a replay (`Replayed`), counted and never acted on. Data-plane MACs also
cover associated data the receiver knows (the request ids of the slots an AUX_DATA frame
lands in), so a frame replayed into another tenant's slot does not open. Only hello and its
bootstrap answer travel under the secret alone, and hello binds nothing but a connection
(orchestrator.handoff.endpoints.decode).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Optional, Sequence, cast

MAC_BYTES = 16
NONCE_BYTES = 16
_SEQ = 8
_FRAME = b"orch-frame-v1"  # sign_frame's label, MAC'd after the payload (never sent)


class Replayed(ValueError):
    """An authentic control message seen before (or older than one seen): a replay."""


def new_nonce() -> str:
    """A process's per-run nonce, as the hex string hello/bootstrap carry."""
    return secrets.token_hex(NONCE_BYTES)


class Authenticator:
    """With no secret (SGLang interoperability tests only), sign() adds nothing and open()
    passes every message through."""

    def __init__(self, secret: Optional[bytes], *, key: Optional[bytes] = None):
        self._key = key if key is not None else (
            hashlib.blake2b(secret, digest_size=32, person=b"orch-mac-v1").digest()
            if secret is not None else None)
        # keyed once: each MAC starts from a copy (the key block is hashed here, not per frame)
        self._keyed = hashlib.blake2b(key=self._key, digest_size=MAC_BYTES) if self._key is not None else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _mac(self, frames: Sequence[bytes]) -> bytes:
        h = cast("hashlib._Hash", self._keyed).copy()  # callers: no key, no MAC
        for frame in frames:
            h.update(len(frame).to_bytes(4, "big"))
            h.update(frame)
        return h.digest()

    def sign(self, frames: list[bytes], ad: bytes = b"") -> list[bytes]:
        """`frames` plus their MAC frame; `ad` (associated data the receiver knows on its
        own) is covered by the MAC and not sent."""
        return frames + [self._mac(frames + [ad] if ad else frames)] if self._key is not None else frames

    def sign_frame(self, payload: bytes) -> bytes:
        """One data-plane frame of ours (orchestrator.handoff.transport.wire's status frame):
        the payload with its MAC appended, no sequence number (the receiver's ledger tells a
        replay). The MAC covers the payload and a label, so no frame of ours opens as a
        message of another kind under the same key (a sealed control message, a signed
        multipart one)."""
        return payload + self._mac([payload, _FRAME]) if self._key is not None else payload

    def open_frame(self, frame: bytes) -> Optional[bytes]:
        """The payload of a frame from sign_frame, or None when it is not authentic."""
        return self._trailed(frame, (_FRAME,))

    def seal(self, payload: bytes) -> bytes:
        """One frame: the payload with its MAC appended (the control channel is ours)."""
        return payload + self._mac([payload]) if self._key is not None else payload

    def unseal(self, frame: bytes) -> Optional[bytes]:
        """The payload of a sealed frame, or None when it is not authentic."""
        return self._trailed(frame, ())

    def _trailed(self, frame: bytes, label: tuple[bytes, ...]) -> Optional[bytes]:
        """A frame's payload when its trailing MAC is the payload's (with `label`, which
        tells sign_frame's from seal's), else None; the frame as it is with no key."""
        if self._key is None:
            return frame
        if len(frame) < MAC_BYTES:
            return None
        payload, mac = frame[:-MAC_BYTES], frame[-MAC_BYTES:]
        return payload if hmac.compare_digest(self._mac([payload, *label]), mac) else None

    def open(self, frames: Sequence[bytes], ad: bytes = b"") -> Optional[list[bytes]]:
        """The message without its MAC frame, or None when it is not authentic."""
        if self._key is None:
            return list(frames)
        if len(frames) < 2:
            return None
        body, mac = list(frames[:-1]), frames[-1]
        return body if hmac.compare_digest(self._mac(body + [ad] if ad else body), mac) else None

    def session(self, rank: int, prefill_nonce: str, decode_nonce: str, side: str) -> "Session":
        """The keys of one (prefill rank, decode process) pair in this run, for `side`
        ("prefill" or "decode"): what it sends is keyed for its own direction."""
        secret_key = self._key
        if secret_key is None:
            return Session(None, None)
        material = f"{rank}|{prefill_nonce}|{decode_nonce}".encode()

        def key(direction: bytes) -> bytes:
            return hashlib.blake2b(material, key=secret_key, digest_size=32,
                                   person=b"orch-sess-" + direction).digest()

        p2d, d2p = key(b"p2d"), key(b"d2p")
        return Session(p2d, d2p) if side == "prefill" else Session(d2p, p2d)


class Session(Authenticator):
    """One pair's keys in one run. sign/seal use the sending direction's key, open/unseal
    the receiving one's; sealed (control) payloads carry a sequence number, and unseal
    raises Replayed for one not above the last seen (ZMQ keeps a connection's order)."""

    def __init__(self, send_key: Optional[bytes], recv_key: Optional[bytes]):
        super().__init__(None, key=send_key)
        self._recv = Authenticator(None, key=recv_key)
        self._sent = 0
        self._seen = 0

    def open(self, frames: Sequence[bytes], ad: bytes = b"") -> Optional[list[bytes]]:
        return self._recv.open(frames, ad)

    def open_frame(self, frame: bytes) -> Optional[bytes]:
        return self._recv.open_frame(frame)

    def seal(self, payload: bytes) -> bytes:
        if self._key is None:
            return payload
        self._sent += 1
        return super().seal(self._sent.to_bytes(_SEQ, "big") + payload)

    def unseal(self, frame: bytes) -> Optional[bytes]:
        if self._key is None:
            return frame
        body = self._recv.unseal(frame)
        if body is None or len(body) < _SEQ:
            return None
        seq = int.from_bytes(body[:_SEQ], "big")
        if seq <= self._seen:
            raise Replayed(f"control message {seq} after {self._seen}")
        self._seen = seq
        return body[_SEQ:]

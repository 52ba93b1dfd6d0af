"""Message authentication for everything that can change a verdict.

Every run has a secret: the one named by `transport.secret_env` (multi-host runs, where both
sides must share it), or else a fresh one the runner generates and hands to its own child
processes in memory (never on a command line, in the environment or in the run dir). With
it, every control message, status message and AUX_DATA frame carries a keyed blake2b MAC as
one extra, last frame; a message without a valid one is rejected and counted, never acted on.
The same secret keys the row digests (orchestrator.digest), so a row written into registered
memory by anyone else (Mooncake authenticates nobody) cannot pass verification either.

An extra last frame keeps SGLang's formats readable by SGLang: its AUX_DATA handler reads
frames 0-5 and its status parser frames 0-3, and both ignore what follows.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Mapping, Optional, Sequence

from .config import ConfigError

MAC_BYTES = 16


class Authenticator:
    """With no secret (SGLang interoperability tests only), sign() adds nothing and open()
    passes every message through."""

    def __init__(self, secret: Optional[bytes]):
        self._key = (hashlib.blake2b(secret, digest_size=32, person=b"orch-mac-v1").digest()
                     if secret is not None else None)

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _mac(self, frames: Sequence[bytes]) -> bytes:
        h = hashlib.blake2b(key=self._key, digest_size=MAC_BYTES)
        for frame in frames:
            h.update(len(frame).to_bytes(4, "big"))
            h.update(frame)
        return h.digest()

    def sign(self, frames: list[bytes]) -> list[bytes]:
        return frames + [self._mac(frames)] if self._key is not None else frames

    def seal(self, payload: bytes) -> bytes:
        """One frame: the payload with its MAC appended (the control channel is ours)."""
        return payload + self._mac([payload]) if self._key is not None else payload

    def unseal(self, frame: bytes) -> Optional[bytes]:
        """The payload of a sealed frame, or None when it is not authentic."""
        if self._key is None:
            return frame
        if len(frame) < MAC_BYTES:
            return None
        payload, mac = frame[:-MAC_BYTES], frame[-MAC_BYTES:]
        return payload if hmac.compare_digest(self._mac([payload]), mac) else None

    def open(self, frames: Sequence[bytes]) -> Optional[list[bytes]]:
        """The message without its MAC frame, or None when it is not authentic."""
        if self._key is None:
            return list(frames)
        if len(frames) < 2:
            return None
        body, mac = list(frames[:-1]), frames[-1]
        return body if hmac.compare_digest(self._mac(body), mac) else None


def secret_from_env(secret_env: str, env: Mapping[str, str]) -> bytes:
    value = env.get(secret_env, "")
    if not value:
        raise ConfigError("transport.secret_env", secret_env,
                          "the name of a set, non-empty environment variable holding the secret")
    return value.encode()


def run_secret(secret_env: Optional[str], env: Optional[Mapping[str, str]] = None) -> bytes:
    """The secret of a run: the configured one, or a fresh random one for this run alone."""
    if secret_env is not None:
        return secret_from_env(secret_env, os.environ if env is None else env)
    return secrets.token_bytes(32)

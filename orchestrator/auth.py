"""Optional message authentication for the control channel and the status messages.

With `transport.secret_env` naming an environment variable, every control message and every
AUX_STATUS carries an HMAC-SHA256 of its bytes as one extra frame; a message without a valid
MAC is rejected and counted. The AUX_DATA frames themselves stay SGLang's format: their
integrity follows from the row checksum, which travels inside the authenticated status.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Optional, Sequence

from .config import ConfigError


class Authenticator:
    """No secret: sign() adds nothing and check() accepts unsigned messages only."""

    def __init__(self, secret: Optional[bytes]):
        self._secret = secret

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def _mac(self, frames: Sequence[bytes]) -> bytes:
        h = hmac.new(self._secret, digestmod=hashlib.sha256)
        for frame in frames:
            h.update(len(frame).to_bytes(4, "big"))
            h.update(frame)
        return h.hexdigest().encode()

    def sign(self, frames: list[bytes]) -> list[bytes]:
        return frames + [self._mac(frames)] if self._secret is not None else frames

    def check(self, frames: Sequence[bytes], expected_frames: int) -> Optional[list[bytes]]:
        """The message without its MAC frame, or None when it is not authentic."""
        if self._secret is None:
            return list(frames) if len(frames) == expected_frames else None
        if len(frames) != expected_frames + 1:
            return None
        body, mac = list(frames[:-1]), frames[-1]
        return body if hmac.compare_digest(self._mac(body), mac) else None


def from_env(secret_env: Optional[str]) -> Authenticator:
    if secret_env is None:
        return Authenticator(None)
    value = os.environ.get(secret_env, "")
    if not value:
        raise ConfigError("transport.secret_env", secret_env,
                          "the name of a set, non-empty environment variable holding the secret")
    return Authenticator(value.encode())

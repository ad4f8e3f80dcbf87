"""The deployment's credentials: the public API key, the admin key and the internal cluster secret.

- **API key** (``--api-key`` / ``EPD_API_KEY``): what a public client sends as ``Authorization:
  Bearer <key>`` (OpenAI's semantics). Optional: without it the public API is open.
- **Admin key** (``--admin-key`` / ``EPD_ADMIN_KEY``): what worker registration on the router needs.
  Without it registration is disabled.
- **Cluster secret** (``--cluster-secret-file`` / ``EPD_CLUSTER_SECRET``): shared by every role of
  one deployment (``up`` generates one). Nothing sends it, nor any key derived from it: each use
  derives its own key (``derive``), and internal HTTP calls carry a MAC per request bound to the
  peer addressed (``security.peers``), so nothing a peer receives works anywhere else.

All comparisons are constant-time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

API_KEY_ENV = "EPD_API_KEY"
ADMIN_KEY_ENV = "EPD_ADMIN_KEY"
CLUSTER_SECRET_ENV = "EPD_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16


class CredentialError(ValueError):
    """A credential is missing, too weak or unreadable (a configuration error at start-up)."""


def same(given: str | bytes | None, expected: str | bytes) -> bool:
    """Constant-time equality of a presented credential with the expected one."""
    if given is None:
        return False
    a = given.encode() if isinstance(given, str) else given
    b = expected.encode() if isinstance(expected, str) else expected
    return hmac.compare_digest(a, b)


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True)
class ClusterCredential:
    """The cluster secret and the keys derived from it, one per purpose."""

    secret: bytes = field(repr=False)
    _keys: dict[str, bytes] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_BYTES:
            raise CredentialError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")

    def derive(self, purpose: str) -> bytes:
        """A 32-byte key for one purpose ("http/peer-mac", "ec-handle", "ec-tcp", ...), derived once."""
        key = self._keys.get(purpose)
        if key is None:
            key = self._keys[purpose] = hmac.new(
                self.secret, b"epdserve/v1/" + purpose.encode(), hashlib.sha256
            ).digest()
        return key

    @classmethod
    def generate(cls) -> ClusterCredential:
        return cls(secrets.token_hex(32).encode())

    @classmethod
    def from_text(cls, text: str) -> ClusterCredential:
        return cls(text.strip().encode())

    @classmethod
    def from_file(cls, path: str | Path) -> ClusterCredential:
        """Read the secret from a file only its owner can read (a Kubernetes Secret volume is 0400/0440
        of root or the pod's user: group-readable is tolerated, world-readable is not)."""
        p = Path(path)
        try:
            st = p.stat()
            text = p.read_text()
        except OSError as e:
            raise CredentialError(f"cannot read the cluster secret file {p}: {e.strerror or e}") from None
        if st.st_mode & stat.S_IROTH:
            raise CredentialError(f"the cluster secret file {p} is readable by everyone (chmod 600 it)")
        return cls.from_text(text)

    @classmethod
    def load(cls, path: str | None = None) -> ClusterCredential | None:
        """From ``path`` when given, else from ``EPD_CLUSTER_SECRET``; None when neither is set."""
        if path:
            return cls.from_file(path)
        text = os.environ.get(CLUSTER_SECRET_ENV, "")
        return cls.from_text(text) if text.strip() else None


def api_key_from(value: str | None, env: str = API_KEY_ENV) -> str:
    """A key given on the command line, else in the environment, else "" (not required)."""
    return (value if value is not None else os.environ.get(env, "")).strip()

"""Signed handles: a producer signs every handle it issues with a key derived from the cluster
secret, and a consumer acts on a handle only after its MAC verifies.

That is the whole trust model of the EC connectors: a handle arrives from a client, so any field of
it (a host and port to dial, a slab offset to read, a file to touch, a lease to release) is only
believed when it carries a valid MAC, i.e. when a producer of this cluster wrote it. Verification
runs before any I/O and compares in constant time.

The MAC covers the canonical JSON (keys sorted, msgspec's encoding) of every field but ``mac``, so
a handle stays valid through any JSON round trip and any change to any field breaks it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

import msgspec

from epdserve.transfer.base import Handle, InvalidHandle

MAC_FIELD = "mac"
LEASE_BYTES = 16


def _mac(fields: Handle, key: bytes) -> str:
    try:
        canonical = msgspec.json.encode(fields, order="sorted")
    except (TypeError, msgspec.EncodeError):
        raise InvalidHandle("the EC handle is not plain JSON") from None
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def sign(handle: Handle, key: bytes) -> Handle:
    """``handle`` with a ``mac`` over every other field."""
    fields = {k: v for k, v in handle.items() if k != MAC_FIELD}
    return {**fields, MAC_FIELD: _mac(fields, key)}


def verify(handle: object, key: bytes, now: float | None = None) -> Handle:
    """The handle, if ``key`` signed it and its lease has not expired; InvalidHandle otherwise."""
    if not isinstance(handle, dict):
        raise InvalidHandle("the EC handle is not a JSON object")
    mac = handle.get(MAC_FIELD)
    if not isinstance(mac, str):
        raise InvalidHandle("the EC handle is not signed")
    fields = {k: v for k, v in handle.items() if k != MAC_FIELD}
    if not hmac.compare_digest(mac.encode("utf-8", "replace"), _mac(fields, key).encode()):
        raise InvalidHandle("the EC handle's signature does not verify (forged, altered, or from another cluster)")
    expires_at = handle.get("expires_at")
    if isinstance(expires_at, bool) or not isinstance(expires_at, int | float):
        raise InvalidHandle("the EC handle has no expiry")
    if (time.time() if now is None else now) > expires_at:
        raise InvalidHandle("the EC handle has expired")
    if not isinstance(handle.get("lease"), str):
        raise InvalidHandle("the EC handle has no lease")
    return handle


def verify_with(handle: object, key: bytes | None) -> Handle:
    """``verify``, for a consumer that may have no cluster secret (then no handle is acceptable)."""
    if key is None:
        raise InvalidHandle("this instance has no cluster credential, so it accepts no EC handle")
    return verify(handle, key)


def new_lease() -> str:
    """A fresh lease token: 128 random bits as hex, never zero in its first 64 bits (the shm
    connector uses them as a release word, where zero means "not released")."""
    while True:
        lease = secrets.token_hex(LEASE_BYTES)
        if int(lease[:16], 16):
            return lease


def issue(handle: Handle, key: bytes, ttl_s: float, lease: str) -> Handle:
    """Stamp ``handle`` with its lease and lifetime, and sign it."""
    now = time.time()
    return sign({**handle, "issued_at": now, "expires_at": now + ttl_s, "lease": lease}, key)

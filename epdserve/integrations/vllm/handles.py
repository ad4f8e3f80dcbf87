"""epdserve handles inside vLLM's per-request ``ec_transfer_params`` (vLLM- and torch-free).

The router puts one signed handle per media item it had encoded in ``ec_transfer_params`` and
gives each item the handle's key as its uuid (the content part's ``uuid``), so vLLM names the item
by the key the encoder signed: its prefix cache and encoder cache key the same media the same way
on every worker, and a handle can only ever fill the item whose identifier is its key::

    "ec_transfer_params": {"epdserve_handles": [<handle>, ...]}

Nothing here trusts a handle: the connector verifies each one (signature, expiry, model, shape,
dtype, checksum) with the transfer package before any byte of it is used.
"""

from __future__ import annotations

from epdserve.transfer.base import Handle, InvalidHandle

PARAMS_KEY = "epdserve_handles"


def ec_transfer_params(handles: list[Handle]) -> dict[str, list[Handle]]:
    """What the router sends vLLM for a request whose items were encoded into ``handles``."""
    return {PARAMS_KEY: list(handles)}


def handles_by_key(params: object, limit: int) -> tuple[dict[str, Handle], list[Handle]]:
    """The handles of a request's ``ec_transfer_params`` by the key they name, and the surplus
    ones (a second handle on the same content, for an item repeated in the prompt: one read
    serves both, the other lease is only given back). InvalidHandle when they are malformed or
    more than ``limit``."""
    if params is None:
        return {}, []
    if not isinstance(params, dict):
        raise InvalidHandle("ec_transfer_params is not a JSON object")
    handles = params.get(PARAMS_KEY)
    if handles is None:
        return {}, []
    if not isinstance(handles, list):
        raise InvalidHandle(f"ec_transfer_params.{PARAMS_KEY} is not a list")
    if len(handles) > limit:
        raise InvalidHandle(f"ec_transfer_params carries {len(handles)} handles for {limit} media items")
    by_key: dict[str, Handle] = {}
    surplus: list[Handle] = []
    for h in handles:
        key = h.get("key") if isinstance(h, dict) else None
        if not isinstance(key, str) or not key:
            raise InvalidHandle("an EC handle in ec_transfer_params names no key")
        if key in by_key:
            surplus.append(h)
        else:
            by_key[key] = h
    return by_key, surplus

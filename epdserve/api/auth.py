"""Who may call which endpoint of a role: the access level of each route and its check.

=========  ==============================================================================
open       ``/health``, ``/metrics``, ``/version``: anyone (probes and scrapers)
public     the OpenAI API: a client with ``Authorization: Bearer <api key>`` when the role has
           an API key, anyone when it has none; a caller with the cluster credential always
internal   ``/v1/encode``, ``/v1/release``, a worker behind a router: only the cluster credential,
           proven by a MAC bound to this instance and to the request (``security.peers``);
           a wrong or missing proof is 401, a proof addressed to another instance 403
admin      worker registration on the router: ``Authorization: Bearer <admin key>``; without an
           admin key configured the endpoint is switched off (403)
=========  ==============================================================================

A request that proved the cluster credential is marked (``is_internal``): only such a request may
carry metadata-only media items with connector handles (docs/security.md). ``POST /v1/attest``
(open) answers the router's admission challenge (``attest``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from aiohttp import web

from epdserve.api.errors import BadRequest, Forbidden, Unauthorized
from epdserve.api.http import read_body
from epdserve.security.credentials import ClusterCredential, bearer, same
from epdserve.security.peers import PEER_HEADER, PeerAuthError, PeerVerifier, WrongPeer

Access = Literal["open", "public", "internal", "admin"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BodyHolder = Callable[[web.Request], AbstractAsyncContextManager[None]]  # reads a body, holds it until the answer
_INTERNAL_KEY = web.RequestKey("epd_internal", bool)


@dataclass(frozen=True)
class AuthConfig:
    """The credentials one role checks."""

    api_key: str = field(default="", repr=False)  # public clients' Bearer key ("": the public API is open)
    admin_key: str = field(default="", repr=False)  # registration's Bearer key ("": registration is off)
    cluster: ClusterCredential | None = None  # the deployment's internal credential (None: no internal calls)
    internal_only: bool = False  # public routes need the cluster credential too (a worker behind a router)
    names: tuple[str, ...] = ()  # hosts peers address this role by besides its socket's address (advertised)

    def verifier(self) -> PeerVerifier | None:
        """The check of internal requests' proofs for one app (it owns the replay cache)."""
        return PeerVerifier(self.cluster, self.names) if self.cluster is not None else None


def is_internal(request: web.Request) -> bool:
    """Whether this request proved the cluster credential."""
    return bool(request.get(_INTERNAL_KEY, False))


def is_operator(request: web.Request, auth: AuthConfig) -> bool:
    """Whether the caller proved the cluster credential or the admin key (what an open route may
    show only to the deployment's operator, e.g. the workers' addresses)."""
    if is_internal(request):
        return True
    return bool(auth.admin_key) and same(bearer(request.headers.get("Authorization")), auth.admin_key)


def _sockname(request: web.Request) -> tuple | None:
    """The local address the request's connection arrived at (what the caller dialled)."""
    transport = request.transport
    return transport.get_extra_info("sockname") if transport is not None else None


async def _proven(request: web.Request, verifier: PeerVerifier | None, strict: bool) -> bool:
    """Whether the request carries a valid peer proof. ``strict``: a bad one is an error (401,
    403 when addressed to another instance) rather than just not internal."""
    header = request.headers.get(PEER_HEADER)
    if verifier is None or header is None:
        return False
    body = await read_body(request)
    try:
        verifier.verify(
            header,
            request.method,
            request.path_qs,
            body,
            _sockname(request),
        )
    except WrongPeer as e:
        if strict:
            raise Forbidden(f"Internal request refused: {e}.") from None
        return False
    except PeerAuthError as e:
        if strict:
            raise Unauthorized(f"Internal request refused: {e}.") from None
        return False
    return True


def guard(
    handler: Handler, access: Access, auth: AuthConfig, hold_body: BodyHolder, verifier: PeerVerifier | None = None
) -> Handler:
    """``handler`` behind the check of ``access`` (``verifier``: the app's check of peer proofs;
    ``hold_body``: reads the body within the role's bound and holds it until the answer,
    ``api.bodies``). A request that carries no peer proof is decided on its headers alone, before
    any of its body is read: a request refused by its credential never holds the role's bound or
    memory. A peer proof covers the body, so it is checked once the body has arrived."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        strict = access == "internal" or (auth.internal_only and access != "open")
        if verifier is None or PEER_HEADER not in request.headers:
            request[_INTERNAL_KEY] = False
            _admit(request, access, auth, strict, internal=False)
            async with hold_body(request):
                return await handler(request)
        async with hold_body(request):
            internal = await _proven(request, verifier, strict or access == "public")
            request[_INTERNAL_KEY] = internal
            _admit(request, access, auth, strict, internal)
            return await handler(request)

    return guarded


def _admit(request: web.Request, access: Access, auth: AuthConfig, strict: bool, internal: bool) -> None:
    """Raise unless a request to a route of ``access`` may be served (``internal``: it proved the
    cluster credential; ``strict``: the route needs that proof)."""
    if access == "open":
        return
    if access == "admin":
        if not auth.admin_key:
            raise Forbidden("Worker registration is switched off: start the router with --admin-key.")
        if not same(bearer(request.headers.get("Authorization")), auth.admin_key):
            raise Unauthorized("This endpoint needs the admin key (Authorization: Bearer <admin key>).")
    elif strict:
        if not internal:
            raise Unauthorized("This endpoint is internal: the cluster credential is missing or wrong.")
    elif auth.api_key and not internal and not same(bearer(request.headers.get("Authorization")), auth.api_key):
        raise Unauthorized("Incorrect API key provided.")


def attest_route(verifier: PeerVerifier | None) -> Handler:
    """``POST /v1/attest``: ``{"nonce", "target"}`` → ``{"proof"}`` for a target that is this
    instance's own (the router's admission challenge; no credential travels either way)."""

    async def attest(request: web.Request) -> web.StreamResponse:
        if verifier is None:
            raise Forbidden("This instance has no cluster credential.")
        try:
            info = msgspec.json.decode(await read_body(request))
            nonce, target = info["nonce"], info["target"]
            if not isinstance(target, str) or not isinstance(nonce, str) or not 16 <= len(bytes.fromhex(nonce)) <= 64:
                raise ValueError
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            raise BadRequest('the body must be {"nonce": <hex>, "target": "host:port"}') from None
        try:
            proof = verifier.attest(target, nonce, _sockname(request))
        except WrongPeer as e:
            raise Forbidden(str(e)) from None
        return web.json_response({"proof": proof})

    return attest

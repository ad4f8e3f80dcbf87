"""Who may call which endpoint of a role: the access level of each route and its check.

=========  ==============================================================================
open       ``/health``, ``/metrics``, ``/version``: anyone (probes and scrapers)
public     the OpenAI API: a client with ``Authorization: Bearer <api key>`` when the role has
           an API key, anyone when it has none; a caller with the cluster credential always
internal   ``/v1/encode``, ``/v1/release``, a worker behind a router: only the cluster credential
admin      worker registration on the router: ``Authorization: Bearer <admin key>``; without an
           admin key configured the endpoint is switched off (403)
=========  ==============================================================================

A request that proved the cluster credential is marked (``is_internal``): only such a request may
carry metadata-only media items with connector handles (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web

from epdserve.api.errors import Forbidden, Unauthorized
from epdserve.security.credentials import CLUSTER_HEADER, ClusterCredential, bearer, same

Access = Literal["open", "public", "internal", "admin"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_INTERNAL_KEY = web.RequestKey("epd_internal", bool)


@dataclass(frozen=True)
class AuthConfig:
    """The credentials one role checks."""

    api_key: str = field(default="", repr=False)  # public clients' Bearer key ("": the public API is open)
    admin_key: str = field(default="", repr=False)  # registration's Bearer key ("": registration is off)
    cluster: ClusterCredential | None = None  # the deployment's internal credential (None: no internal calls)
    internal_only: bool = False  # public routes need the cluster credential too (a worker behind a router)


def is_internal(request: web.Request) -> bool:
    """Whether this request proved the cluster credential."""
    return bool(request.get(_INTERNAL_KEY, False))


def is_operator(request: web.Request, auth: AuthConfig) -> bool:
    """Whether the caller proved the cluster credential or the admin key (what an open route may
    show only to the deployment's operator, e.g. the workers' addresses)."""
    if auth.cluster is not None and auth.cluster.accepts(request.headers.get(CLUSTER_HEADER)):
        return True
    return bool(auth.admin_key) and same(bearer(request.headers.get("Authorization")), auth.admin_key)


def guard(handler: Handler, access: Access, auth: AuthConfig) -> Handler:
    """``handler`` behind the check of ``access``."""
    if access == "open":
        return handler

    async def guarded(request: web.Request) -> web.StreamResponse:
        internal = auth.cluster is not None and auth.cluster.accepts(request.headers.get(CLUSTER_HEADER))
        request[_INTERNAL_KEY] = internal
        if access == "admin":
            if not auth.admin_key:
                raise Forbidden("Worker registration is switched off: start the router with --admin-key.")
            if not same(bearer(request.headers.get("Authorization")), auth.admin_key):
                raise Unauthorized("This endpoint needs the admin key (Authorization: Bearer <admin key>).")
        elif access == "internal" or auth.internal_only:
            if not internal:
                raise Unauthorized("This endpoint is internal: the cluster credential is missing or wrong.")
        elif auth.api_key and not internal and not same(bearer(request.headers.get("Authorization")), auth.api_key):
            raise Unauthorized("Incorrect API key provided.")
        return await handler(request)

    return guarded

"""What the router makes of a worker's answer: a failure worth another worker, or an error that
is the client's (passed on as the router's own)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from epdserve.api.errors import RETRY_AFTER_S, ApiError, BadRequest, NotFound, PayloadTooLarge, Timeout
from epdserve.api.http_client import Response
from epdserve.media.errors import MEDIA_CODES


class RetryableWorker(Exception):
    """A worker failed before anything reached the client: the request may go to another."""

    def __init__(self, url: str, reason: str, worker_ok: bool = False) -> None:
        super().__init__(reason)
        self.url = url
        self.worker_ok = worker_ok  # the worker is fine, its inputs were not (embeddings gone): it may take the retry


def error_code(raw: bytes) -> str | None:
    """The ``code`` of an OpenAI-style error body, if it has one."""
    try:
        code = msgspec.json.decode(raw)["error"]["code"]
    except Exception:
        return None
    return code if isinstance(code, str) else None


def about_media(raw: bytes) -> bool:
    """Whether a worker's error answer is about the request's own media (undecodable, too large,
    too slow to fetch or decode): the client's error, whatever its status, never the worker's."""
    return error_code(raw) in MEDIA_CODES


def error_response(upstream: Response, raw: bytes) -> web.Response:
    """A worker's answer passed to the client as it is (status, body, type and Retry-After)."""
    resp = web.Response(body=raw, status=upstream.status)
    for h in ("Content-Type", "Retry-After"):
        if h in upstream.headers:
            resp.headers[h] = upstream.headers[h]
    if upstream.status in (429, 503):  # every 429 and 503 says when to retry
        resp.headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    return resp


def passthrough_error(status: int, raw: bytes) -> ApiError:
    """A worker's 4xx (or media error) about the client's request, as the router's own error,
    its code and param kept."""
    code = param = None
    try:
        err = msgspec.json.decode(raw)["error"]
        message = str(err.get("message"))
        code = err.get("code") if isinstance(err.get("code"), str) else None
        param = err.get("param") if isinstance(err.get("param"), str) else None
    except Exception:
        message = raw[:200].decode(errors="replace")
    if status == 413:
        return PayloadTooLarge(message, param=param, code=code)
    if status == 404:
        return NotFound(message, param="model", code="model_not_found")
    if status == 504:
        return Timeout(message, param=param, code=code)
    return BadRequest(message, param=param, code=code)

"""Typed client-facing errors: each carries its HTTP status and OpenAI error ``type``/``code``.

Anything that rejects a request raises one of these; the server turns it into a response with
``err.status`` and body ``err.to_json()``, which is exactly OpenAI's error shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from epdserve.media.errors import InvalidMedia, MediaError, MediaTimeout, MediaTooLarge

EMBEDS_UNAVAILABLE = "embeddings_unavailable"  # 503 code: the router retries with a fresh encode
RETRY_AFTER_S = 1  # Retry-After of a 429 or 503 that names no other wait


class ApiError(Exception):
    """Base of all errors that reach the client; unexpected failures map to 500 server_error."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    # seconds a client should wait before retrying; every 429 and 503 carries one
    default_retry_after_s: ClassVar[int | None] = None

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.retry_after_s = retry_after_s if retry_after_s is not None else self.default_retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def to_dict(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def to_json(self) -> bytes:
        return msgspec.json.encode(self.to_dict())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r}, code={self.code!r})"


class BadRequest(ApiError):
    """The request is malformed or asks for something invalid (400)."""

    status = 400
    error_type = "invalid_request_error"


class Unauthorized(ApiError):
    """The request lacks the credential the endpoint needs (401, OpenAI's ``invalid_api_key``)."""

    status = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class Forbidden(ApiError):
    """The endpoint exists but is switched off on this instance (403)."""

    status = 403
    error_type = "invalid_request_error"
    default_code = "forbidden"


class NotFound(ApiError):
    """The named resource does not exist, e.g. an unknown model (404, code ``model_not_found``)."""

    status = 404
    error_type = "invalid_request_error"

    @classmethod
    def model(cls, name: str) -> NotFound:
        return cls(f"The model `{name}` does not exist.", param="model", code="model_not_found")


class BodyStalled(ApiError):
    """A request body stopped arriving: nothing came for too long (408)."""

    status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class PayloadTooLarge(ApiError):
    """A body or media item exceeds a configured size limit (413)."""

    status = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


class Overloaded(ApiError):
    """The server refuses new work right now; the client should retry later (429)."""

    status = 429
    error_type = "rate_limit_error"
    default_code = "overloaded"
    default_retry_after_s = RETRY_AFTER_S


class WorkerFailed(ApiError):
    """A backend worker (encoder, prefill, decode) failed while serving the request (502)."""

    status = 502
    error_type = "server_error"
    default_code = "worker_failed"


class Unavailable(ApiError):
    """No worker can serve the request at the moment, e.g. during startup or shutdown (503)."""

    status = 503
    error_type = "server_error"
    default_code = "unavailable"
    default_retry_after_s = RETRY_AFTER_S  # a worker restarting or starting comes back within seconds


class Timeout(ApiError):
    """An upstream step (media fetch, worker) did not answer in time (504)."""

    status = 504
    error_type = "server_error"
    default_code = "timeout"


def context_too_long(
    limit: int, prompt_tokens: int, completion_tokens: int, exact: bool = False, param: str = "messages"
) -> BadRequest:
    """OpenAI's answer to a prompt (plus the completion asked for) over the context length;
    unless ``exact``, ``prompt_tokens`` is a lower bound (the prompt was not counted to its end)."""
    asked = f", and {completion_tokens} were asked for the completion" if completion_tokens else ""
    return BadRequest(
        f"This model's maximum context length is {limit} tokens; the {param} hold "
        f"{prompt_tokens}{'' if exact else ' or more'} tokens{asked}. Shorten the {param} or the completion.",
        param=param,
        code="context_length_exceeded",
    )


def from_media_error(e: MediaError) -> ApiError:
    """The HTTP answer to a media error (the edge is the only place media errors meet statuses)."""
    if isinstance(e, MediaTooLarge):
        return PayloadTooLarge(e.message, code=e.code)
    if isinstance(e, MediaTimeout):
        return Timeout(e.message, code=e.code)
    if isinstance(e, InvalidMedia):
        return BadRequest(e.message, code=e.code)
    return BadRequest(e.message, code=e.code)

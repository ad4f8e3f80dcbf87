"""Error answers: a failed request's answer lets go of everything the request held."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from epdserve.api.errors import BadRequest, Overloaded
from epdserve.api.http import error_middleware


@pytest.mark.parametrize(("error", "status"), [(Overloaded, 429), (BadRequest, 400)])
def test_an_error_answer_frees_what_the_handler_held_at_once(error: type[Exception], status: int) -> None:
    """A handler's locals (a request's body, its pixels) are freed as soon as its error is answered,
    not at the next full garbage collection: under a burst of refused image requests that was
    gigabytes of pixels."""
    held: list[weakref.ref] = []

    class Pixels:
        pass

    async def handler(_request: object) -> None:
        pixels = Pixels()
        held.append(weakref.ref(pixels))
        try:
            raise KeyError("full")
        except KeyError:
            raise error("refused") from None

    async def main() -> int:
        response = await error_middleware(None, handler)  # type: ignore[arg-type]
        return response.status

    gc.disable()
    try:
        assert asyncio.run(main()) == status
        assert held[0]() is None
    finally:
        gc.enable()

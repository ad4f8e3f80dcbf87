"""The room of a prompt, counted before its media is encoded.

A language-model worker refuses a prompt longer than its context, but in E+PD the worker sees the
prompt only after the encoder has run the vision tower over every item: a large image the prompt
cannot hold would cost the encoder minutes for an answer the worker gives in a millisecond. So an
encode call carries the prompt's room (``protocol.Context``), and its items wait for each other
once each knows its placeholder tokens (after preprocessing, or from a cache or store hit):
together within the room, they go on to the vision tower; past it, every one of them is refused,
none encoded. A call's items are those of one chat request that one encoder encodes; its text and
the items other encoders got are not counted here (the worker counts the whole prompt). With a
shared store an item is counted before the encoder claims it (``store.single_flight``): no claim
is held while the call's other items are counted, so two encoders counting the same items in
opposite orders never wait for each other.
"""

from __future__ import annotations

import asyncio

from epdserve.api.errors import BadRequest
from epdserve.encoder.protocol import Context


class PromptRoom:
    """One encode call's items against its ``context`` (None: nothing counted, nobody waits)."""

    def __init__(self, context: Context | None, items: int) -> None:
        self.context = context
        self.tokens = 0  # placeholder tokens of the items counted so far
        self._pending = items if context is not None else 0
        self._counted = asyncio.Event()
        if self._pending == 0:
            self._counted.set()

    def seat(self) -> Seat:
        """One item's place in the count: it is counted once, by ``admit`` or by ``leave``."""
        return Seat(self)

    @property
    def refusal(self) -> BadRequest | None:
        """The client's answer once every item is counted and together they exceed the room."""
        if self.context is None or not self._counted.is_set() or self.tokens <= self.context.prompt_tokens:
            return None
        return self.context.refuse(self.tokens)

    async def _admit(self, tokens: int) -> None:
        self.tokens += tokens
        self._arrive()
        await self._counted.wait()
        refusal = self.refusal
        if refusal is not None:
            raise refusal

    def _arrive(self) -> None:
        self._pending -= 1
        if self._pending <= 0:
            self._counted.set()


class Seat:
    """An item's place in a ``PromptRoom``."""

    def __init__(self, room: PromptRoom) -> None:
        self.room = room
        self.counted = room.context is None

    async def admit(self, tokens: int) -> None:
        """Count the item's ``tokens`` and wait for the call's other items to be counted; raises
        the room's refusal when they exceed it together."""
        if self.counted:
            return
        self.counted = True
        await self.room._admit(tokens)

    def leave(self) -> None:
        """The item failed before it was counted (its media is bad): the others wait for it no more."""
        if not self.counted:
            self.counted = True
            self.room._arrive()

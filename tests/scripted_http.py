"""A scripted HTTP/1.1 server on a real socket, for the router's clients: each request's head and
body are recorded, and a test's ``reply`` writes whatever answer, broken or not, it needs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]


class Server:
    """A scripted HTTP server: ``reply(reader, writer, n)`` answers the n-th request (its head and
    body already read into ``requests``) and says whether to keep the connection."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.connections = 0
        self.closed_by_client = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_client.set()
                    return
                line, *rest = head.decode("latin-1").split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in rest if h)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests.append((line, headers, body))
                if not await self.reply(reader, writer, len(self.requests)):
                    return
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


def answer(status: int, body: bytes, *headers: str) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body

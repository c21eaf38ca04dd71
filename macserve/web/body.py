"""A request body read with two bounds, the same for every server macserve runs: its size
(a Content-Length over the limit is refused before a byte of the body is read) and the time
it takes to arrive (a client that stops sending mid-body)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from .errors import HttpError

MAX_BODY = 8 * 2**20  # far above any prompt that fits a context; stops a runaway upload early


async def read_body(request: Request, timeout: float, limit: int = MAX_BODY) -> bytes:
    """The body, or HttpError 413 (too large) or 408 (too slow). Either answer carries
    `Connection: close`; the server's lingering close (guards.timed_protocol) lets the client
    read it before the socket closes."""
    too_large = HttpError(413, f"request body is over {limit // 2**20} MB")
    n = request.headers.get("content-length")
    if n and n.isdigit() and int(n) > limit:
        raise too_large
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for c in request.stream():
            size += len(c)
            if size > limit:
                raise too_large
            chunks.append(c)

    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise HttpError(408, f"the request body did not arrive within {timeout:g} s") from None
    return b"".join(chunks)

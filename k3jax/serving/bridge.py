"""From the engine thread to a request's coroutine: results arrive on an asyncio queue.

`Stream(scheduler, request)` queues the request; `await stream.next()` gives its token ids, then its
`Finish`. `stream.close()` (in a `finally`) cancels a request that has not finished, e.g. after a
stop string or when the client went away (its coroutine cancelled), which frees its slot at the
next step boundary.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from k3jax.serving.request import Finish, GenerationRequest
from k3jax.serving.scheduler import Scheduler

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class _Sink:
    """Called from the engine thread: hand each result to the event loop (never blocks)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue

    def token(self, token: int) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

    def finish(self, finish: Finish) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, finish)


class Stream:
    """One request's results."""

    def __init__(self, scheduler: Scheduler, request: GenerationRequest) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handle = scheduler.submit(request, _Sink(asyncio.get_running_loop(), self.queue))
        self.finish: Finish | None = None

    async def next(self, client: Request | None = None) -> int | Finish:
        """The next token id, or the `Finish`. With `client`, raises ClientGone once it disconnects."""
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S if client is not None else None)
            except TimeoutError:
                if await client.is_disconnected():
                    raise ClientGone() from None
                continue
            if isinstance(item, Finish):
                self.finish = item
            return item

    def close(self) -> None:
        if self.finish is None:
            self.handle.cancel()

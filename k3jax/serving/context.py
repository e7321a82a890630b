"""What every route shares: the server's state and the request / response plumbing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from k3jax.serving.protocol import RequestError
from k3jax.serving.state import ServerState


def state_of(request: Request) -> ServerState:
    return request.app.state.k3


async def json_body(request: Request) -> dict:
    """The request's JSON object, or a 400 naming what is wrong with it."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object; got {type(body).__name__}")
    model = body.get("model")
    name = state_of(request).model_name
    if model is not None and model != name:
        raise RequestError(f"the model {model!r} does not exist; this server serves {name!r}", param="model",
                           status=404, kind="not_found_error")
    return body


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: one `data: {json}` per event, then `data: [DONE]`."""
    async def body() -> AsyncIterator[str]:
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

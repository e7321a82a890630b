"""The ASGI application (Starlette): routes, error handling, server-sent events, start and drain.

    GET  /health                 200 {"status": "ok"} while the engine runs
    GET  /v1/models              the one served model
    GET  /metrics                Prometheus text (`metrics.py`)
    POST /v1/completions         `completions.py`
    POST /v1/chat/completions    `chat.py`

Errors are OpenAI error JSON: 400 for a bad request, 404 for an unknown model or route, 503 when the
queue is full or the server is shutting down, 500 if generation itself failed. The lifespan starts
the engine thread; at shutdown (after the web server has stopped taking connections and the open
ones have finished) it drains what is still in flight and joins the thread.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from k3jax.serving.bridge import ClientGone
from k3jax.serving.chat import chat_completions
from k3jax.serving.completions import completions
from k3jax.serving.context import state_of
from k3jax.serving.state import ServerState
from k3jax.serving.protocol import RequestError, error_body
from k3jax.serving.request import QueueFull, ShuttingDown

log = logging.getLogger(__name__)


def openai_route(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Turn the request errors of `handler` into OpenAI error responses; nothing escapes as a crash."""
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except RequestError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except QueueFull as err:
            return JSONResponse(error_body(f"the server is busy: {err}; retry later", "server_busy"), status_code=503)
        except ShuttingDown as err:
            return JSONResponse(error_body(str(err), "server_shutting_down"), status_code=503)
        except ClientGone:
            return Response(status_code=499)
        except Exception as err:  # a bug must cost one request, not the server
            log.exception("request failed")
            return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}", "internal_error"),
                                status_code=500)
    return wrapped


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def models(request: Request) -> Response:
    state = state_of(request)
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "k3jax",
         "max_model_len": state.max_len},
    ]})


async def metrics(request: Request) -> Response:
    return PlainTextResponse(state_of(request).scheduler.metrics.render(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", kind),
                        status_code=exc.status_code)


def create_app(state: ServerState, *, start_engine: bool = True) -> Starlette:
    """The application around a scheduler. With `start_engine`, the lifespan runs the engine thread
    (started at startup, drained and joined at shutdown)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if start_engine:
            state.scheduler.start()
        try:
            yield
        finally:
            if start_engine:
                state.scheduler.stop(drain=True)

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/completions", openai_route(completions), methods=["POST"]),
            Route("/v1/chat/completions", openai_route(chat_completions), methods=["POST"]),
        ],
        exception_handlers={HTTPException: _http_error},
        lifespan=lifespan,
    )
    app.state.k3 = state
    return app

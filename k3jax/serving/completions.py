"""POST /v1/completions: a prompt (text, or token ids) continued by the model.

A text prompt is encoded with the checkpoint's tokenizer (control-token strings stay text) and gets
the bos token first when the tokenizer or config has one, as `k3jax generate --prompt` does; token
ids are taken as given. Generation stops at the config's eos, at the request's stop token ids and
stop strings (matched on the decoded text, which ends before them), or after `max_tokens` (default
16, as OpenAI's); `"ignore_eos": true` (as in vLLM) leaves the eos out of the stops.
`"return_token_ids": true` adds the generated ids to each choice (a stop token included), which is
also how a client reads a checkpoint without a tokenizer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from k3jax.serving.bridge import Stream
from k3jax.serving.context import json_body, sse, state_of
from k3jax.serving.protocol import (
    RequestError, SamplingFields, budget, completion_body, completion_prompt, new_id, sampling_fields, usage,
)
from k3jax.serving.request import Finish, GenerationRequest
from k3jax.serving.state import ServerState
from k3jax.serving.text import TextStream

DEFAULT_MAX_TOKENS = 16


def generation_request(ids: list[int], fields: SamplingFields, max_tokens: int,
                       stop_ids: set[int]) -> GenerationRequest:
    return GenerationRequest(tuple(ids), max_tokens, fields.temperature, fields.top_k, fields.top_p, fields.seed,
                             frozenset(stop_ids) | fields.stop_ids)


async def _run(stream: Stream, text: TextStream, stop_ids: frozenset[int], client: Request | None,
               ) -> AsyncIterator[tuple[str, list[int], str | None, Finish | None]]:
    """(text delta, new ids, finish reason or None, Finish at the end) per token."""
    ids_seen = 0
    reason = None
    try:
        while True:
            item = await stream.next(client)
            if isinstance(item, Finish):
                reason = reason or item.reason
                tail = text.flush() if reason != "abort" else ""
                yield tail, [], reason, item._replace(completion_tokens=ids_seen)
                return
            if reason is not None:  # tokens made after a stop string, before the cancel took effect
                continue
            ids_seen += 1
            delta = text.push(item) if item not in stop_ids else ""
            if text.stopped:
                reason = "stop"
                stream.close()
            yield delta, [item], None, None
    finally:
        stream.close()


def _choice(text: str, ids: list[int], reason: str | None, return_ids: bool) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    if return_ids:
        choice["token_ids"] = ids
    return choice


async def completions(request: Request) -> Response:
    state: ServerState = state_of(request)
    body = await json_body(request)
    fields = sampling_fields(body, state.vocab_size, max_tokens_names=("max_tokens",))
    prompt = completion_prompt(body, state.vocab_size)
    if isinstance(prompt, str):
        ids = state.tokenizer.encode(prompt)
        if state.bos_id is not None:
            ids = [state.bos_id, *ids]
        if not ids:
            raise RequestError("'prompt' encodes to no tokens", param="prompt")
    else:
        ids = prompt
    max_tokens = budget(len(ids), fields.max_tokens, DEFAULT_MAX_TOKENS, state.max_len)
    stop_ids = {state.eos_id} if state.eos_id is not None and not fields.ignore_eos else set()
    req = generation_request(ids, fields, max_tokens, stop_ids)
    stream = Stream(state.scheduler, req)
    text = TextStream(state.tokenizer, fields.stop_strings)
    rid = new_id("cmpl")

    if fields.stream:
        async def events() -> AsyncIterator[dict]:
            async for delta, new_ids, reason, finish in _run(stream, text, req.stop_ids, None):
                if finish is not None and finish.reason == "error":
                    yield {"error": {"message": finish.error, "type": "internal_error"}}
                    return
                if delta or new_ids or reason:
                    choice = _choice(delta, new_ids, reason, fields.return_token_ids)
                    yield completion_body(rid, state.model_name, choice, None)
                if finish is not None and fields.include_usage:
                    yield completion_body(rid, state.model_name, {}, usage(len(ids), finish.completion_tokens,
                                                                            finish.cached_tokens))
        return sse(events())

    pieces, all_ids = [], []
    async for delta, new_ids, reason, finish in _run(stream, text, req.stop_ids, request):
        pieces.append(delta)
        all_ids += new_ids
    if finish.reason == "error":
        raise RuntimeError(finish.error)
    return JSONResponse(completion_body(
        rid, state.model_name, _choice("".join(pieces), all_ids, reason, fields.return_token_ids),
        usage(len(ids), finish.completion_tokens, finish.cached_tokens)))

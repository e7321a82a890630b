"""POST /v1/chat/completions: a conversation encoded in K3's chat format, the reply parsed back.

The messages (system / user / assistant with `reasoning_content` and `tool_calls` / tool), `tools`,
`tool_choice` ("auto" | "required" | "none") and `response_format` go through
`k3jax.chat.encode_messages`. Thinking: `reasoning_effort` "low" | "high" | "max" (default: the
release's, "max"; "medium" is refused), `chat_template_kwargs.thinking = false` for a prompt without
thinking. Generation stops at `<|end_of_msg|>`; the reply is parsed (`k3jax.chat.ReplyParser`) into
`reasoning_content`, `content` and `tool_calls` (then finish_reason "tool_calls"). Stop strings apply
to the content. Streamed, reasoning and content arrive as deltas as they are generated and the tool
calls in one delta at the end. Images cannot be sent to this server (it takes no pixels).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from k3jax.chat import (
    DEFAULT_THINKING, THINKING_EFFORTS, ImagePart, ReplyParser, ResponseFormat, UserMessage, control_ids,
    encode_messages, messages_from_dicts, tools_from_dicts,
)
from k3jax.chat.messages import RawArguments
from k3jax.serving.bridge import Stream
from k3jax.serving.completions import generation_request
from k3jax.serving.context import json_body, sse, state_of
from k3jax.serving.protocol import (
    RequestError, budget, completion_body, new_id, sampling_fields, tool_call_json, usage,
)
from k3jax.serving.request import Finish
from k3jax.serving.state import ServerState
from k3jax.serving.text import StopMatcher


def _thinking(body: Mapping) -> str | None:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    effort = body.get("reasoning_effort", kwargs.get("thinking_effort"))
    if effort is not None and effort not in THINKING_EFFORTS:
        raise RequestError(f"'reasoning_effort' must be one of {', '.join(THINKING_EFFORTS)}; got {effort!r}",
                           param="reasoning_effort")
    thinking = kwargs.get("thinking", True)
    if not isinstance(thinking, bool):
        raise RequestError("'chat_template_kwargs.thinking' must be a boolean", param="chat_template_kwargs")
    return (effort or DEFAULT_THINKING) if thinking else None


def _response_format(body: Mapping) -> ResponseFormat | None:
    spec = body.get("response_format")
    if spec is None or spec == {"type": "text"}:
        return None
    if isinstance(spec, Mapping) and spec.get("type") == "json_object":
        return ResponseFormat()
    if isinstance(spec, Mapping) and spec.get("type") == "json_schema" and isinstance(spec.get("json_schema"), Mapping):
        return ResponseFormat(spec["json_schema"].get("schema") or {})
    raise RequestError("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}; "
                       f"got {spec!r}", param="response_format")


def _prompt(state: ServerState, body: Mapping) -> tuple[list[int], bool]:
    """The prompt ids and whether thinking is on."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "required", "none"):
        raise RequestError(f"'tool_choice' must be \"auto\", \"required\" or \"none\"; got {choice!r}",
                           param="tool_choice")
    thinking = _thinking(body)
    try:
        typed = messages_from_dicts(messages)
        declared = tools_from_dicts(tools) if tools else None
        if any(isinstance(m, UserMessage) and not isinstance(m.content, str)
               and any(isinstance(p, ImagePart) for p in m.content) for m in typed):
            raise RequestError("images are not supported by this server", param="messages")
        ids = encode_messages(state.chat_tokenizer, typed, tools=declared, thinking=thinking, tool_choice=choice,
                              response_format=_response_format(body))
    except (ValueError, TypeError, KeyError) as err:
        raise RequestError(f"bad conversation: {err}", param="messages") from None
    return ids, thinking is not None


def _tool_calls(calls) -> list[dict]:
    out = []
    for k, call in enumerate(calls):
        arguments = call.arguments.text if isinstance(call.arguments, RawArguments) else json.dumps(
            call.arguments, ensure_ascii=False)
        out.append(tool_call_json(k, call.id or new_id("call"), call.name, arguments))
    return out


async def chat_completions(request: Request) -> Response:
    state: ServerState = state_of(request)
    if state.chat_tokenizer is None:
        raise RequestError("this checkpoint's tokenizer has no K3 chat tokens; use /v1/completions", status=404,
                           kind="not_found_error")
    body = await json_body(request)
    fields = sampling_fields(body, state.vocab_size, max_tokens_names=("max_tokens", "max_completion_tokens"))
    ids, thinking = _prompt(state, body)
    max_tokens = budget(len(ids), fields.max_tokens, None, state.max_len)
    stop_ids = set() if fields.ignore_eos else {control_ids(state.chat_tokenizer).end_of_msg} | (
        {state.eos_id} if state.eos_id is not None else set())
    req = generation_request(ids, fields, max_tokens, stop_ids)
    stream = Stream(state.scheduler, req)
    parser = ReplyParser(state.chat_tokenizer, thinking=thinking)
    content = StopMatcher(fields.stop_strings)
    rid = new_id("chatcmpl")
    ids_out: list[int] = []  # the reply's token ids (a stop token included)

    async def run(client: Request | None) -> AsyncIterator[tuple[dict, str | None, Finish | None]]:
        """(delta, finish reason, Finish) per step."""
        count, reason = 0, None
        try:
            while True:
                item = await stream.next(client)
                if isinstance(item, Finish):
                    reason = reason or item.reason
                    delta = {"content": content.flush()} if reason not in ("abort", "error") else {}
                    calls = parser.result().tool_calls if reason != "error" else ()
                    if calls:
                        delta["tool_calls"] = _tool_calls(calls)
                        reason = "tool_calls" if reason == "stop" else reason
                    yield delta, reason, item._replace(completion_tokens=count)
                    return
                if reason is not None:
                    continue
                count += 1
                ids_out.append(item)
                delta: dict = {}
                for channel, text in parser.feed([item]):
                    if channel == "reasoning":
                        delta["reasoning_content"] = delta.get("reasoning_content", "") + text
                    elif channel == "content":
                        delta["content"] = delta.get("content", "") + content.push(text)
                if content.stopped:
                    reason = "stop"
                    stream.close()
                yield delta, None, None
        finally:
            stream.close()

    if fields.stream:
        async def events() -> AsyncIterator[dict]:
            first = True
            async for delta, reason, finish in run(None):
                if finish is not None and finish.reason == "error":
                    yield {"error": {"message": finish.error, "type": "internal_error"}}
                    return
                delta = {k: v for k, v in delta.items() if v}
                if first:
                    delta = {"role": "assistant", **delta}
                    first = False
                if delta or reason:
                    yield completion_body(rid, state.model_name, {"index": 0, "delta": delta, "logprobs": None,
                                                                  "finish_reason": reason}, None, chunk=True, chat=True)
                if finish is not None and fields.include_usage:
                    counts = usage(len(ids), finish.completion_tokens, finish.cached_tokens)
                    yield completion_body(rid, state.model_name, {}, counts, chunk=True, chat=True)
        return sse(events())

    reasoning, tool_calls = [], None
    async for delta, reason, finish in run(request):
        reasoning.append(delta.get("reasoning_content", ""))
        tool_calls = delta.get("tool_calls", tool_calls)
    if finish.reason == "error":
        raise RuntimeError(finish.error)
    message = {"role": "assistant", "content": content.text, "reasoning_content": "".join(reasoning) or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
    if fields.return_token_ids:
        choice["token_ids"] = list(ids_out)
    return JSONResponse(completion_body(
        rid, state.model_name, choice,
        usage(len(ids), finish.completion_tokens, finish.cached_tokens), chat=True))

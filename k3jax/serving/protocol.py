"""OpenAI request checking and response shapes for `/v1/completions` and `/v1/chat/completions`.

Every field is checked before anything is queued; a bad one is a `RequestError` naming it (HTTP 400,
OpenAI's error JSON). Fields the server does not implement (n > 1, echo, logprobs, best_of) are
refused rather than ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_SEED = 2**32 - 1  # as `k3jax.generate`: jax.random.key wraps larger seeds
MAX_STOPS = 16


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI error `type`, the offending `param`."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param)


def error_body(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


@dataclass(frozen=True)
class SamplingFields:
    """The fields both endpoints share, checked."""

    max_tokens: int | None
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int
    stop_strings: tuple[str, ...]
    stop_ids: frozenset[int]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    ignore_eos: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: Mapping, name: str, default: float | None, low: float, high: float, *,
            low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not (
            (low < value if low_open else low <= value) and value <= high):
        bound = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high != math.inf else "")
        raise RequestError(f"'{name}' must be a number {bound}; got {value!r}", param=name)
    return float(value)


def _integer(body: Mapping, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise RequestError(f"'{name}' must be an integer in [{low}, {high}]; got {value!r}", param=name)
    return value


def check_token_ids(ids: Any, vocab_size: int, name: str) -> list[int]:
    """A non-empty list of token ids in [0, vocab_size)."""
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"'{name}' must be a non-empty list of token ids", param=name)
    bad = [i for i in ids if not _is_int(i) or not 0 <= i < vocab_size]
    if bad:
        raise RequestError(f"'{name}' has ids outside the vocabulary [0, {vocab_size}): {bad[:8]!r}", param=name)
    return ids


def _refuse(body: Mapping, name: str, allowed: tuple) -> None:
    if body.get(name) not in allowed:
        raise RequestError(f"'{name}'={body.get(name)!r} is not supported (only {' or '.join(map(repr, allowed))})",
                           param=name)


def sampling_fields(body: Mapping, vocab_size: int, *, max_tokens_names: tuple[str, ...]) -> SamplingFields:
    """Check the shared fields of a request body (a JSON object)."""
    _refuse(body, "n", (None, 1))
    _refuse(body, "logprobs", (None, False))
    max_tokens = None
    for name in max_tokens_names:
        value = _integer(body, name, 1, 2**31 - 1) if body.get(name) is not None else None
        max_tokens = value if value is not None else max_tokens
    top_k = None if body.get("top_k") in (None, 0, -1) else _integer(body, "top_k", 1, vocab_size)  # 0, -1: off
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, (str, int)) and not isinstance(stop, bool) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or any(
            not (isinstance(s, str) and s) and not (_is_int(s) and 0 <= s < vocab_size) for s in stops):
        raise RequestError(f"'stop' must be a non-empty string, a token id in [0, {vocab_size}), or a list of at most "
                           f"{MAX_STOPS} of them; got {stop!r}", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be a boolean; got {stream!r}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError("'stream_options' must be an object like {\"include_usage\": true}", param="stream_options")
    flags = {}
    for name in ("return_token_ids", "ignore_eos"):
        flags[name] = body.get(name, False)
        if not isinstance(flags[name], bool):
            raise RequestError(f"'{name}' must be a boolean; got {flags[name]!r}", param=name)
    return SamplingFields(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 0.0, math.inf),
        top_p=_number(body, "top_p", None, 0.0, 1.0, low_open=True),
        top_k=top_k,
        seed=_integer(body, "seed", 0, MAX_SEED) or 0,
        stop_strings=tuple(s for s in stops if isinstance(s, str)),
        stop_ids=frozenset(s for s in stops if not isinstance(s, str)),
        stream=stream, include_usage=bool(options.get("include_usage", False)),
        return_token_ids=flags["return_token_ids"], ignore_eos=flags["ignore_eos"],
    )


def budget(prompt_len: int, requested: int | None, default: int | None, max_len: int) -> int:
    """The completion's token budget: `requested` (or `default`, or all the room left), checked against
    --max-len, which bounds prompt + completion."""
    if prompt_len >= max_len:
        raise RequestError(f"the prompt has {prompt_len} tokens; this server takes at most {max_len - 1} "
                           f"(--max-len {max_len} bounds prompt + completion)", param="prompt")
    room = max_len - prompt_len
    if requested is None:
        return min(default, room) if default is not None else room
    if requested > room:
        raise RequestError(f"max_tokens={requested} is too large: the prompt has {prompt_len} tokens and --max-len "
                           f"{max_len} leaves room for {room}", param="max_tokens")
    return requested


def completion_prompt(body: Mapping, vocab_size: int) -> str | list[int]:
    """`prompt`: a string or a list of token ids (also one of either wrapped in a list)."""
    _refuse(body, "echo", (None, False))
    _refuse(body, "best_of", (None, 1))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("'prompt' is empty", param="prompt")
        return prompt
    if isinstance(prompt, list):
        return check_token_ids(prompt, vocab_size, "prompt")
    raise RequestError(f"'prompt' must be a string or a list of token ids; got {type(prompt).__name__}", param="prompt")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(rid: str, model: str, choice: dict, usage_: dict | None, *, chunk: bool = False,
                    chat: bool = False) -> dict:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice] if choice else []}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def tool_call_json(index: int, call_id: str, name: str, arguments: str) -> dict:
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

"""A multi-turn chat with a K3 model that keeps the model's cache from turn to turn.

    chat = Chat(model, tokenizer, system="Be brief.", thinking="high", max_new_tokens=512)
    reply = chat.send("What is KDA?", on_text=lambda channel, text: print(text, end=""))
    reply.reasoning, reply.content, reply.tool_calls
    chat.send("And MLA?")                      # continues from the cache: only the new turn is run

Each turn runs only its new tokens through the model (`k3jax.extend` on the cache of the previous
turn; no re-prefill), then decodes one token at a time until `<|end_of_msg|>` or `max_new_tokens`.
The cache has a fixed capacity (its MLA latents are preallocated); when a turn would not fit, the
chat allocates one twice as large (at least what the turn needs, rounded up to CAPACITY_STEP) and
prefills the whole conversation into it once.

The conversation is kept two ways: `messages` (typed, the replies parsed) and `token_ids` (what the
cache holds, plus the last reply's final token, which is fed at the start of the next turn). When
the model writes its reply in the format's grammar, the two agree:
`token_ids == encode_messages(tokenizer, messages, ..., add_generation_prompt=False)`. A reply cut off
at `max_new_tokens` is closed with the tokens that end it as a whole message (`closing_ids`) before
the next turn; the cache always holds the model's own tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.chat.encoding import DEFAULT_THINKING, THINKING_EFFORTS, Thinking, encode_messages, encode_turn
from k3jax.chat.messages import Message, SystemMessage, ToolCall, UserMessage
from k3jax.chat.parsing import Channel, ReplyParser
from k3jax.chat.tokens import control_ids
from k3jax.generate import decode_step, extend, prefill
from k3jax.model import K3Model, ModelCache
from k3jax.sampling import SamplingParams, sample_with
from k3jax.tokenizer import Tokenizer, check_text

CAPACITY_STEP = 1024  # cache capacities are multiples of this (fewer distinct compiled shapes)
_sample = jax.jit(sample_with, static_argnums=0)


@dataclass(frozen=True)
class Reply:
    """One assistant turn: its reasoning, answer and tool calls, the ids generated (the stop token
    included when there was one) and whether it ended with `<|end_of_msg|>` (else: max_new_tokens)."""

    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...]
    token_ids: tuple[int, ...]
    finished: bool
    errors: tuple[str, ...] = ()  # where the reply broke the format's grammar (see ReplyParser)


def _positive_int(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r}: expected an integer >= {low}")
    return value


def _round_up(n: int) -> int:
    return -(-n // CAPACITY_STEP) * CAPACITY_STEP


class Chat:
    """A conversation with `model`; see the module docstring. Sampling: `temperature` (0 = greedy; the
    release's generation_config uses 1.0), `top_p`, `top_k`; `seed` makes it reproducible."""

    def __init__(
        self, model: K3Model, tokenizer: Tokenizer, *, system: str | None = None,
        thinking: Thinking = DEFAULT_THINKING, max_new_tokens: int = 4096, temperature: float = 1.0,
        top_p: float | None = None, top_k: int | None = None, seed: int = 0, capacity: int | None = None,
    ) -> None:
        if thinking is not None and thinking not in THINKING_EFFORTS:
            raise ValueError(f"thinking={thinking!r}: expected one of {', '.join(THINKING_EFFORTS)}, or None")
        self.params = SamplingParams(temperature, top_k, top_p)
        self.max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
        self.seed = _positive_int("seed", seed, 0)
        if seed > 2**32 - 1:
            raise ValueError(f"seed={seed}: expected an integer in [0, 2**32 - 1]")
        self.initial_capacity = None if capacity is None else _positive_int("capacity", capacity)
        if system is not None:
            check_text(system, "system")
        self.model, self.tokenizer, self.system, self.thinking = model, tokenizer, system, thinking
        self.control = control_ids(tokenizer)
        vocab = model.config.vocab_size
        if max(self.control.__dict__.values()) >= vocab:
            raise ValueError(f"the tokenizer's control ids reach {max(self.control.__dict__.values())}, beyond the "
                             f"model's vocab_size={vocab}: tokenizer and model do not belong together")
        eos = model.config.eos_token_id
        if eos is not None and eos != self.control.end_of_msg:
            raise ValueError(f"the model's eos_token_id={eos} is not the tokenizer's <|end_of_msg|> "
                             f"({self.control.end_of_msg})")
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and the cache."""
        self.messages: list[Message] = [SystemMessage(self.system)] if self.system is not None else []
        self.token_ids: list[int] = []
        self._pending: list[int] = []  # in token_ids, not yet in the cache
        self._cache: ModelCache | None = None
        self._steps = 0  # tokens sampled so far: step i draws with fold_in(key(seed), i)

    @property
    def cache_length(self) -> int:
        """Tokens in the model's cache (0 before the first turn)."""
        return 0 if self._cache is None else int(self._cache.length)

    @property
    def cache_capacity(self) -> int:
        return 0 if self._cache is None else self._cache.capacity

    def _run(self, new: Sequence[int]) -> jax.Array:
        """Put `new` ids after the cached ones; returns the last position's logits [1, vocab]."""
        cached = len(self.token_ids) - len(self._pending)
        needed = cached + len(new) + self.max_new_tokens
        if self._cache is not None and needed <= self._cache.capacity:
            logits, self._cache = extend(self.model, self._cache, jnp.asarray([new], jnp.int32))
            return logits
        # First turn, or the cache is full: a larger one, filled with the whole conversation once.
        capacity = max(needed, 2 * self.cache_capacity, self.initial_capacity or 0)
        ids = self.token_ids[:cached] + list(new)
        logits, self._cache = prefill(self.model, jnp.asarray([ids], jnp.int32), capacity=_round_up(capacity))
        return logits[:, -1]

    def _next_token(self, logits: jax.Array, key: jax.Array) -> int:
        """The next token from the last position's logits [1, vocab]."""
        return int(_sample(self.params, logits, key)[0])

    def send(self, text: str, *, on_text: Callable[[Channel, str], object] | None = None) -> Reply:
        """Add a user turn and generate the reply. `on_text(channel, text)` is called with each new piece
        of text as it is produced, channel "reasoning", "content" or "tool" (tool-call arguments)."""
        check_text(text, "text")
        user = UserMessage(text)
        if self._cache is None:
            turn = encode_messages(self.tokenizer, [*self.messages, user], thinking=self.thinking)
        else:
            turn = encode_turn(self.tokenizer, [user], thinking=self.thinking)
        last = self._run(self._pending + turn)
        self.messages.append(user)
        self.token_ids += turn
        parser = ReplyParser(self.tokenizer, thinking=self.thinking is not None)
        key = jax.random.key(self.seed)
        reply: list[int] = []
        for i in range(self.max_new_tokens):
            if i:
                last, self._cache = decode_step(self.model, self._cache, jnp.asarray(reply[-1:], jnp.int32))
            token = self._next_token(last, jax.random.fold_in(key, self._steps))
            self._steps += 1
            reply.append(token)
            pieces = parser.feed([token])
            if token == self.control.end_of_msg or i + 1 == self.max_new_tokens:
                pieces += parser.flush()
            for channel, piece in pieces:
                if on_text is not None:
                    on_text(channel, piece)
            if token == self.control.end_of_msg:
                break
        parsed = parser.result()
        closing = parser.closing_ids()
        self.messages.append(parsed.to_message())
        self.token_ids += reply + closing
        self._pending = reply[-1:] + closing
        return Reply(parsed.reasoning, parsed.content, parsed.tool_calls, tuple(reply), parsed.finished, parsed.errors)

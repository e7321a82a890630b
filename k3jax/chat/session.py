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
cache holds, each image's placeholder as one id, then what the next turn feeds first: the last
reply's final token and, if it was cut off, the ids that close it). When
the model writes its reply in the format's grammar, the two agree:
`token_ids == encode_messages(tokenizer, messages, ..., add_generation_prompt=False)`. A reply cut off
at `max_new_tokens` is closed with the tokens that end it as a whole message (`closing_ids`) before
the next turn; the cache always holds the model's own tokens.

Images: `send(text, images=[...])` (PIL images or file paths) puts each image's prompt before the
text (`<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>`, its original size), and
the model expands its `<|media_pad|>` into the image's features. `extend` takes no images, so a turn
with images prefills the whole conversation, with every image so far, into a new cache once; the
turns after it extend that cache as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.chat.encoding import DEFAULT_THINKING, THINKING_EFFORTS, Thinking, encode_messages, encode_turn
from k3jax.chat.messages import ImagePart, Message, SystemMessage, ToolCall, UserMessage
from k3jax.chat.parsing import Channel, ReplyParser
from k3jax.chat.tokens import control_ids
from k3jax.generate import decode_step, extend, padded_width, prefill
from k3jax.model import K3Model, ModelCache
from k3jax.sampling import SamplingParams, sample_with
from k3jax.tokenizer import Tokenizer, check_text
from k3jax.vision.processor import ImageLike, ProcessorConfig, process_image

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


@dataclass(frozen=True)
class _Image:
    """A processed image of the conversation: its patches, grid (t, h, w), original size, and how many
    positions its one placeholder token becomes in the cache."""

    patches: np.ndarray
    grid: tuple[int, int, int]
    size: tuple[int, int]
    features: int


def _positive_int(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r}: expected an integer >= {low}")
    return value


MIN_TURN_WIDTH = 16  # the narrowest padded turn


def _round_up(n: int) -> int:
    return -(-n // CAPACITY_STEP) * CAPACITY_STEP


class Chat:
    """A conversation with `model`; see the module docstring. Sampling: `temperature` (0 = greedy; the
    release's generation_config uses 1.0), `top_p`, `top_k`; `seed` makes it reproducible (token i of
    the conversation's replies draws with `fold_in(key(seed), i)`). `capacity`: the first cache's size
    (default: what the first turn needs). `processor`: the image processing (a release's
    `ProcessorConfig.from_dir(path)`; the default is the release's values)."""

    def __init__(
        self, model: K3Model, tokenizer: Tokenizer, *, system: str | None = None,
        thinking: Thinking = DEFAULT_THINKING, max_new_tokens: int = 4096, temperature: float = 1.0,
        top_p: float | None = None, top_k: int | None = None, seed: int = 0, capacity: int | None = None,
        processor: ProcessorConfig = ProcessorConfig(),
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
        self.processor = processor
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
        self._images: list[_Image] = []  # every image of the conversation, in order
        self._steps = 0  # tokens sampled so far: step i draws with fold_in(key(seed), i)

    @property
    def cache_length(self) -> int:
        """Tokens in the model's cache (0 before the first turn)."""
        return 0 if self._cache is None else int(self._cache.length)

    @property
    def cache_capacity(self) -> int:
        return 0 if self._cache is None else self._cache.capacity

    def _run(self, new: Sequence[int], images: Sequence[_Image]) -> jax.Array:
        """Put `new` ids (with `images` for their placeholders) after the cached ones; returns the last
        position's logits [1, vocab]."""
        history = self.token_ids[: len(self.token_ids) - len(self._pending)]  # what the cache holds
        cached = len(history) + sum(image.features - 1 for image in self._images)  # placeholders expanded
        if (self._cache is not None and not images
                and cached + len(new) + self.max_new_tokens <= self._cache.capacity):
            # The turn is right-padded to a power of two (`real_tokens`: pads leave no trace), so turns
            # of any length reuse a few compiled programs instead of compiling one per length.
            width = padded_width(len(new), MIN_TURN_WIDTH)
            width = width if cached + width <= self._cache.capacity else len(new)
            ids = np.full((1, width), self.model.config.pad_token_id or 0, np.int32)
            ids[0, : len(new)] = new
            logits, self._cache = extend(self.model, self._cache, ids, real_tokens=len(new))
            return logits
        # First turn, new images, no cache (dropped by an interruption), or the cache is full: a new
        # one, at least twice as large as the last, filled with the whole conversation once.
        ids = jnp.asarray([history + list(new)], jnp.int32)
        length = cached + len(new) + sum(image.features - 1 for image in images)
        capacity = _round_up(max(length + self.max_new_tokens, 2 * self.cache_capacity, self.initial_capacity or 0))
        every = [*self._images, *images]
        if not every:
            logits, self._cache = prefill(self.model, ids, capacity=capacity)
        else:
            logits, self._cache = prefill(
                self.model, ids, capacity=capacity, pixel_values=np.concatenate([image.patches for image in every]),
                grid_thws=np.asarray([image.grid for image in every], np.int64))
        return logits  # the last position's [1, vocab]

    def _process(self, images: Sequence[ImageLike]) -> list[_Image]:
        """Images (PIL images or file paths) -> their patches and sizes, before anything runs."""
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
            raise TypeError(f"images: expected a list of PIL images or file paths, got {type(images).__name__}")
        if images and self.model.vision_tower is None:
            raise ValueError("images given, but this model has no vision tower (its checkpoint is text-only)")
        merge = self.processor.merge_kernel_size
        out = []
        for image in images:
            patches, grid, size = process_image(image, self.processor)
            out.append(_Image(patches, tuple(grid), size, grid[0] * (grid[1] // merge) * (grid[2] // merge)))
        return out

    def _next_token(self, logits: jax.Array, key: jax.Array) -> int:
        """The next token from the last position's logits [1, vocab]."""
        return int(_sample(self.params, logits, key)[0])

    def send(
        self, text: str, *, images: Sequence[ImageLike] = (), on_text: Callable[[Channel, str], object] | None = None
    ) -> Reply:
        """Add a user turn (`images` first, then `text`) and generate the reply. `on_text(channel, text)`
        is called with each new piece of text as it is produced, channel "reasoning", "content" or
        "tool" (tool-call arguments).

        If the turn is interrupted (an exception, Ctrl-C), the conversation is as it was before it and
        the cache is dropped: the next turn prefills the conversation once."""
        check_text(text, "text")
        new_images = self._process(images)
        user = UserMessage([*(ImagePart(*image.size) for image in new_images), text] if new_images else text)
        if not self.token_ids:
            turn = encode_messages(self.tokenizer, [*self.messages, user], thinking=self.thinking)
        else:
            turn = encode_turn(self.tokenizer, [user], thinking=self.thinking)
        try:
            reply, parser = self._generate(self._pending + turn, new_images, on_text)
        except BaseException:
            self._cache = None  # it may hold part of this turn
            raise
        parsed = parser.result()
        closing = parser.closing_ids()
        self.messages += [user, parsed.to_message()]
        self.token_ids += turn + reply + closing
        self._pending = reply[-1:] + closing
        self._images += new_images
        return Reply(parsed.reasoning, parsed.content, parsed.tool_calls, tuple(reply), parsed.finished, parsed.errors)

    def _generate(
        self, new: list[int], images: Sequence[_Image], on_text: Callable[[Channel, str], object] | None
    ) -> tuple[list[int], ReplyParser]:
        """Run `new` after the cached ids, then decode the reply; the ids generated and their parser."""
        last = self._run(new, images)
        parser = ReplyParser(self.tokenizer, thinking=self.thinking is not None)
        key = jax.random.key(self.seed)
        reply: list[int] = []
        for i in range(self.max_new_tokens):
            if i:
                last, self._cache = decode_step(self.model, self._cache, jnp.asarray(reply[-1:], jnp.int32))
            token = self._next_token(last, jax.random.fold_in(key, self._steps + i))
            reply.append(token)
            pieces = parser.feed([token])
            if token == self.control.end_of_msg or i + 1 == self.max_new_tokens:
                pieces += parser.flush()
            for channel, piece in pieces:
                if on_text is not None:
                    on_text(channel, piece)
            if token == self.control.end_of_msg:
                break
        self._steps += len(reply)
        return reply, parser

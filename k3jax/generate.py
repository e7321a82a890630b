"""Inference with a cache: prefill, single-token decode steps, and a batched generate loop.

The cache holds, per KDA layer, the fp32 recurrent state and the last W-1 raw conv inputs, and per
MLA layer the latents of every position up to its capacity (see `ModelCache`). `decode_step` is the
same forward pass on one token per sequence: KDA takes its recurrent step, MLA attends in the
absorbed form.

Prompts of different lengths share a batch with LEFT padding: `input_ids` [B, T] holds each prompt
right-aligned and `prompt_lengths` [B] says how many tokens are real (`left_pad` builds both). K3
has no positional encoding, so each row computes exactly what it would alone (see `run_model`);
the pad positions only cost compute. All rows then decode in lockstep at the same cache position.

A prompt runs in chunks (`prefill`, chunk size from `k3jax.prefill_chunk`): each chunk is an
`extend` of the cache, keeping only the last position's logits, so a long prompt's memory follows the
chunk (no [T, vocab] logits, no per-layer activations of the whole prompt).

`generate` prefills that way, then has two decode loops over the same pieces, both on one
preallocated cache:
  * no `on_token`: a `lax.scan` of decode steps in ONE jitted program (one dispatch, the cache is
    donated and updated in place in the loop carry);
  * `on_token`: a Python loop over the jitted `_decode_step`, whose cache argument is donated (its
    buffers are reused step to step). The callback then runs in the caller's thread, in order, with
    ordinary Python semantics (exceptions propagate, it may touch any state), no host callbacks in
    the compiled program (which sharded / multi-host programs restrict), and the loop stops early
    once every row has emitted a stop token.
Both draw the step-i token with the i-th of `jax.random.split(key(seed), max_new_tokens)`, so they
return the same tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.model import K3Model, ModelCache, check_input_ids, embed_images, run_model
from k3jax.prefill_chunk import default_chunk_size, device_memory_bytes
from k3jax.sampling import SamplingParams, sample_with
from k3jax.vision.embed import ImageInputs, prepare_images


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # int32 [B, N]; after a row's stop token, pad_token_id
    lengths: jax.Array  # int32 [B]: tokens generated per row, its stop token included


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """`value` as a Python int in [low, high]; bools and floats (2.5, 3.0 alike) are errors, not truncated."""
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0 and jnp.issubdtype(value.dtype, jnp.integer):
        value = value.item()  # a 0-d integer array, e.g. one element of a token-id array
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low or (
        high is not None and value > high
    ):
        expected = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ValueError(f"{name}={value!r}: expected {expected}")
    return int(value)


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int = 0) -> tuple[jax.Array, jax.Array]:
    """Token lists of different lengths -> (input_ids int32 [B, max_len] left-padded, lengths int32 [B]).

    The ids are checked before the int32 cast (floats and ids outside [0, 2**31) are errors); the
    vocabulary range is checked where the ids enter the model."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("left_pad: expected at least one sequence, none of them empty")
    pad_token_id = _check_int("pad_token_id", pad_token_id, 0, 2**31 - 1)
    rows = [np.asarray(s) for s in sequences]
    for b, row in enumerate(rows):
        if row.ndim != 1 or not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"left_pad: sequence {b} must be a list of integer token ids; got {row.dtype} {row.shape}")
        if row.min() < 0 or row.max() > 2**31 - 1:
            raise ValueError(f"left_pad: sequence {b} has ids in [{row.min()}, {row.max()}]; expected ids >= 0 "
                             "that fit int32")
    width = max(len(row) for row in rows)
    ids = np.full((len(rows), width), pad_token_id, np.int32)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = row
    return jnp.asarray(ids), jnp.asarray([len(row) for row in rows], jnp.int32)


def _check_token(name: str, value: object, vocab_size: int) -> int:
    return _check_int(name, value, 0, vocab_size - 1)


def _pad_start(ids: jax.Array, pad_token_id: int, prompt_lengths=None, attention_mask=None) -> jax.Array | None:
    """int32 [B] first real position of each row, from the prompt lengths or a left-padding
    attention mask [B, T] (1 = real token); None: no padding.

    A padded row whose last T - length tokens are all `pad_token_id` (and whose first ones are not)
    was right-padded: its real tokens would be read from the wrong end, so it is an error."""
    if attention_mask is not None:
        if prompt_lengths is not None:
            raise ValueError("give prompt_lengths or attention_mask, not both")
        raw = np.asarray(attention_mask)
        if raw.dtype != bool and not np.isin(raw, (0, 1)).all():
            raise ValueError(f"attention_mask must hold 0 (pad) and 1 (real token) only; got {np.unique(raw)[:8]}")
        mask = raw.astype(bool)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {ids.shape}; got {mask.shape}")
        if np.any(mask[:, :-1] & ~mask[:, 1:]):
            raise ValueError("attention_mask must be LEFT padding (zeros, then ones in every row); see left_pad")
        prompt_lengths = mask.sum(axis=1)
    if prompt_lengths is None:
        return None
    lengths = np.asarray(prompt_lengths)
    if lengths.shape != (ids.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"prompt_lengths must be integers [batch={ids.shape[0]}]; got {lengths.dtype} {lengths.shape}")
    if lengths.min() < 1 or lengths.max() > ids.shape[1]:
        raise ValueError(f"prompt_lengths must lie in [1, {ids.shape[1]}] (the padded prompt width); got {lengths}")
    host = np.asarray(ids)
    for b, length in enumerate(lengths.tolist()):
        pads = host.shape[1] - length
        if pads and np.all(host[b, length:] == pad_token_id) and not np.all(host[b, :pads] == pad_token_id):
            raise ValueError(
                f"input_ids row {b} looks RIGHT-padded: its last {pads} tokens are pad_token_id={pad_token_id} "
                f"where prompt_lengths[{b}]={length} puts real tokens; expected the prompt right-aligned after "
                "its padding (LEFT padding, see left_pad)"
            )
    return jnp.asarray(ids.shape[1] - lengths, jnp.int32)


def _default_pad(model: K3Model) -> int:
    return model.config.pad_token_id if model.config.pad_token_id is not None else 0


def _cache_batch(cache: ModelCache) -> int:
    """The batch size the cache was made for (the group caches carry a leading layer axis)."""
    if cache.start is not None:
        return cache.start.shape[0]
    for layer_cache in (*cache.head, *cache.tail):
        return jax.tree.leaves(layer_cache)[0].shape[0]
    return jax.tree.leaves(cache.groups)[0].shape[1]


@functools.partial(jax.jit, donate_argnames=("cache",))
def _decode_step(model: K3Model, cache: ModelCache, tokens: jax.Array) -> tuple[jax.Array, ModelCache]:
    out, cache = run_model(model, tokens[:, None], cache)
    return out.logits[:, 0], cache


@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("return_all_logits",))
def _extend(
    model: K3Model, cache: ModelCache, ids: jax.Array, return_all_logits: bool, real_tokens: jax.Array | None = None
) -> tuple[jax.Array, ModelCache]:
    out, cache = run_model(model, ids, cache, last_logits_only=not return_all_logits, real_tokens=real_tokens)
    return (out.logits if return_all_logits else out.logits[:, 0]), cache


@functools.partial(jax.jit, static_argnames=("batch", "capacity"))
def _empty_cache(model: K3Model, start: jax.Array | None, *, batch: int, capacity: int) -> ModelCache:
    return model.empty_cache(batch, capacity)._replace(start=start)


def _chunk_size(model: K3Model, chunk_size: int | None, batch: int, length: int, name: str = "chunk_size") -> int:
    """The tokens per prefill call: `chunk_size`, or the default for this model and device (see
    `k3jax.prefill_chunk`; None there: the whole prompt), at most the prompt length."""
    if chunk_size is None:
        chunk_size = default_chunk_size(model.config, batch, device_memory_bytes())
        return length if chunk_size is None else min(chunk_size, length)
    return min(_check_int(name, chunk_size, 1), length)


def _run_prompt(
    model: K3Model, ids: jax.Array, start: jax.Array | None, capacity: int, chunk: int, return_all_logits: bool
) -> tuple[jax.Array, ModelCache]:
    """Feed checked ids [B, T] into a fresh cache, `chunk` tokens per `_extend` call.

    Every full chunk runs one compiled program; the remainder (T % chunk tokens) compiles once more
    for its own shape. It is not padded to a full chunk: pad tokens after the prompt would pass
    through the KDA recurrences and land in the cache."""
    batch, length = ids.shape
    cache = _empty_cache(model, start, batch=batch, capacity=capacity)
    pieces = []
    for lo in range(0, length, chunk):
        logits, cache = _extend(model, cache, ids[:, lo : lo + chunk], return_all_logits)
        pieces.append(logits)
    return (jnp.concatenate(pieces, axis=1) if return_all_logits else pieces[-1]), cache


@functools.partial(jax.jit, static_argnames=("capacity", "return_all_logits"))
def _prefill_images(
    model: K3Model, ids: jax.Array, images: ImageInputs, start: jax.Array | None, *, capacity: int,
    return_all_logits: bool,
) -> tuple[jax.Array, ModelCache]:
    """A prompt with images in one call: the placeholders expanded to image features, fed as inputs_embeds."""
    cache = model.empty_cache(ids.shape[0], capacity)
    out, cache = run_model(model, None, cache, start=start, inputs_embeds=embed_images(model, ids, images),
                           last_logits_only=not return_all_logits)
    return (out.logits if return_all_logits else out.logits[:, 0]), cache


def _image_inputs(
    model: K3Model, ids: jax.Array, start: jax.Array | None, pixel_values, grid_thws
) -> tuple[ImageInputs | None, jax.Array | None, int]:
    """(images or None, start, the prompt length with each image's placeholder expanded)."""
    if pixel_values is None and grid_thws is None:
        return None, start, ids.shape[1]
    images, start = prepare_images(model, ids, start, pixel_values, grid_thws)
    return images, start, images.gather.shape[1]


def prefill(
    model: K3Model, input_ids: jax.Array, *, capacity: int | None = None, chunk_size: int | None = None,
    return_all_logits: bool = False, prompt_lengths=None, attention_mask=None, pixel_values=None,
    grid_thws=None,
) -> tuple[jax.Array, ModelCache]:
    """Run the prompt [B, T] into a cache with room for `capacity` tokens (default T).

    Returns (logits of the last position [B, vocab] fp32 — or of every position [B, T, vocab] with
    `return_all_logits` — and the cache). The prompt runs in chunks of `chunk_size` tokens (default:
    `k3jax.prefill_chunk.default_chunk_size` for this model and device), each appended to the cache
    like `extend`, so memory follows the chunk rather than the prompt; chunking does not change the
    result. With `prompt_lengths` [B] (or a left-padding `attention_mask` [B, T]), the prompts are
    left-padded to T (see `left_pad`); the cache remembers the padding, so later `decode_step`s keep
    the pads masked. Logits at pad positions are meaningless.

    With images (`pixel_values`, `grid_thws`; one placeholder token per image, see `k3jax.vision`)
    the prompt is the expanded one (its T' tokens count towards `capacity`, all-position logits are
    over it) and runs in one call: the image features enter as embeddings, not as chunkable ids.
    """
    ids = check_input_ids(input_ids, model.config)
    start = _pad_start(ids, _default_pad(model), prompt_lengths, attention_mask)
    images, start, length = _image_inputs(model, ids, start, pixel_values, grid_thws)
    capacity = length if capacity is None else _check_int("capacity", capacity, 1)
    if capacity < length:
        raise ValueError(f"capacity={capacity} is smaller than the prompt length {length}"
                         + (" (its images expanded)" if images is not None else ""))
    if images is not None:
        return _prefill_images(model, ids, images, start, capacity=capacity, return_all_logits=bool(return_all_logits))
    chunk = _chunk_size(model, chunk_size, *ids.shape)
    return _run_prompt(model, ids, start, capacity, chunk, bool(return_all_logits))


def padded_width(count: int, smallest: int) -> int:
    """The power of two at least `count` (and `smallest`) that a right-padded `extend` runs `count`
    tokens at, so lengths share a few compiled programs."""
    return max(smallest, 1 << (count - 1).bit_length())


def extend(
    model: K3Model, cache: ModelCache, input_ids: jax.Array, *, return_all_logits: bool = False,
    real_tokens: int | None = None,
) -> tuple[jax.Array, ModelCache]:
    """Append the tokens [B, T] to every cached sequence: a new chat turn, or one chunk of a prompt.

    Returns (logits of the last position [B, vocab] fp32 — or of every new position [B, T, vocab]
    with `return_all_logits` — and the updated cache). The cache passed in is donated; use the
    returned one. The ids are checked like `generate`'s prompt, the batch and room against the cache.

    `real_tokens`: only the first `real_tokens` ids of each row are appended; the rest are right
    padding, run but not kept (`run_model`), and "last position" means the last real one. One
    compiled program then serves every continuation length up to T (all T positions must fit).
    """
    ids = check_input_ids(input_ids, model.config)
    if ids.shape[0] != _cache_batch(cache):
        raise ValueError(f"input_ids has batch {ids.shape[0]} but the cache holds batch {_cache_batch(cache)}")
    if real_tokens is not None and (isinstance(real_tokens, bool) or not isinstance(real_tokens, (int, np.integer))
                                    or not 1 <= real_tokens <= ids.shape[1]):
        raise ValueError(f"real_tokens={real_tokens!r}: expected an integer in [1, {ids.shape[1]}] "
                         f"(input_ids has {ids.shape[1]} tokens per row)")
    if int(cache.length) + ids.shape[1] > cache.capacity:
        raise ValueError(
            f"the cache holds {int(cache.length)} of {cache.capacity} tokens: no room for {ids.shape[1]} more"
        )
    real = None if real_tokens is None else jnp.int32(real_tokens)
    return _extend(model, cache, ids, bool(return_all_logits), real)


def decode_step(model: K3Model, cache: ModelCache, tokens: jax.Array) -> tuple[jax.Array, ModelCache]:
    """Append one token per sequence (int32 [B]); returns (logits [B, vocab] fp32, updated cache).

    The tokens are checked like `generate`'s prompt (integers in the vocabulary, one per cached row).
    The cache passed in is donated (its buffers are reused); use the returned one.
    """
    tokens = check_input_ids(tokens, model.config, name="tokens", ndim=1)
    if tokens.shape[0] != _cache_batch(cache):
        raise ValueError(f"tokens has batch {tokens.shape[0]} but the cache holds batch {_cache_batch(cache)}")
    if int(cache.length) >= cache.capacity:
        raise ValueError(f"the cache is full: it holds {cache.capacity} tokens; prefill with a larger capacity")
    return _decode_step(model, cache, tokens)


def _select(
    params: SamplingParams, logits: jax.Array, key: jax.Array, done: jax.Array, lengths: jax.Array,
    stop: jax.Array, pad: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pick the next token of every row; rows already stopped emit `pad`. -> (token, done, lengths)."""
    token = jnp.where(done, pad, sample_with(params, logits, key))
    lengths = lengths + (~done).astype(jnp.int32)
    done = done | jnp.any(token[:, None] == stop[None, :], axis=-1)
    return token, done, lengths


_select_jit = jax.jit(_select, static_argnums=0)


# The cache is not donated: the loop returns only tokens, so no output could reuse its buffers.
@functools.partial(jax.jit, static_argnames=("params", "max_new_tokens"))
def _decode_loop(
    model: K3Model, cache: ModelCache, last: jax.Array, key: jax.Array, stop: jax.Array, pad: jax.Array,
    *, params: SamplingParams, max_new_tokens: int,
) -> tuple[jax.Array, jax.Array]:
    """From the prompt's last logits [B, vocab]: every new token, in one `lax.scan` of decode steps."""
    keys = jax.random.split(key, max_new_tokens)
    done = jnp.zeros(last.shape[0], bool)
    first, done, lengths = _select(params, last, keys[0], done, jnp.zeros(last.shape[0], jnp.int32), stop, pad)

    def step(carry, step_key):
        token, done, lengths, cache = carry
        step_out, cache = run_model(model, token[:, None], cache)
        token, done, lengths = _select(params, step_out.logits[:, 0], step_key, done, lengths, stop, pad)
        return (token, done, lengths, cache), token

    (_, _, lengths, _), rest = jax.lax.scan(step, (first, done, lengths, cache), keys[1:])
    return jnp.concatenate([first[:, None], rest.T], axis=1), lengths


def _streamed(
    model: K3Model, cache: ModelCache, last: jax.Array, key: jax.Array, stop: jax.Array, pad: jax.Array,
    params: SamplingParams, max_new_tokens: int, on_token: Callable[[np.ndarray], object],
) -> tuple[jax.Array, jax.Array]:
    keys = jax.random.split(key, max_new_tokens)
    batch = last.shape[0]
    done, lengths = jnp.zeros(batch, bool), jnp.zeros(batch, jnp.int32)
    tokens = []
    for i in range(max_new_tokens):
        if i:
            last, cache = _decode_step(model, cache, tokens[-1])
        token, done, lengths = _select_jit(params, last, keys[i], done, lengths, stop, pad)
        tokens.append(token)
        on_token(np.asarray(token))
        if i + 1 < max_new_tokens and bool(jnp.all(done)):  # every row stopped: the rest is padding
            tokens.extend([jnp.broadcast_to(pad, (batch,))] * (max_new_tokens - i - 1))
            break
    return jnp.stack(tokens, axis=1), lengths


def generate(
    model: K3Model, input_ids: jax.Array, *, max_new_tokens: int, temperature: float = 0.0,
    top_k: int | None = None, top_p: float | None = None, seed: int = 0, stop_tokens: Sequence[int] = (),
    pad_token_id: int | None = None, prompt_lengths=None, attention_mask=None, capacity: int | None = None,
    on_token: Callable[[np.ndarray], object] | None = None, return_lengths: bool = False,
    prefill_chunk_size: int | None = None, pixel_values=None, grid_thws=None,
) -> jax.Array | GenerateOutput:
    """Continue each prompt by up to `max_new_tokens` tokens: int32 [B, N]. Greedy at temperature 0.

    input_ids: int32 [B, T]; with `prompt_lengths` [B] (or `attention_mask` [B, T], 1 = real token)
        the prompts are LEFT-padded to T (`left_pad`); each row then generates what it would alone.
        A row that ends in pad_token_id where its real tokens should be (right padding) is an error.
    temperature / top_k / top_p: see `k3jax.sampling`; `seed` (an integer in [0, 2**32 - 1]) makes
        sampling reproducible.
    stop_tokens: once a row emits one of these, it emits `pad_token_id` (default: the config's, else
        0) afterwards; the loop still runs for max_new_tokens steps unless streaming.
    capacity: the cache size; it must hold the prompt and every generated token but the last
        (T + max_new_tokens - 1), which is also the default.
    on_token: called with each step's tokens (numpy int32 [B]) as they are produced, in order.
    return_lengths: return GenerateOutput(tokens, lengths) with the per-row generated lengths.
    prefill_chunk_size: prompt tokens per prefill call (default: see `prefill`); it does not change
        the tokens.
    pixel_values / grid_thws: images, one placeholder token per image in the prompts (see `prefill`);
        the prompt length above is then the expanded one.
    Every argument is checked before anything compiles; a bad one is a ValueError that names it.
    """
    vocab = model.config.vocab_size
    ids = check_input_ids(input_ids, model.config)
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    params = SamplingParams(temperature, top_k, top_p)
    seed = _check_int("seed", seed, 0, 2**32 - 1)  # jax.random.key wraps larger seeds
    pad_token_id = _default_pad(model) if pad_token_id is None else _check_token("pad_token_id", pad_token_id, vocab)
    start = _pad_start(ids, pad_token_id, prompt_lengths, attention_mask)
    images, start, length = _image_inputs(model, ids, start, pixel_values, grid_thws)
    needed = length + max_new_tokens - 1
    capacity = needed if capacity is None else _check_int("capacity", capacity, 1)
    if needed > capacity:
        raise ValueError(
            f"the prompt ({length} tokens) and max_new_tokens={max_new_tokens} need a cache of "
            f"{needed} tokens (the last new token is not cached), but capacity={capacity}"
        )
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, Iterable):
        raise ValueError(f"stop_tokens={stop_tokens!r}: expected a sequence of token ids")
    stop_list = [_check_token(f"stop_tokens[{i}]", t, vocab) for i, t in enumerate(stop_tokens)]
    chunk = _chunk_size(model, prefill_chunk_size, *ids.shape, name="prefill_chunk_size")
    # Padded with -1 to a multiple of 8 entries, so up to 8 stop tokens share one compiled program.
    stop = jnp.asarray(stop_list + [-1] * (-len(stop_list) % 8 or (8 if not stop_list else 0)), jnp.int32)
    if images is None:
        last, cache = _run_prompt(model, ids, start, capacity, chunk, False)
    else:
        last, cache = _prefill_images(model, ids, images, start, capacity=capacity, return_all_logits=False)
    args = (model, cache, last, jax.random.key(seed), stop, jnp.asarray(pad_token_id, jnp.int32))
    if on_token is None:
        tokens, lengths = _decode_loop(*args, params=params, max_new_tokens=max_new_tokens)
    else:
        tokens, lengths = _streamed(*args, params, max_new_tokens, on_token)
    return GenerateOutput(tokens, lengths) if return_lengths else tokens

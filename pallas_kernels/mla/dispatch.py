"""The implementations of MLA prefill attention and which problems each runs
(``pallas_kernels/dispatch.py`` is the mechanism and the policy).

Order is the policy's preference, all checked against "xla" on the GPU by ``benchmarks/mla_prefill.py``:
"cudnn" (cuDNN's fused flash attention with its own causal mask: whole prompts without a cache or left
padding), "cudnn_chunk" (a chunk continuing a cache, rows not left-padded: the cached keys and the
chunk's own keys in cuDNN calls with built-in masks, merged by their log-sum-exps; the cached keys in
blocks of at most ``CUDNN_PAST_BLOCK_BYTES``, so any cache length; ``cudnn_chunk.py``),
"cudnn_masked" (one call with an explicit [B, 1, T, S] mask: left-padded rows, with or without a cache),
else "xla", the blockwise pure-JAX path that runs everywhere (CPU, TPU, GPU) and takes every problem.
The three cuDNN entries are the GPU defaults.

The problem: ``(cached, left_padding, segments, context_split, dtype, qk_dim, mask_elements, expanded_bytes)``;
``cached``:
the queries continue a cache (chunked prefill) rather than being the whole sequence; ``context_split``:
the latents are sharded along their positions over a mesh axis (context parallelism), which cuDNN's
custom-call partitioning refuses; ``mask_elements``: B x T x S, the size of the mask a masked call
needs (see ``cudnn.py``); ``expanded_bytes``: the per-head keys and (padded) values of all S positions
that every cuDNN entry expands before its call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import Implementation
from pallas_kernels.mla.cudnn import cudnn_mla_attention
from pallas_kernels.mla.cudnn_chunk import cudnn_chunk_mla_attention
from pallas_kernels.mla.reference import blockwise_mla_attention
from pallas_kernels.platform import PLATFORMS

_ALL = frozenset(PLATFORMS)
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 256
# "cudnn_masked" materialises a [B, 1, T, S] mask and cuDNN's bias from it (3 bytes an element): past
# 2^31 elements (an 8192-token chunk over a 256K cache) the blockwise path, which holds no such array,
# is the better trade.
CUDNN_MAX_MASK_ELEMENTS = 1 << 31
# The cuDNN entries expand the per-head keys and values of the positions they attend first (74 KB a
# position at K3's widths). "cudnn" and "cudnn_masked" take all S positions in one call: past 32 GiB
# (about 460K positions) the blockwise path, which expands one key block at a time, is the better
# trade. "cudnn_chunk" runs the cached positions in blocks of CUDNN_PAST_BLOCK_BYTES instead: a
# quarter of that bound, so a block's expansion, its padded copy and cuDNN's workspace stay well
# inside one 80 GB card beside the weights.
CUDNN_MAX_EXPANDED_BYTES = 32 << 30
CUDNN_PAST_BLOCK_BYTES = CUDNN_MAX_EXPANDED_BYTES // 4


def _one_call_expansion(expanded_bytes: int) -> str | None:
    if expanded_bytes > CUDNN_MAX_EXPANDED_BYTES:
        return (f"the expanded keys and values of the cached positions take {expanded_bytes} bytes, over the "
                f"{CUDNN_MAX_EXPANDED_BYTES} one cuDNN call is allowed")
    return None


def _cudnn_operands(*, dtype: jnp.dtype, qk_dim: int) -> str | None:
    if jnp.dtype(dtype) not in CUDNN_DTYPES:
        return f"cuDNN flash attention takes bf16 or fp16, got {jnp.dtype(dtype)}"
    if qk_dim % 8 or qk_dim > CUDNN_MAX_HEAD_DIM:
        return (f"cuDNN flash attention takes head sizes that are multiples of 8 up to {CUDNN_MAX_HEAD_DIM}, "
                f"got {qk_dim}")
    return None


def _cudnn_layout(*, segments: bool, context_split: bool) -> str | None:
    if segments:
        return "packed documents (training rows) stay on the blockwise path, whose gradient is tested"
    if context_split:
        return "latents split over a context mesh axis: cuDNN's partitioning takes no sequence split"
    return None


def cudnn_supports(*, cached: bool, left_padding: bool, segments: bool, context_split: bool, dtype: jnp.dtype,
                   qk_dim: int, expanded_bytes: int, **_: object) -> str | None:
    if reason := _cudnn_layout(segments=segments, context_split=context_split):
        return reason
    if cached or left_padding:
        return ("a chunk continuing a cache ('cudnn_chunk') or left-padded rows ('cudnn_masked') need "
                "other masks than cuDNN's causal one")
    return _one_call_expansion(expanded_bytes) or _cudnn_operands(dtype=dtype, qk_dim=qk_dim)


def cudnn_chunk_supports(*, cached: bool, left_padding: bool, segments: bool, context_split: bool,
                        dtype: jnp.dtype, qk_dim: int, **_: object) -> str | None:
    if reason := _cudnn_layout(segments=segments, context_split=context_split):
        return reason
    if not cached:
        return "a whole prompt runs on 'cudnn' (one call, its causal mask)"
    if left_padding:
        return "left-padded rows hide keys inside the cache, which needs an explicit mask: 'cudnn_masked'"
    return _cudnn_operands(dtype=dtype, qk_dim=qk_dim)  # any cache length: the past runs in bounded blocks


def cudnn_masked_supports(*, segments: bool, context_split: bool, dtype: jnp.dtype, qk_dim: int,
                          mask_elements: int, expanded_bytes: int, **_: object) -> str | None:
    if reason := _cudnn_layout(segments=segments, context_split=context_split):
        return reason
    if mask_elements > CUDNN_MAX_MASK_ELEMENTS:
        return (f"the call needs a [B, 1, T, S] mask of {mask_elements} elements, over the "
                f"{CUDNN_MAX_MASK_ELEMENTS} this path allows")
    return _one_call_expansion(expanded_bytes) or _cudnn_operands(dtype=dtype, qk_dim=qk_dim)


def _cudnn(*args, **kwargs):
    return cudnn_mla_attention(*args, implementation="cudnn", **kwargs)


def _cudnn_chunk(q: jax.Array, *args, **kwargs) -> jax.Array:
    batch, _, heads, qk_dim = q.shape
    position_bytes = batch * heads * 2 * qk_dim * q.dtype.itemsize  # one cached position's keys and values
    return cudnn_chunk_mla_attention(q, *args, implementation="cudnn",
                                     past_block=max(1, CUDNN_PAST_BLOCK_BYTES // position_bytes), **kwargs)


IMPLEMENTATIONS: dict[str, Implementation] = {
    "cudnn": Implementation("cudnn", _cudnn, frozenset({"gpu"}), default_on=frozenset({"gpu"}),
                            supports=cudnn_supports),
    "cudnn_chunk": Implementation("cudnn_chunk", _cudnn_chunk, frozenset({"gpu"}), default_on=frozenset({"gpu"}),
                                  supports=cudnn_chunk_supports),
    "cudnn_masked": Implementation("cudnn_masked", _cudnn, frozenset({"gpu"}), default_on=frozenset({"gpu"}),
                                   supports=cudnn_masked_supports),
    "xla": Implementation("xla", blockwise_mla_attention, _ALL, default_on=_ALL),
}

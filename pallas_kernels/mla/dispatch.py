"""The implementations of MLA prefill attention and which problems each runs
(``pallas_kernels/dispatch.py`` is the mechanism and the policy).

Order is the policy's preference: "cudnn" (cuDNN's fused flash attention) where it supports the
call, else "xla", the blockwise pure-JAX path that runs everywhere (CPU, TPU, GPU) and takes every
problem. "cudnn" runs on GPU when named; it becomes a GPU default (``default_on``) once
``benchmarks/mla_prefill.py`` has verified it there against "xla".

The problem: ``(cached, left_padding, segments, dtype, qk_dim)``; ``cached``: the queries continue a cache
(chunked prefill) rather than being the whole sequence (see ``cudnn.py`` for why cuDNN takes only
the latter).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.dispatch import Implementation
from pallas_kernels.mla.cudnn import cudnn_mla_attention
from pallas_kernels.mla.reference import blockwise_mla_attention
from pallas_kernels.platform import PLATFORMS

_ALL = frozenset(PLATFORMS)
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 256


def cudnn_supports(*, cached: bool, left_padding: bool, segments: bool, dtype: jnp.dtype, qk_dim: int,
                   **_: object) -> str | None:
    if segments:
        return "packed documents need a per-document mask; this path passes cuDNN none"
    if cached:
        return "a chunk continuing a cache needs a causal mask offset into the keys, which cuDNN's lacks"
    if left_padding:
        return "left padding needs a mask from the start of each row, which cuDNN's attention masks lack"
    if jnp.dtype(dtype) not in CUDNN_DTYPES:
        return f"cuDNN flash attention takes bf16 or fp16, got {jnp.dtype(dtype)}"
    if qk_dim % 8 or qk_dim > CUDNN_MAX_HEAD_DIM:
        return (f"cuDNN flash attention takes head sizes that are multiples of 8 up to {CUDNN_MAX_HEAD_DIM}, "
                f"got {qk_dim}")
    return None


def _cudnn(*args, **kwargs):
    return cudnn_mla_attention(*args, implementation="cudnn", **kwargs)


IMPLEMENTATIONS: dict[str, Implementation] = {
    "cudnn": Implementation("cudnn", _cudnn, frozenset({"gpu"}), supports=cudnn_supports),
    "xla": Implementation("xla", blockwise_mla_attention, _ALL, default_on=_ALL),
}

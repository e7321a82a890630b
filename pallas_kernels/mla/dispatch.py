"""The implementations of MLA prefill attention and which problems each runs
(``pallas_kernels/dispatch.py`` is the mechanism and the policy).

Order is the policy's preference: on GPU "cudnn" (cuDNN's fused flash attention) wherever it
supports the call, else "xla", the blockwise pure-JAX path that runs everywhere and is the
default on CPU and TPU.

The problem: ``(left_padding, dtype, qk_dim)``; left padding is a per-row mask from the start of
the row, which cuDNN's masks cannot express.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.dispatch import Implementation
from pallas_kernels.mla.cudnn import segmented_mla_attention
from pallas_kernels.mla.reference import blockwise_mla_attention
from pallas_kernels.platform import PLATFORMS

_ALL = frozenset(PLATFORMS)
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 256


def cudnn_supports(*, left_padding: bool, dtype: jnp.dtype, qk_dim: int, **_: object) -> str | None:
    if left_padding:
        return "left padding needs a mask from the start of each row, which cuDNN's attention masks lack"
    if jnp.dtype(dtype) not in CUDNN_DTYPES:
        return f"cuDNN flash attention takes bf16 or fp16, got {jnp.dtype(dtype)}"
    if qk_dim % 8 or qk_dim > CUDNN_MAX_HEAD_DIM:
        return (f"cuDNN flash attention takes head sizes that are multiples of 8 up to {CUDNN_MAX_HEAD_DIM}, "
                f"got {qk_dim}")
    return None


def _cudnn(*args, **kwargs):
    return segmented_mla_attention(*args, implementation="cudnn", **kwargs)


IMPLEMENTATIONS: dict[str, Implementation] = {
    "cudnn": Implementation("cudnn", _cudnn, frozenset({"gpu"}), default_on=frozenset({"gpu"}),
                            supports=cudnn_supports),
    "xla": Implementation("xla", blockwise_mla_attention, _ALL, default_on=_ALL),
}

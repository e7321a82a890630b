"""Non-causal attention within each item of a packed sequence of images (no attention across items).

Items of different lengths are laid out as a padded batch [items, longest, heads, head_dim] and run
through `jax.nn.dot_product_attention` with per-item sequence lengths: "cudnn" (its fused flash
kernel, GPU, bf16/fp16) or "xla" (the reference, any platform and dtype: scores and softmax in
float32, probabilities rounded to the activation dtype before the product with V, as the official
eager path). The choice follows `pallas_kernels.dispatch`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.dispatch import Implementation, choose
from pallas_kernels.precision import exact_if_fp32

CUDNN_MAX_HEAD_DIM = 128


def _cudnn_supports(*, dtype: jnp.dtype, head_dim: int) -> str | None:
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN attention needs bfloat16 or float16, got {jnp.dtype(dtype).name}"
    if head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8:
        return f"cuDNN attention needs a head_dim that is a multiple of 8 up to {CUDNN_MAX_HEAD_DIM}, got {head_dim}"
    return None


def _run(implementation: str):
    def run(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array | None) -> jax.Array:
        attend = lambda: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation=implementation)
        if exact_if_fp32(q.dtype) is None:
            return attend()
        with jax.default_matmul_precision("highest"):  # true fp32 scores on GPUs too (not TF32)
            return attend()
    return run


IMPLEMENTATIONS: dict[str, Implementation] = {
    "cudnn": Implementation("cudnn", _run("cudnn"), frozenset({"gpu"}), frozenset({"gpu"}), _cudnn_supports),
    "xla": Implementation("xla", _run("xla"), frozenset({"cpu", "gpu", "tpu"}), frozenset({"cpu", "gpu", "tpu"})),
}


def packed_layout(lengths: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Static gathers between a packed sequence [sum(lengths)] and the padded batch [items, longest]:
    (padded <- packed indices [items, longest], packed <- padded flat indices [sum(lengths)])."""
    longest = max(lengths)
    offsets = np.cumsum((0,) + lengths[:-1])
    to_padded = np.stack([off + np.minimum(np.arange(longest), n - 1) for off, n in zip(offsets, lengths)])
    to_packed = np.concatenate([i * longest + np.arange(n) for i, n in enumerate(lengths)])
    return to_padded, to_packed


def item_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: tuple[int, ...],
                   implementation: str | None = None) -> jax.Array:
    """q, k, v [L, H, hd] packed items of `lengths` (static) -> [L, H, hd]; scale head_dim^-1/2."""
    impl = choose("vision_attention", IMPLEMENTATIONS, implementation, dtype=q.dtype, head_dim=q.shape[-1])
    if len(set(lengths)) == 1:  # items of one length (one image, say): a plain batch, no padding
        out = impl.run(*(x.reshape(len(lengths), lengths[0], *x.shape[1:]) for x in (q, k, v)), None)
        return out.reshape(q.shape)
    to_padded, to_packed = packed_layout(lengths)
    padded = [x[to_padded] for x in (q, k, v)]  # [items, longest, H, hd]
    out = impl.run(*padded, jnp.asarray(lengths, jnp.int32))
    return out.reshape(-1, *out.shape[2:])[to_packed]

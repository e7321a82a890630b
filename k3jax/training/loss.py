"""Next-token cross-entropy (with optional z-loss) from the final hidden states, without [tokens, vocab] logits.

The lm_head is applied one block of `vocab_chunk` columns at a time inside a `lax.scan` that keeps a
running (max, sum of exp) per token, i.e. an online logsumexp, and picks each token's target logit
from the block that holds it. The scan body is rematerialised (`jax.checkpoint`), so neither pass
holds more than [tokens, vocab_chunk] fp32 logits: the backward recomputes each block's logits and
its softmax slice. Chunking over the vocabulary (not the tokens) keeps whole rows of the hidden
states in one GEMM per block, and JAX differentiates the scan exactly; the running max enters
through `stop_gradient` (logsumexp does not depend on the shift), so no custom VJP is needed.
Each block's logits are rounded like the model's own lm_head (`linear` in the activation dtype,
then fp32), so the loss equals the cross-entropy of `model(input_ids)`'s logits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.nn.layers import F32, linear


class LossSums(NamedTuple):
    """Sums over counted tokens (divide by `tokens` for means); kept as sums so micro-batches add up."""

    nll: jax.Array  # sum of mask * (logsumexp - target logit)
    z: jax.Array  # sum of mask * logsumexp^2
    tokens: jax.Array  # sum of mask


def chunked_cross_entropy(
    hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, mask: jax.Array, *, vocab_chunk: int
) -> LossSums:
    """hidden [N, D] (after the final norm), lm_head [V, D], targets int32 [N], mask float32 [N]."""
    vocab = lm_head.shape[0]
    chunk = min(vocab_chunk, vocab)
    n_chunks = -(-vocab // chunk)
    pad = n_chunks * chunk - vocab
    blocks = jnp.pad(lm_head, ((0, pad), (0, 0))).reshape(n_chunks, chunk, lm_head.shape[1])
    n = hidden.shape[0]

    def body(carry, xs):
        running_max, sum_exp, target_logit = carry
        block, index = xs
        logits = linear(hidden, block).astype(F32)  # [N, chunk]
        column = index * chunk + jnp.arange(chunk)
        logits = jnp.where(column < vocab, logits, -jnp.inf)  # padded columns
        new_max = jax.lax.stop_gradient(jnp.maximum(running_max, jnp.max(logits, axis=-1)))
        sum_exp = sum_exp * jnp.exp(running_max - new_max) + jnp.sum(jnp.exp(logits - new_max[:, None]), axis=-1)
        local = targets - index * chunk
        inside = (local >= 0) & (local < chunk)
        picked = jnp.take_along_axis(logits, jnp.clip(local, 0, chunk - 1)[:, None], axis=-1)[:, 0]
        target_logit = target_logit + jnp.where(inside, picked, 0.0)
        return (new_max, sum_exp, target_logit), None

    init = (jnp.full((n,), -jnp.inf, F32), jnp.zeros((n,), F32), jnp.zeros((n,), F32))
    (running_max, sum_exp, target_logit), _ = jax.lax.scan(
        jax.checkpoint(body), init, (blocks, jnp.arange(n_chunks))
    )
    lse = running_max + jnp.log(sum_exp)
    mask = mask.astype(F32)
    return LossSums(
        nll=jnp.sum(mask * (lse - target_logit)), z=jnp.sum(mask * lse * lse), tokens=jnp.sum(mask)
    )


def naive_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> LossSums:
    """The same sums from materialised fp32 logits [N, V] (the reference the chunked loss is tested against)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    mask = mask.astype(F32)
    return LossSums(nll=jnp.sum(mask * (lse - picked)), z=jnp.sum(mask * lse * lse), tokens=jnp.sum(mask))

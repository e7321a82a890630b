"""Block Attention Residuals: softmax attention over depth replaces the residual stream.

The stream between layers is `AttnResStream(bank, num_blocks, prefix)`: `bank` holds the completed
block vectors (the embeddings first, then per-block sums of sublayer outputs), `prefix` the running
sum of the current block. The bank has a fixed size (every block the depth will push) and
`num_blocks` says how many rows are filled, so a `lax.scan` over layers can carry it unchanged in
shape; unfilled rows are masked out of the softmax. Storage is in the activation dtype (bf16 in the
release), the mix itself in fp32 (k3-architecture.md §2).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from k3jax.nn.layers import F32, HIGHEST


class AttnResStream(NamedTuple):
    bank: jax.Array  # [num_bank_rows, B, T, D]  completed blocks, activation dtype
    num_blocks: jax.Array  # int32 scalar: rows of `bank` filled so far
    prefix: jax.Array  # [B, T, D]  running partial sum of the current block

    @classmethod
    def start(cls, embeddings: jax.Array, num_bank_rows: int) -> "AttnResStream":
        bank = jnp.zeros((num_bank_rows, *embeddings.shape), embeddings.dtype)
        return cls(bank, jnp.zeros((), jnp.int32), embeddings)

    def push_block_if(self, push: jax.Array | bool) -> "AttnResStream":
        """At a block boundary the partial sum becomes a bank row and a new (empty) block starts."""
        pushed = jax.lax.dynamic_update_index_in_dim(self.bank, self.prefix, self.num_blocks, axis=0)
        return AttnResStream(
            bank=jnp.where(push, pushed, self.bank),
            num_blocks=self.num_blocks + jnp.asarray(push, jnp.int32),
            prefix=jnp.where(push, jnp.zeros_like(self.prefix), self.prefix),
        )

    def add(self, sublayer_output: jax.Array) -> "AttnResStream":
        return self._replace(prefix=self.prefix + sublayer_output)


def attn_res_mix(stream: AttnResStream, query: jax.Array, key_norm: jax.Array, eps: float) -> jax.Array:
    """Mix [bank rows..., prefix] with softmax weights from a learned pseudo-query.

    Keys are the RMS-normalised sources (no gain); the score vector is key_norm * query; values
    are the raw sources. fp32 inside, result in the stream's dtype.
    """
    sources = jnp.concatenate([stream.bank, stream.prefix[None]], axis=0).astype(F32)  # [S, B, T, D]
    keys = sources * jax.lax.rsqrt(jnp.mean(sources * sources, axis=-1, keepdims=True) + eps)
    score_vector = key_norm.astype(F32) * query.astype(F32)  # [D]
    logits = jnp.einsum("sbtd,d->sbt", keys, score_vector, precision=HIGHEST)
    row = jnp.arange(sources.shape[0])
    valid = (row < stream.num_blocks) | (row == sources.shape[0] - 1)
    weights = jax.nn.softmax(jnp.where(valid[:, None, None], logits, -jnp.inf), axis=0)
    mixed = jnp.einsum("sbt,sbtd->btd", weights, sources, precision=HIGHEST)
    return mixed.astype(stream.prefix.dtype)


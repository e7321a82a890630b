"""The patch-merger projector (`mm_projector`): merged vision features -> text embeddings.

Linear(4D -> 4D) -> GELU -> Linear(4D -> text width) -> RMSNorm(projector_ln_eps). The GELU is the
exact erf form whatever `projector_hidden_act` says, as in the official code. `proj` mirrors the
release's `proj.0` / `proj.2` (index 1 is the weightless GELU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import VisionConfig
from k3jax.nn.layers import Linear, RMSNorm
from k3jax.vision.tower import gelu


class ErfGELU(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return gelu(x, approximate=False)


class Projector(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        width = 4 * cfg.hidden_size
        self.proj = nnx.List([
            Linear(width, width, dtype=dtype, axes=("mlp", None), rngs=rngs),
            ErfGELU(),
            Linear(width, cfg.text_hidden_size, dtype=dtype, axes=("embed", "mlp"), rngs=rngs),
        ])
        self.post_norm = RMSNorm(cfg.text_hidden_size, cfg.projector_eps, dtype=dtype, axis="embed", rngs=rngs)

    def __call__(self, merged: jax.Array) -> jax.Array:
        """[tokens, 4 * hidden] -> [tokens, text hidden]."""
        x = merged
        for layer in self.proj:
            x = layer(x)
        return self.post_norm(x)

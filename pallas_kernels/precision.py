"""The matmul precision that keeps fp32 exact on every backend, shared by the model and the kernels'
references."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def exact_if_fp32(dtype: jnp.dtype) -> jax.lax.Precision | None:
    """HIGHEST for fp32 operands, else the backend's default. GPUs otherwise run fp32 dots as TF32
    (~1e-3 relative) where the reference's torch GEMMs are true fp32; bf16 is native either way."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

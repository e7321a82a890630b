"""SiTU-GLU: the softcapped SwiGLU used by every K3 FFN (dense layer 0, shared and routed experts).

SiTU(g, u) = b1*tanh(g/b1)*sigmoid(g) * b2*tanh(u/b2); the sigmoid takes the *raw* gate. Computed in
fp32 and cast back before the down projection, as the reference does (k3-architecture.md §3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.nn.layers import Linear
from pallas_kernels.moe.reference import situ


class SiTUMLP(nnx.Module):
    """Full-width gate/up/down MLP (layer 0's dense FFN and the fused shared experts)."""

    def __init__(
        self, hidden: int, intermediate: int, beta: float, linear_beta: float | None, *,
        dtype: jnp.dtype, mlp_axis: str, rngs: nnx.Rngs,
    ) -> None:
        self.gate_proj = Linear(hidden, intermediate, dtype=dtype, axes=(mlp_axis, "embed"), rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, axes=(mlp_axis, "embed"), rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, axes=("embed", mlp_axis), rngs=rngs)
        self.beta, self.linear_beta = beta, linear_beta

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))

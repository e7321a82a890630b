"""Shared building blocks: parameter declaration, linear maps and RMSNorm with the reference's casts.

Weights keep the release layout ([out, in] for linear maps) so loading a checkpoint is a copy, and
every parameter carries its logical axis names so shardings can be derived from one table.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.precision import exact_if_fp32

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def normal_init(std: float) -> Initializer:
    return lambda key, shape, dtype: (std * jax.random.normal(key, shape, F32)).astype(dtype)


def constant_init(value: float) -> Initializer:
    return lambda key, shape, dtype: jnp.full(shape, value, dtype)


def declare(
    rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, axes: tuple[str | None, ...], init: Initializer
) -> nnx.Param:
    """One declaration per weight: shape, dtype, logical axes and initializer together."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., in] @ weight[out, in].T in x's dtype, accumulated in fp32 and rounded once (as a torch GEMM).

    The product is asked for in x's dtype, not as fp32 then cast: the backends accumulate bf16 GEMMs
    in fp32 and round once either way (the same forward), but the transpose of an fp32-output product
    takes an fp32 cotangent and promotes the bf16 operand, so the backward's GEMMs would run in fp32
    (TF32 on GPU) rather than in bf16 like the forward's.
    """
    return jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype), preferred_element_type=x.dtype,
                      precision=exact_if_fp32(x.dtype))


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """KimiRMSNorm: normalise in fp32, cast back to x's dtype, then multiply by the gain."""
    x32 = x.astype(F32)
    y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return y if weight is None else weight * y


class Linear(nnx.Module):
    """A bias-free projection whose parameter is named `weight`, like the checkpoint's."""

    def __init__(
        self, in_dim: int, out_dim: int, *, dtype: jnp.dtype, axes: tuple[str | None, str | None],
        rngs: nnx.Rngs, gain: float = 1.0,
    ) -> None:
        self.weight = declare(rngs, (out_dim, in_dim), dtype, axes, normal_init(gain / in_dim**0.5))

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear(x, self.weight[...])


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype, axis: str | None, rngs: nnx.Rngs) -> None:
        self.weight = declare(rngs, (dim,), dtype, (axis,), constant_init(1.0))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)

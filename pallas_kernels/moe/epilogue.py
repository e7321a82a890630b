"""The SiTU activation as the kernels' epilogues and the backward compute it: fp32 in, fp32 out.

SiTU(g, u) = b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2)   (up = u when linear_beta is None).

sigmoid(g) is written 1 / (1 + e^-g), accurate in relative terms for any g (a sigmoid from tanh,
(1 + tanh(g/2)) / 2, would lose all relative accuracy for strongly negative gates). A kernel may
pass faster hardware forms of tanh and sigmoid (the Triton kernels' PTX approximations).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

F32 = jnp.float32
Unary = Callable[[jax.Array], jax.Array]


def sigmoid_f32(x: jax.Array) -> jax.Array:
    """1 / (1 + e^-x): the right limits for large |x| (e^-x overflowing to inf gives 0)."""
    return 1.0 / (1.0 + jnp.exp(-x))


def situ_f32(g: jax.Array, u: jax.Array, beta: float, linear_beta: float | None, *,
             tanh: Unary = jnp.tanh, sigmoid: Unary = sigmoid_f32) -> jax.Array:
    """SiTU of fp32 gate and up accumulators, in fp32."""
    gate = beta * tanh(g * (1.0 / beta)) * sigmoid(g)
    up = u if linear_beta is None else linear_beta * tanh(u * (1.0 / linear_beta))
    return gate * up


def situ_and_grads(g: jax.Array, u: jax.Array, beta: float,
                   linear_beta: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(SiTU(g, u), dSiTU/dg, dSiTU/du), all fp32, written out explicitly (not through autodiff).

    With t1 = tanh(g/b1), s = sigmoid(g), gate = b1 t1 s:
      d gate / dg = (1 - t1^2) s + b1 t1 s (1 - s) = (1 - t1^2) s + gate (1 - s);
      up = b2 tanh(u/b2), d up / du = 1 - tanh^2(u/b2)   (up = u, derivative 1, without linear_beta);
      dS/dg = gate' * up,  dS/du = gate * up'.
    """
    g, u = g.astype(F32), u.astype(F32)
    t1 = jnp.tanh(g * (1.0 / beta))
    s = sigmoid_f32(g)
    gate = beta * t1 * s
    dgate = (1.0 - t1 * t1) * s + gate * (1.0 - s)
    if linear_beta is None:
        up, dup = u, jnp.ones_like(u)
    else:
        t2 = jnp.tanh(u * (1.0 / linear_beta))
        up, dup = linear_beta * t2, 1.0 - t2 * t2
    return gate * up, dgate * up, gate * dup

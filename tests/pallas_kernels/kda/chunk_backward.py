"""Analytic backward of chunked KDA in pure JAX (safe gate: every ``g >= -5``): the test oracle of
the GPU backward.

Three passes, the same ones the GPU backward (``pallas_kernels/kda/gpu_backward.py``) runs as
kernels:

1. per chunk, in parallel: recompute the forward's chunk quantities (``chunk_math.chunk_parts``:
   the WY representation W, U through ``(I + L)^{-1}``, Aqk, Qg, Kd, the chunk decay);
2. across chunks: the forward state scan again, keeping each chunk's input state ``h_c``, then a
   reverse scan for ``dh_c`` (the gradient of the state leaving chunk c) and
   ``dv_new = Aqk^T dO + Kd dh_c``; the reverse scan's final carry is the initial state's gradient;
3. per chunk, in parallel: the gradients for q, k, v, g and beta (``chunk_math.chunk_grads``).

Nothing is stored by the forward: the backward recomputes from the inputs, so its memory is the
per-chunk states ``[B, N, H, K, V]`` plus chunk-sized intermediates, never pairwise decay tensors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda.chunk_math import C, chunk_grads, chunk_parts, dot

_F32 = jnp.float32


def _to_chunks(x: jax.Array, n: int) -> jax.Array:
    """[B, T, H, *] -> [B, H, N, C, *] fp32, zero-padded (a zero step is an identity step)."""
    B, T, H = x.shape[:3]
    x = jnp.pad(x.astype(_F32), [(0, 0), (0, n * C - T)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape((B, n, C, H) + x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def _from_chunks(x: jax.Array, T: int, dtype) -> jax.Array:
    """[B, H, N, C, *] -> [B, T, H, *]."""
    B, H, n = x.shape[:3]
    x = jnp.moveaxis(x, 1, 3).reshape((B, n * C, H) + x.shape[4:])
    return x[:, :T].astype(dtype)


def _vmap3(f):
    return jax.vmap(jax.vmap(jax.vmap(f)))


def chunk_states(parts: dict[str, jax.Array], s0: jax.Array, mm_dtype) -> jax.Array:
    """Input state of every chunk, ``[B, H, N, K, V]``, from the per-chunk W, U, Kd, gl."""
    mm = jax.vmap(jax.vmap(functools.partial(dot, mm_dtype=mm_dtype)))
    mm_t = jax.vmap(jax.vmap(functools.partial(dot, mm_dtype=mm_dtype, trans_a=True)))

    def step(S, x):
        W, U, Kd, gl = x
        vn = U - mm(W, S)
        return gl[..., 0, :, None] * S + mm_t(Kd, vn), S

    xs = tuple(jnp.moveaxis(parts[n], 2, 0) for n in ("W", "U", "Kd", "gl"))
    _, h = lax.scan(step, s0, xs)
    return jnp.moveaxis(h, 0, 2)


def state_grads(parts, do, dht, mm_dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reverse scan: ``(dh [B, H, N, K, V], dv_new [B, H, N, C, V], d initial_state)``.

    ``dh[c]`` is the gradient of the state leaving chunk c (the last one is ``dht``).
    """
    mm = jax.vmap(jax.vmap(functools.partial(dot, mm_dtype=mm_dtype)))
    mm_t = jax.vmap(jax.vmap(functools.partial(dot, mm_dtype=mm_dtype, trans_a=True)))

    def step(dS, x):
        Qg, W, Aqk, Kd, gl, dO = x
        dvn = mm_t(Aqk, dO) + mm(Kd, dS)
        prev = gl[..., 0, :, None] * dS + mm_t(Qg, dO) - mm_t(W, dvn)
        return prev, (dS, dvn)

    names = ("Qg", "W", "Aqk", "Kd", "gl")
    xs = tuple(jnp.moveaxis(parts[n], 2, 0) for n in names) + (jnp.moveaxis(do, 2, 0),)
    ds0, (dh, dvn) = lax.scan(step, dht, xs, reverse=True)
    return jnp.moveaxis(dh, 0, 2), jnp.moveaxis(dvn, 0, 2), ds0


@functools.partial(jax.jit, static_argnames="scale")
def chunk_kda_bwd(q, k, v, g, beta, initial_state, do, dht, *, scale: float):
    """Gradients of ``chunked_kda``'s ``(o, final_state)`` w.r.t. all of its inputs.

    q, k, g [B, T, H, K]; v, do [B, T, H, V]; beta [B, T, H]; initial_state, dht fp32
    [B, H, K, V]. Returns ``(dq, dk, dv, dg, dbeta, d initial_state)`` in the inputs' dtypes.
    fp32 inputs use fp32 (IEEE) matmuls, others bf16 matmuls with fp32 accumulation.
    """
    T = q.shape[1]
    n = -(-T // C)
    mm_dtype = _F32 if v.dtype == _F32 else jnp.bfloat16
    qs, kc, vc, gc, doc = (_to_chunks(x, n) for x in (q * scale, k, v, g, do))
    bc = _to_chunks(beta[..., None], n)[..., 0]
    parts = _vmap3(functools.partial(chunk_parts, mm_dtype=mm_dtype))(qs, kc, vc, gc, bc)
    h = chunk_states(parts, initial_state.astype(_F32), mm_dtype)
    dh, dvn, ds0 = state_grads(parts, doc, dht.astype(_F32), mm_dtype)
    grads = _vmap3(functools.partial(chunk_grads, mm_dtype=mm_dtype))(
        qs, kc, vc, gc, bc, parts["A"], parts["W"], parts["U"], h, dh, doc, dvn
    )
    dqs, dk, dv, dg, dbeta = grads
    return (
        _from_chunks(dqs * scale, T, q.dtype),
        _from_chunks(dk, T, k.dtype),
        _from_chunks(dv, T, v.dtype),
        _from_chunks(dg, T, g.dtype),
        _from_chunks(dbeta[..., None], T, beta.dtype)[..., 0],
        ds0,
    )

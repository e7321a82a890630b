"""KDA decode step (one token per sequence) as a Pallas kernel that streams the fp32 state once.

Per program ``(iv, h, b)`` of the grid ``(V / BV, H, B)`` (the V block varies fastest, so
consecutive programs stream one state's consecutive memory): load the state block ``S [K, BV]``
(fp32) and the token's ``q, k, g [K]``, ``v [BV]``, ``beta``; then, all in registers::

    S <- diag(exp(g)) S
    r  = v - S^T k
    S <- S + beta k r^T
    o  = S^T (scale q)

and store ``S`` (in place: ``input_output_aliases`` maps the state input onto the state output)
and ``o [BV]`` in ``v.dtype``. Columns of S are independent in this recurrence, so splitting V
over programs needs no communication; the matvecs are broadcast-multiply + axis-0 reductions in
fp32 (no tensor cores / TF32, and no 16-row minimum of ``tl.dot``). The step is memory bound:
``2 * B*H*K*V*4`` bytes of state traffic against ~6 flops per state element.

Same conventions as ``reference.recurrent_kda_step``: q, k [B, H, K] (L2-normalised), v [B, H, V],
g [B, H, K] log-decay, beta [B, H], state fp32 [B, H, K, V], scale default ``K**-0.5``.

Backend: the Pallas-Triton lowering on GPU (K and BV powers of two >= 16), interpret mode on CPU.
Columns of 64 per program and the V block as the fastest grid axis were the fastest measured
(benchmarks/RESULTS.md). The state is updated in place only when the caller's buffer can be
donated: ``donate_state=True`` here, or a donated state inside the caller's own ``jit``;
otherwise XLA copies it first (the result is the same).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.triton.intra_blocks import compiler_params, triton_takes
from pallas_kernels.platform import current_platform

_F32 = jnp.float32


def _decode_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, so_ref, *, scale, bv):
    iv, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(iv * bv, bv)
    q = q_ref[b, h, :].astype(_F32) * scale
    k = k_ref[b, h, :].astype(_F32)
    g = g_ref[b, h, :].astype(_F32)
    v = v_ref[b, h, vs].astype(_F32)
    beta = jnp.sum(b_ref[b, h, :].astype(_F32))  # [1] -> scalar (no scalar ref loads needed)
    S = s_ref[b, h, :, vs] * jnp.exp(g)[:, None]
    r = v - jnp.sum(k[:, None] * S, axis=0)
    S = S + (beta * k)[:, None] * r[None, :]
    o_ref[b, h, vs] = jnp.sum(q[:, None] * S, axis=0).astype(o_ref.dtype)
    so_ref[b, h, :, vs] = S  # same buffer as s_ref; only this program touches this block


def _decode(q, k, v, g, beta, state, *, scale, interpret, block_v, num_warps):
    B, H, K = q.shape
    V = v.shape[-1]
    bv = block_v
    o, s = pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale, bv=bv),
        grid=(V // bv, H, B),
        out_shape=(
            jax.ShapeDtypeStruct((B, H, V), v.dtype),
            jax.ShapeDtypeStruct((B, H, K, V), _F32),
        ),
        input_output_aliases={5: 1},
        interpret=interpret,
        name="kda_decode_step",
        **compiler_params(interpret, num_warps, 1),
    )(q, k, v, g, beta.reshape(B, H, 1), state)
    return o, s


_STATIC = ("scale", "interpret", "block_v", "num_warps")
_decode_jit = jax.jit(_decode, static_argnames=_STATIC)
_decode_jit_donate = jax.jit(_decode, static_argnames=_STATIC, donate_argnums=(5,))


def default_block_v(V: int) -> int:
    """64 columns per program (the fastest measured), or all of V if 64 doesn't divide it."""
    bv = min(V, 64)
    return bv if V % bv == 0 else V


def triton_kda_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
    donate_state: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One KDA decode step. Returns ``(o [B, H, V] in v.dtype, new_state fp32 [B, H, K, V])``.

    ``donate_state=True`` donates ``state`` (it must not be used afterwards) so the update is
    truly in place. Runs in interpret mode off GPU. ``block_v`` (default ``default_block_v(V)``)
    must divide V; on GPU K and block_v must be powers of two >= 16.
    """
    B, H, K = q.shape
    V = v.shape[-1]
    interpret = current_platform() != "gpu"
    bv = default_block_v(V) if block_v is None else int(block_v)
    if bv < 1 or V % bv:
        raise ValueError(f"block_v: expected a divisor of V={V}, got {bv}")
    if not interpret and not triton_takes(K, bv):
        raise ValueError(f"KDA decode on GPU needs K and block_v powers of two >= 16 (Triton), "
                         f"got K={K}, block_v={bv}")
    if state.dtype != _F32:
        raise ValueError(f"state: expected float32, got {state.dtype}")
    fn = _decode_jit_donate if donate_state else _decode_jit
    return fn(
        q, k, v, g, beta, state, scale=K**-0.5 if scale is None else float(scale),
        interpret=interpret, block_v=bv, num_warps=int(num_warps),
    )

"""KDA decode step as a Mosaic TPU Pallas kernel (tested on CPU via the TPU interpreter).

One grid program per (b*h, V tile). The fp32 state tile [K, bv] lives in VMEM and is updated
in place (``input_output_aliases``). All contractions over K are VPU multiply + sublane reductions
in fp32 (no MXU), so results are exact fp32 regardless of matmul precision defaults.

Per step (same conventions as ``reference.recurrent_kda_step``)::

    S <- exp(g)[:, None] * S;  r = v - S^T k;  S <- S + beta k r^T;  o = S^T (scale q)

Layout: q (pre-scaled), k, g are stacked into one fp32 [B*H, K, 3] column array so each block is
(K, 3) (K sublanes, full last dim) and broadcasts against the [K, bv] state without a transpose.
v is [B*H, 1, V] (block (1, bv)); beta is a whole [B*H] fp32 array in SMEM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.platform import current_platform

_F32 = jnp.float32


def default_interpret() -> bool | pltpu.InterpretParams:
    """Compile for TPU on TPU; elsewhere run in TPU interpret mode (the TPU simulator on CPU)."""
    return False if current_platform() == "tpu" else pltpu.InterpretParams()


def _kernel(qkg_ref, v_ref, beta_ref, s_ref, o_ref, so_ref):
    i = pl.program_id(0)
    qkg = qkg_ref[...]  # [K, 3] fp32
    q, k, g = qkg[:, 0:1], qkg[:, 1:2], qkg[:, 2:3]  # [K, 1] columns
    s = s_ref[...] * jnp.exp(g)  # decay key rows first
    err = v_ref[...].astype(_F32) - jnp.sum(k * s, axis=0, keepdims=True)  # [1, bv]
    s = s + (beta_ref[i] * k) * err
    so_ref[...] = s
    o_ref[...] = jnp.sum(q * s, axis=0, keepdims=True).astype(o_ref.dtype)


def default_block_v(V: int) -> int:
    """Full V up to 512; otherwise the largest of 512/256/128 dividing V (else full V)."""
    if V <= 512:
        return V
    for bv in (512, 256, 128):
        if V % bv == 0:
            return bv
    return V


@functools.partial(jax.jit, static_argnames=("scale", "block_v", "interpret"))
def _decode(q, k, v, g, beta, state, *, scale, block_v, interpret):
    B, H, K = q.shape
    V = v.shape[-1]
    BH = B * H
    qkg = jnp.stack([q.astype(_F32) * scale, k.astype(_F32), g.astype(_F32)], axis=-1).reshape(BH, K, 3)
    v3 = v.reshape(BH, 1, V)
    b1 = beta.astype(_F32).reshape(BH)
    s3 = state.astype(_F32).reshape(BH, K, V)
    bv = block_v
    grid = (BH, V // bv)
    o, s = pl.pallas_call(
        _kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, K, 3), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, 1, bv), lambda i, j: (i, 0, j)),
            pl.BlockSpec(memory_space=pltpu.SMEM),
            pl.BlockSpec((None, K, bv), lambda i, j: (i, 0, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, 1, bv), lambda i, j: (i, 0, j)),
            pl.BlockSpec((None, K, bv), lambda i, j: (i, 0, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((BH, 1, V), v.dtype), jax.ShapeDtypeStruct((BH, K, V), _F32)],
        input_output_aliases={3: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(qkg, v3, b1, s3)
    return o.reshape(B, H, V), s.reshape(B, H, K, V)


def tpu_kda_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float | None = None,
    block_v: int | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One KDA decode step on TPU: q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state fp32 [B, H, K, V].

    Returns ``(o [B, H, V] in v.dtype, new_state fp32 [B, H, K, V])``. ``interpret``: False (compile for
    TPU), True, or a ``pltpu.InterpretParams`` (TPU simulator on CPU); by default TPU interpret
    mode off TPU. ``block_v`` must divide V and be a multiple of 128 or equal V. Donate ``state``
    under an outer jit for a truly in-place update.
    """
    B, H, K = q.shape
    V = v.shape[-1]
    if k.shape != (B, H, K) or g.shape != (B, H, K) or v.shape[:2] != (B, H) or beta.shape != (B, H):
        raise ValueError(f"bad shapes q{q.shape} k{k.shape} v{v.shape} g{g.shape} beta{beta.shape}")
    if state.shape != (B, H, K, V):
        raise ValueError(f"state must be {(B, H, K, V)}; got {state.shape}")
    bv = default_block_v(V) if block_v is None else int(block_v)
    if V % bv or (bv != V and bv % 128):
        raise ValueError(f"block_v={bv} must divide V={V} and be a multiple of 128 (or equal V)")
    scale = K ** -0.5 if scale is None else float(scale)
    interpret = default_interpret() if interpret is None else interpret
    return _decode(q, k, v, g, beta, state, scale=scale, block_v=bv, interpret=interpret)

"""Analytic backward of the safe-gate chunked KDA as Pallas kernels (Triton lowering on GPU).

The same three passes as ``chunk_backward.py``, as ``pl.pallas_call``s (this file: the wrappers and
the entry point; kernel bodies in ``pallas_states.py``, ``pallas_bwd_value.py``,
``pallas_bwd_channels.py``):

1. ``stage_parts``, grid ``(B, H, N)``, parallel: recompute the chunk's A = (I + L)^{-1} and
   Aqk with the forward's pair and inverse kernels, then W, U, Qg, Kd and decay gl from A; or,
   when the forward kept A and Aqk (``intra=``, what ``chunk_kda``'s gradient does),
   ``stage_parts_saved``: only that last kernel.
2. ``stage_states`` / ``stage_dstates``, grid ``(S, H, V / BV)``: the forward state recurrence
   again (storing every chunk's input state ``h`` and ``v_new``), then the reverse one for ``dh``
   and ``dv_new``, with the state on chip; the reverse one's last value is the initial state's
   gradient.
3. ``stage_grads``, parallel over chunks: dq, dk, dv, dg, dbeta of every chunk: a chunk kernel
   for dv and the chunk's [C, C] sums dAqk and dL, then one program per (chunk, key-channel
   block) for that block's V-contracting sums and its key side on whole 64-row chunks
   (``pallas_bwd_channels.py``). Variants measured slower on the H200 and removed
   (benchmarks/RESULTS.md): the same key side in 16-row blocks (gradient pass 30.5 vs 27.5 ms
   at B4 T8192 H96), whole-chunk key sides over all 128 channels per program ("fused"/"split",
   2.2x), one kernel for both sides ("fused_blocked", 16x), one program per chunk for all the V
   sums, and the per-chunk "blocks" key side (key-channel sums through HBM).

Packed sequences (``cu_seqlens``) run on the forward's chunk-aligned layout
(``varlen_layout.py``); the two recurrences then loop over one sequence's chunk range per program,
from and into that sequence's state, and the per-chunk passes run unchanged.

Residuals are the inputs and, when given, the forward's A and Aqk; everything else is recomputed.
Intermediates are stored in the input dtype (bf16 in training, like fla's backward), states and
accumulation in fp32; fp32 inputs keep everything fp32 with IEEE matmuls (what the tests use).
Requires the safe gate, ``g >= -5`` (see ``chunk_math.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import C
from pallas_kernels.kda.intra_blocks import approx_math
from pallas_kernels.kda.pallas_bwd_channels import channel_grads_kernel
from pallas_kernels.kda.pallas_bwd_value import chunk_sums_kernel
from pallas_kernels.kda.pallas_intra import (
    chunk_inverses, default_pairs, intra_from_inverse, pair_matrices,
)
from pallas_kernels.kda.pallas_kda import (
    INVERSE_WARPS, PIPELINE_STAGES, compiler_params, matmul_dtypes,
)
from pallas_kernels.kda.pallas_states import dstates_kernel, state_pass
from pallas_kernels.kda.reference import host_offsets
from pallas_kernels.kda.varlen_layout import chunk_layout, from_aligned, to_aligned

_F32 = jnp.float32
_TUNING = ("interpret", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=("scale",) + _TUNING)
def stage_parts(q, k, v, g, beta, *, scale, interpret, num_warps, num_stages):
    """Pass 1: ``(A, W, U, Aqk, Qg, Kd, gl)`` of every chunk.

    The forward's pair and inverse kernels (``pallas_intra.pair_matrices`` with the forward's
    default pair kernel, ``chunk_inverses``), so A and Aqk are the forward's bit for bit; W, U,
    Qg, Kd, gl then come from A as in ``stage_parts_saved``, so the backward's gradients are the
    same bit for bit whether or not the forward kept A and Aqk. (With the Mosaic GPU pair kernel
    the forward forms its own Qg, Kd, gl in that kernel: equal to these to float rounding.)
    """
    ins = (q, k, v, g, beta)
    params = compiler_params(interpret, num_warps, num_stages)
    L, _, qg, _, aqk, _ = pair_matrices(
        ins, scale=scale, fused=False, lower_bound=0.0, interpret=interpret, params=params,
        pairs=default_pairs(q, k, v, g))
    A = chunk_inverses(L, qg.dtype, interpret=interpret,
                       params=compiler_params(interpret, INVERSE_WARPS, num_stages))
    W, U, qg, kd, gl = intra_from_inverse(A, ins, scale=scale, interpret=interpret, params=params)
    return A, W, U, aqk, qg, kd, gl


@functools.partial(jax.jit, static_argnames=("scale",) + _TUNING)
def stage_parts_saved(A, aqk, q, k, v, g, beta, *, scale, interpret, num_warps, num_stages):
    """Pass 1 when the forward kept ``A`` and ``Aqk`` (``pallas_chunk_kda(return_intra=True)``):
    the same ``(A, W, U, Aqk, Qg, Kd, gl)`` as ``stage_parts``, bit for bit, from its last
    kernel alone (``pallas_intra.intra_from_inverse``)."""
    W, U, qg, kd, gl = intra_from_inverse(
        A, (q, k, v, g, beta), scale=scale, interpret=interpret,
        params=compiler_params(interpret, num_warps, num_stages))
    return A, W, U, aqk, qg, kd, gl


@functools.partial(jax.jit, static_argnames=("block_v",) + _TUNING)
def stage_states(W, U, kd, gl, h0, chunk_offsets=None, *, block_v, interpret, num_warps,
                 num_stages):
    """Pass 2a: every chunk's input state ``h`` ``[B, N, H, K, V]`` and ``v_new = U - W h``
    ``[B, Tp, H, V]`` (formed here anyway; the value sums read it). ``chunk_offsets`` (int32
    ``[S + 1]``) marks a chunk-aligned packed batch (B == 1) of S sequences with states h0[s]."""
    mm_dtype, sd = matmul_dtypes(U)
    hs, vn, _ = state_pass(W, U, kd, gl, h0, chunk_offsets, block_v=block_v, mm_dtype=mm_dtype,
                           store_dtype=sd, interpret=interpret,
                           params=compiler_params(interpret, num_warps, num_stages))
    return hs, vn


@functools.partial(jax.jit, static_argnames=("block_v",) + _TUNING)
def stage_dstates(qg, W, aqk, kd, gl, do, dht, chunk_offsets=None, *, block_v, interpret,
                  num_warps, num_stages):
    """Pass 2b: ``(dh [B, N, H, K, V], dv_new [B, Tp, H, V], d initial_state)``."""
    B, Tp, H, K = W.shape
    V, n = do.shape[-1], Tp // C
    mm_dtype, sd = matmul_dtypes(do)
    sds = jax.ShapeDtypeStruct
    varlen = chunk_offsets is not None
    return pl.pallas_call(
        functools.partial(dstates_kernel, n_chunks=n, bv=block_v, mm_dtype=mm_dtype,
                          varlen=varlen),
        grid=(dht.shape[0], H, V // block_v),
        out_shape=(sds((B, n, H, K, V), sd), sds((B, Tp, H, V), sd), sds(dht.shape, _F32)),
        interpret=interpret, name="kda_bwd_dstates", **compiler_params(interpret, num_warps, num_stages),
    )(*((chunk_offsets,) if varlen else ()), qg, W, aqk, kd, gl, do, dht)


@functools.partial(jax.jit, static_argnames=("scale", "block_k") + _TUNING)
def stage_grads(q, k, v, g, beta, A, hs, dhs, do, dvn, vn, *, scale, block_k, interpret,
                num_warps, num_stages):
    """Pass 3: ``(dq, dk, dv, dg, dbeta)`` in the inputs' dtypes. A chunk kernel, grid
    ``(B, H, N)``, forms dv, the chunk's [C, C] sums dAqk and dL, and ``yu = A^T dv_new``
    (``pallas_bwd_value``); then ``pallas_bwd_channels``, grid ``(K / block_k, H, N, B)``, forms
    each block of ``block_k`` key channels' V-contracting sums and its key side, and the partial
    dbeta sums of the channel blocks are added here. The per-chunk "blocks" key side (the
    channel sums through HBM, then one program per chunk over all channels) was measured slower
    on the H200 and removed (benchmarks/RESULTS.md).
    """
    B, Tp, H, K = q.shape
    n = Tp // C
    mm_dtype, sd = matmul_dtypes(v)
    sds = jax.ShapeDtypeStruct
    params = compiler_params(interpret, num_warps, num_stages)
    cc = sds((B, Tp, H, C), _F32)
    dv, daqk, dl, dbeta_v, yu = pl.pallas_call(
        functools.partial(chunk_sums_kernel, mm_dtype=mm_dtype),
        grid=(B, H, n),
        out_shape=(sds(v.shape, v.dtype), cc, cc, sds(beta.shape, _F32), sds(v.shape, sd)),
        interpret=interpret, name="kda_bwd_grads_v_chunk", **params,
    )(A, beta, v, do, dvn, vn)
    dq, dk, dg, dbeta_k = pl.pallas_call(
        functools.partial(channel_grads_kernel, scale=scale, mm_dtype=mm_dtype, bk=block_k,
                          approx=approx_math(interpret, mm_dtype)),
        grid=(K // block_k, H, n, B),
        out_shape=(sds(q.shape, q.dtype), sds(k.shape, k.dtype), sds(g.shape, g.dtype),
                   sds((B, K // block_k, Tp, H), _F32)),
        interpret=interpret, name="kda_bwd_grads_channels", **params,
    )(q, k, g, beta, hs, dhs, do, vn, yu, dl, daqk)
    return dq, dk, dv, dg, (dbeta_v + jnp.sum(dbeta_k, axis=1)).astype(beta.dtype)


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_v", "states_warps", "grads_block_k", "grads_warps") + _TUNING)
def _bwd(q, k, v, g, beta, h0, do, dht, chunk_offsets, intra, *, scale, block_v, states_warps,
         grads_block_k, grads_warps, **tuning):
    if intra is None:
        A, W, U, aqk, qg, kd, gl = stage_parts(q, k, v, g, beta, scale=scale, **tuning)
    else:
        A, W, U, aqk, qg, kd, gl = stage_parts_saved(*intra, q, k, v, g, beta, scale=scale,
                                                     **tuning)
    states_tuning = {**tuning, "num_warps": states_warps}
    hs, vn = stage_states(W, U, kd, gl, h0, chunk_offsets, block_v=block_v, **states_tuning)
    dhs, dvn, ds0 = stage_dstates(qg, W, aqk, kd, gl, do, dht, chunk_offsets, block_v=block_v,
                                  **states_tuning)
    out = stage_grads(q, k, v, g, beta, A, hs, dhs, do, dvn, vn, scale=scale,
                      block_k=grads_block_k, **{**tuning, "num_warps": grads_warps})
    return (*out, ds0)


FEW_SEQUENCE_HEADS_STATES = 128  # below this many (sequence, head) pairs, narrow state blocks


def default_states(sequence_heads: int) -> tuple[int, int]:
    """``(block_v, num_warps)`` of the two state recurrences. One program per (sequence, head,
    V block) walks all chunks, so with few sequence-heads narrow blocks buy parallelism: at B1
    T32768 H16 the two recurrences took 0.95 + 1.23 ms at block_v 16 and 4 warps, against 1.05 +
    1.42 at 16 and 8 warps and 1.03 + 1.34 at 32 and 4. With many, whole 128-wide blocks at 8
    warps: at B4 T8192 H96 1.98 + 2.34 ms against 2.77 + 3.27 at 64 (benchmarks/RESULTS.md,
    seventh run)."""
    return (16, 4) if sequence_heads < FEW_SEQUENCE_HEADS_STATES else (128, 8)


def pallas_chunk_kda_bwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array,
    do: jax.Array,
    dht: jax.Array,
    *,
    scale: float,
    cu_seqlens: object | None = None,
    interpret: bool | None = None,
    block_v: int | None = None,
    states_warps: int | None = None,
    grads_block_k: int = 32,
    num_warps: int = 8,
    num_stages: int = PIPELINE_STAGES,
    grads_warps: int = 4,
    intra: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, ...]:
    """Gradients of ``pallas_chunk_kda``'s ``(o, final_state)`` (safe gate, fla conventions).

    q, k, g [B, T, H, K]; v, do [B, T, H, V]; beta [B, T, H]; initial_state, dht fp32
    [B, H, K, V] (with ``cu_seqlens``, host offsets [N + 1] of packed sequences and B == 1:
    [N, H, K, V]). Returns ``(dq, dk, dv, dg, dbeta, d initial_state)`` in the inputs' dtypes
    (the state gradient fp32). ``interpret`` defaults to True off GPU. ``block_v`` and
    ``states_warps``: V columns per program and num_warps of the two state recurrences (default
    ``default_states``); ``grads_block_k``: key channels per program of the gradient pass's key
    side (see ``stage_grads``; the whole K where it does not divide K). ``num_warps`` (the
    recompute), ``grads_warps`` (the gradient pass) and ``num_stages`` (all; the state passes'
    chunk loops are the ones it pipelines): the fastest measured on an H200 at B4 T8192 H96 and
    B1 T32768 H16 (benchmarks/RESULTS.md): the whole backward 36.0 / 7.8 ms (the two shapes,
    before the seventh run) with 2 stages against 37.5 / 8.9 with 1; the gradient pass 22.7 / 3.8
    ms at grads_warps 4 and grads_block_k 32, against 30.6 / 5.3 at 16 channels, 37.5 / 6.2 at 8
    warps and 34.0 / 5.7 at 64 channels and 8 warps. ``intra``: the ``(X, Aqk)`` that
    ``pallas_chunk_kda(..., return_intra=True)`` returned for these inputs; the backward then
    recomputes the rest of the intra stage in one kernel (2.8 ms at B4 T8192 H96) instead of
    all of it (6.1 ms): 29.7 against 33.3 ms for the whole backward.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not interpret:
        bad = [f"{n}={d}" for n, d in (("K", K), ("V", V)) if d < 16 or d & (d - 1)]
        if bad:
            raise ValueError(
                f"pallas KDA backward on GPU needs K and V powers of two >= 16 (Triton), got {bad}")
    n_states = B
    if cu_seqlens is not None:  # packed sequences: run on the chunk-aligned layout
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B == 1, got q shape {q.shape}")
        layout = chunk_layout(host_offsets(cu_seqlens, T), C)
        n_states = layout.chunk_offsets.size - 1
    default_block_v, default_warps = default_states(n_states * H)
    states_warps = default_warps if states_warps is None else states_warps
    if block_v is None:  # a default that does not divide V falls back to all of V
        block_v = default_block_v if V % default_block_v == 0 else V
    block_v = min(block_v, V)
    if V % block_v:
        raise ValueError(f"block_v: V={V} is not a multiple of block_v={block_v}")
    if grads_block_k < 1:
        raise ValueError(f"grads_block_k: expected a positive channel count, got {grads_block_k}")
    grads_block_k = grads_block_k if K % grads_block_k == 0 else K
    if not interpret and (grads_block_k < 16 or grads_block_k & (grads_block_k - 1)):
        raise ValueError(
            f"grads_block_k: expected a power of two >= 16 on GPU (Triton), got {grads_block_k}")
    if cu_seqlens is not None:
        q, k, v, g, beta, do = (to_aligned(x, layout) for x in (q, k, v, g, beta, do))
        offsets = jnp.asarray(layout.chunk_offsets)
    else:
        Tp = -(-T // C) * C  # identity steps (k = v = beta = g = 0), zero output cotangent
        if Tp != T:
            pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
            q, k, v, g, beta, do = (pad(x) for x in (q, k, v, g, beta, do))
        offsets = None
    for name, x in (("initial_state", initial_state), ("dht", dht)):
        if tuple(x.shape) != (n_states, H, K, V):
            raise ValueError(f"{name}: expected shape {(n_states, H, K, V)}, got {tuple(x.shape)}")
    if intra is not None:
        expected = (q.shape[0], q.shape[1], H, C)
        for name, x in zip(("intra[0] (X)", "intra[1] (Aqk)"), intra):
            if tuple(x.shape) != expected:
                raise ValueError(
                    f"{name}: expected shape {expected} [B, T padded to chunks (or the packed "
                    f"chunk-aligned layout), H, {C}] as pallas_chunk_kda(return_intra=True) "
                    f"returns it, got {tuple(x.shape)}")
    dq, dk, dv, dg, db, ds0 = _bwd(
        q, k, v, g, beta, initial_state.astype(_F32), do.astype(v.dtype), dht.astype(_F32),
        offsets, intra, scale=float(scale), interpret=bool(interpret), num_warps=num_warps,
        num_stages=num_stages, grads_warps=grads_warps, block_v=block_v, states_warps=states_warps,
        grads_block_k=grads_block_k,
    )
    out = (dq, dk, dv, dg, db)
    if cu_seqlens is not None:
        out = tuple(from_aligned(x, layout) for x in out)
    elif dq.shape[1] != T:
        out = tuple(x[:, :T] for x in out)
    return (*out, ds0)


__all__ = ["default_states", "pallas_chunk_kda_bwd"]

"""The KDA backward's Triton passes after the intra recompute: the two state recurrences and the
gradient pass (math: the pure-JAX oracle ``tests/pallas_kernels/kda/chunk_backward.py``).

2. ``stage_states`` / ``stage_dstates``, grid ``(S, H, V / BV)``: the forward state recurrence
   again (storing every chunk's input state ``h`` and ``v_new``), then the reverse one for ``dh``
   and ``dv_new``, with the state on chip; the reverse one's last value is the initial state's
   gradient (kernels: ``states.py``).
3. ``stage_grads``, parallel over chunks: dq, dk, dv, dg, dbeta of every chunk: a chunk kernel
   for dv and the chunk's [C, C] sums dAqk and dL (``bwd_value.py``), then one program per
   (chunk, key-channel block) for that block's V-contracting sums and its key side on whole
   64-row chunks (``bwd_channels.py``). Other splits of the key side (16-row blocks, all 128
   channels per program, one kernel for both sides, the channel sums through HBM) were measured
   slower and removed (benchmarks/RESULTS.md).

``chunk_offsets`` (int32 ``[S + 1]``) marks a chunk-aligned packed batch (B == 1) of S sequences:
the recurrences then loop over one sequence's chunk range per program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import C
from pallas_kernels.kda.triton.bwd_channels import channel_grads_kernel
from pallas_kernels.kda.triton.bwd_value import chunk_sums_kernel
from pallas_kernels.kda.triton.intra_blocks import approx_math, compiler_params, matmul_dtypes
from pallas_kernels.kda.triton.states import dstates_kernel, state_pass

_F32 = jnp.float32
TUNING = ("interpret", "num_warps", "num_stages")  # every pass's static launch arguments


@functools.partial(jax.jit, static_argnames=("block_v",) + TUNING)
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


@functools.partial(jax.jit, static_argnames=("block_v",) + TUNING)
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
        interpret=interpret, name="kda_bwd_dstates",
        **compiler_params(interpret, num_warps, num_stages),
    )(*((chunk_offsets,) if varlen else ()), qg, W, aqk, kd, gl, do, dht)


@functools.partial(jax.jit, static_argnames=("scale", "block_k") + TUNING)
def stage_grads(q, k, v, g, beta, A, hs, dhs, do, dvn, vn, *, scale, block_k, interpret,
                num_warps, num_stages):
    """Pass 3: ``(dq, dk, dv, dg, dbeta)`` in the inputs' dtypes. A chunk kernel, grid
    ``(B, H, N)``, forms dv, the chunk's [C, C] sums dAqk and dL, and ``yu = A^T dv_new``
    (``bwd_value``); then ``bwd_channels``, grid ``(K / block_k, H, N, B)``, forms
    each block of ``block_k`` key channels' V-contracting sums and its key side, and the partial
    dbeta sums of the channel blocks are added here.
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

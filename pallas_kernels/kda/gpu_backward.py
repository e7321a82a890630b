"""Analytic backward of the GPU chunked KDA ("pallas_gpu"), safe gate, pre-activated inputs.

Three passes (the pure-JAX oracle ``tests/pallas_kernels/kda/chunk_backward.py`` runs the same):

1. ``stage_parts``, grid ``(B, H, N)``, parallel: recompute the chunk's A = (I + L)^{-1} and Aqk
   with the forward's pair kernel (Mosaic GPU where it fits) and inverse kernel, then W, U, Qg,
   Kd and decay gl from A; or, when the forward kept A and Aqk (``intra=``, what the op's
   gradient passes), ``stage_parts_saved``: only that last kernel.
2. and 3. the Triton state recurrences and gradient pass (``triton/backward.py``).

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

from pallas_kernels.kda.chunk_math import C
from pallas_kernels.kda.gpu_config import INVERSE_WARPS, ChunkProblem, GpuBackwardConfig, interpret_mode
from pallas_kernels.kda.gpu_pipeline import pair_matrices
from pallas_kernels.kda.reference import host_offsets
from pallas_kernels.kda.triton.backward import TUNING, stage_dstates, stage_grads, stage_states
from pallas_kernels.kda.triton.intra import chunk_inverses, intra_from_inverse
from pallas_kernels.kda.triton.intra_blocks import compiler_params
from pallas_kernels.kda.varlen_layout import chunk_layout, from_aligned, to_aligned

_F32 = jnp.float32


@functools.partial(jax.jit, static_argnames=("scale",) + TUNING)
def stage_parts(q, k, v, g, beta, *, scale, interpret, num_warps, num_stages):
    """Pass 1: ``(A, W, U, Aqk, Qg, Kd, gl)`` of every chunk.

    The forward's pair and inverse kernels (``pair_matrices`` with the pair kernel the forward's
    config picks, ``chunk_inverses``), so A and Aqk are the forward's bit for bit; W, U, Qg, Kd,
    gl then come from A as in ``stage_parts_saved``, so the backward's gradients are the same bit
    for bit whether or not the forward kept A and Aqk. (With the Mosaic GPU pair kernel the
    forward forms its own Qg, Kd, gl in that kernel: equal to these to float rounding.)
    """
    ins = (q, k, v, g, beta)
    params = compiler_params(interpret, num_warps, num_stages)
    pairs = "mosaic_gpu" if ChunkProblem.of(q, k, v, g, 1, False).mosaic_gpu_pairs_fit else "triton"
    L, _, qg, _, aqk, _ = pair_matrices(ins, scale=scale, fused=False, lower_bound=0.0,
                                        interpret=interpret, params=params, pairs=pairs)
    A = chunk_inverses(L, qg.dtype, interpret=interpret,
                       params=compiler_params(interpret, INVERSE_WARPS, num_stages))
    W, U, qg, kd, gl = intra_from_inverse(A, ins, scale=scale, interpret=interpret, params=params)
    return A, W, U, aqk, qg, kd, gl


@functools.partial(jax.jit, static_argnames=("scale",) + TUNING)
def stage_parts_saved(A, aqk, q, k, v, g, beta, *, scale, interpret, num_warps, num_stages):
    """Pass 1 when the forward kept ``A`` and ``Aqk`` (``gpu_chunk_kda(return_intra=True)``): the
    same ``(A, W, U, Aqk, Qg, Kd, gl)`` as ``stage_parts``, bit for bit, from its last kernel
    alone (``triton.intra.intra_from_inverse``)."""
    W, U, qg, kd, gl = intra_from_inverse(
        A, (q, k, v, g, beta), scale=scale, interpret=interpret,
        params=compiler_params(interpret, num_warps, num_stages))
    return A, W, U, aqk, qg, kd, gl


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def _bwd(q, k, v, g, beta, h0, do, dht, chunk_offsets, intra, *, scale, config: GpuBackwardConfig,
         interpret):
    tuning = dict(interpret=interpret, num_warps=config.num_warps, num_stages=config.num_stages)
    if intra is None:
        A, W, U, aqk, qg, kd, gl = stage_parts(q, k, v, g, beta, scale=scale, **tuning)
    else:
        A, W, U, aqk, qg, kd, gl = stage_parts_saved(*intra, q, k, v, g, beta, scale=scale,
                                                     **tuning)
    states = {**tuning, "num_warps": config.states_warps}
    hs, vn = stage_states(W, U, kd, gl, h0, chunk_offsets, block_v=config.block_v, **states)
    dhs, dvn, ds0 = stage_dstates(qg, W, aqk, kd, gl, do, dht, chunk_offsets,
                                  block_v=config.block_v, **states)
    out = stage_grads(q, k, v, g, beta, A, hs, dhs, do, dvn, vn, scale=scale,
                      block_k=config.grads_block_k, **{**tuning, "num_warps": config.grads_warps})
    return (*out, ds0)


def gpu_chunk_kda_bwd(
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
    config: GpuBackwardConfig | None = None,
    intra: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, ...]:
    """Gradients of ``gpu_chunk_kda``'s ``(o, final_state)`` (safe gate, fla conventions).

    q, k, g [B, T, H, K]; v, do [B, T, H, V]; beta [B, T, H]; initial_state, dht fp32
    [B, H, K, V] (with ``cu_seqlens``, host offsets [N + 1] of packed sequences and B == 1:
    [N, H, K, V]). Returns ``(dq, dk, dv, dg, dbeta, d initial_state)`` in the inputs' dtypes
    (the state gradient fp32). Runs in interpret mode off GPU. ``config``: block sizes and warps
    of the passes, by default ``GpuBackwardConfig.for_problem``. ``intra``: the ``(X, Aqk)`` that
    ``gpu_chunk_kda(..., return_intra=True)`` returned for these inputs; the backward then
    recomputes the rest of the intra stage in one kernel instead of all of it.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    interpret = interpret_mode(K, V, "KDA backward")
    n_states = B
    if cu_seqlens is not None:  # packed sequences: run on the chunk-aligned layout
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B == 1, got q shape {q.shape}")
        layout = chunk_layout(host_offsets(cu_seqlens, T), C)
        n_states = layout.chunk_offsets.size - 1
    if config is None:
        config = GpuBackwardConfig.for_problem(sequence_heads=n_states * H, K=K, V=V)
    config = config.checked(K, V, triton=not interpret)
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
                    f"chunk-aligned layout), H, {C}] as gpu_chunk_kda(return_intra=True) "
                    f"returns it, got {tuple(x.shape)}")
    dq, dk, dv, dg, db, ds0 = _bwd(
        q, k, v, g, beta, initial_state.astype(_F32), do.astype(v.dtype), dht.astype(_F32),
        offsets, intra, scale=float(scale), config=config, interpret=interpret)
    out = (dq, dk, dv, dg, db)
    if cu_seqlens is not None:
        out = tuple(from_aligned(x, layout) for x in out)
    elif dq.shape[1] != T:
        out = tuple(x[:, :T] for x in out)
    return (*out, ds0)

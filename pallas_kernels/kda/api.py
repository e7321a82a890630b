"""Public KDA entry points: input validation, then the implementation ``dispatch.py``'s tables
and policy choose.

Conventions follow fla's ``chunk_kda`` (see ``reference.py``). ``implementation`` names a table
entry ("xla", "pallas_gpu", "mosaic_tpu") or is None for the policy: "pallas_gpu" on GPU where it
supports the call, "xla" elsewhere. Every path is differentiable; the custom VJPs live in
``differentiable.py``.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import choose
from pallas_kernels.kda.differentiable import Gate
from pallas_kernels.kda.dispatch import CHUNK_IMPLEMENTATIONS, DECODE_IMPLEMENTATIONS
from pallas_kernels.kda.reference import host_offsets


def _expect_rank(name: str, x: jax.Array, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {tuple(x.shape)}")


def _expect_shape(name: str, x: jax.Array, expected: tuple[int, ...], layout: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected} {layout}, got {tuple(x.shape)}")


def _expect_state(name: str, x: jax.Array, expected: tuple[int, ...], layout: str) -> None:
    _expect_shape(name, x, expected, layout)
    if x.dtype != jnp.float32:
        raise ValueError(f"{name}: expected dtype float32 (states are kept in fp32), got {x.dtype}")


def _check_chunk_inputs(q, k, v, g, beta, initial_state, cu_seqlens, names, segment_ids=None) -> None:
    """Shapes of the chunk ops' inputs (``names``: how this entry calls q, k, g, beta)."""
    nq, nk, ng, nb = names
    _expect_rank(nq, q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    _expect_shape(nk, k, (B, T, H, K), f"[B, T, H, K] like {nq}")
    _expect_rank("v", v, 4, "[B, T, H, V]")
    V = v.shape[3]
    _expect_shape("v", v, (B, T, H, V), f"[B, T, H, V] matching {nq}'s B, T, H")
    _expect_shape(ng, g, (B, T, H, K), f"[B, T, H, K] like {nq}")
    _expect_shape(nb, beta, (B, T, H), "[B, T, H]")
    n_states = B
    if segment_ids is not None:
        _expect_shape("segment_ids", segment_ids, (B, T), f"[B, T] matching {nq}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids: expected an integer array, got {segment_ids.dtype}")
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens and segment_ids: give one way of packing sequences, not both")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B == 1, got {nq} shape {q.shape}")
        n_states = host_offsets(cu_seqlens, T).size - 1
    if initial_state is not None:
        layout = "[B, H, K, V]" if cu_seqlens is None else "[N, H, K, V], N = len(cu_seqlens) - 1"
        _expect_state("initial_state", initial_state, (n_states, H, K, V), layout)


def _run_chunk(q, k, v, g, beta, gate, *, scale, initial_state, output_final_state, cu_seqlens,
               lower_bound, implementation, op, segment_ids=None):
    K, V = q.shape[3], v.shape[3]
    impl = choose(op, CHUNK_IMPLEMENTATIONS, implementation, lower_bound=lower_bound, K=K, V=V,
                  segmented=segment_ids is not None)
    extra = {} if segment_ids is None else {"segment_ids": segment_ids}
    o, state = impl.run(q, k, v, g, beta, gate, scale=K**-0.5 if scale is None else scale,
                        initial_state=initial_state, cu_seqlens=cu_seqlens, **extra)
    return o, (state if output_final_state else None)


def chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: object | None = None,
    lower_bound: float | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Chunked KDA over a sequence (prefill / training) on pre-activated inputs.

    q, k [B, T, H, K] L2-normalised; v [B, T, H, V]; g [B, T, H, K] log-decay <= 0;
    beta [B, T, H]; initial_state fp32 [B, H, K, V] (or [N, H, K, V] with ``cu_seqlens``,
    host int offsets [N + 1] of packed sequences, B == 1); scale defaults to K**-0.5.
    Returns ``(o [B, T, H, V] in v.dtype, final state fp32 or None)``.
    ``lower_bound`` (K3: -5.0) declares ``g >= lower_bound`` everywhere (the safe gate); the chunk
    kernels need it. It is not checked against the traced ``g``; a violating gate can overflow the
    kernels' midpoint factorisation. Under ``jax.grad`` "pallas_gpu" keeps, besides the inputs,
    each chunk's ``(I + L)^{-1}`` and ``Aqk`` (2 x 64 values per token and head in the inputs'
    dtype) for its backward.
    """
    _check_chunk_inputs(q, k, v, g, beta, initial_state, cu_seqlens, ("q", "k", "g", "beta"))
    return _run_chunk(q, k, v, g, beta, None, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      lower_bound=lower_bound, implementation=implementation, op="chunk_kda")


def chunk_kda_fused(
    q_raw: jax.Array,
    k_raw: jax.Array,
    v: jax.Array,
    g_raw: jax.Array,
    beta_logits: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    *,
    lower_bound: float,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: object | None = None,
    segment_ids: jax.Array | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Chunked KDA on K3's raw inputs, activations included (``reference.activate``): q, k
    L2-normalised (``x * rsqrt(sum x^2 + 1e-6)`` in fp32), ``g = lower_bound * sigmoid(
    exp(A_log[h]) * (g_raw + dt_bias))`` and ``beta = sigmoid(beta_logits)`` in fp32, then KDA.

    q_raw, k_raw, g_raw [B, T, H, K]; v [B, T, H, V]; beta_logits [B, T, H]; A_log [H] (or K3's
    zero-padded [>= H]); dt_bias [H * K]; the rest as ``chunk_kda``, whose safe gate holds by
    construction (``g`` in ``(lower_bound, 0)``). A gate or beta logit of -inf makes its step an
    identity (g = beta = 0 exactly, zero gradients), how a caller writes padding. Gradients for
    every input, A_log and dt_bias included. "pallas_gpu" runs the activations inside its forward
    kernel and recomputes them in XLA for its backward.

    ``segment_ids`` int [B, T] (may be traced; packed documents in a row): the state resets
    wherever the id changes along a row, so each contiguous stretch of equal ids runs as if alone.
    Only "xla" runs it (the policy picks it); the final state is each row's last stretch's.
    """
    names = ("q_raw", "k_raw", "g_raw", "beta_logits")
    _check_chunk_inputs(q_raw, k_raw, v, g_raw, beta_logits, initial_state, cu_seqlens, names,
                        segment_ids)
    H, K = q_raw.shape[2], q_raw.shape[3]
    _expect_rank("A_log", A_log, 1, f"[H] (or zero-padded [>= H]), H = {H}")
    if A_log.shape[0] < H:
        raise ValueError(f"A_log: expected at least H = {H} entries, got shape {tuple(A_log.shape)}")
    _expect_shape("dt_bias", dt_bias, (H * K,), "[H * K]")
    if not isinstance(lower_bound, numbers.Real) or not lower_bound < 0:
        raise ValueError(f"lower_bound: expected a negative number, got {lower_bound!r}")
    return _run_chunk(q_raw, k_raw, v, g_raw, beta_logits, Gate(A_log, dt_bias, float(lower_bound)),
                      scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      lower_bound=float(lower_bound), implementation=implementation,
                      op="chunk_kda_fused", segment_ids=segment_ids)


def kda_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One recurrent decode step: q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state fp32.

    Returns ``(o [B, H, V] in v.dtype, new_state fp32 [B, H, K, V])``. "pallas_gpu" streams the
    state once (``triton/decode.py``); "mosaic_tpu" is ``mosaic_tpu/decode.py``. The state is not
    donated here: inside a jit that donates the state XLA updates it in place.
    """
    _expect_rank("q", q, 3, "[B, H, K]")
    B, H, K = q.shape
    _expect_shape("k", k, (B, H, K), "[B, H, K] like q")
    _expect_rank("v", v, 3, "[B, H, V]")
    V = v.shape[2]
    _expect_shape("v", v, (B, H, V), "[B, H, V] matching q's B, H")
    _expect_shape("g", g, (B, H, K), "[B, H, K] like q")
    _expect_shape("beta", beta, (B, H), "[B, H]")
    _expect_state("state", state, (B, H, K, V), "[B, H, K, V]")
    impl = choose("kda_decode", DECODE_IMPLEMENTATIONS, implementation, K=K, V=V)
    return impl.run(q, k, v, g, beta, state, scale=scale)

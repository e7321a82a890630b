"""Pure-JAX fp32 references for KDA (Kimi Delta Attention).

These are the oracles that the Pallas kernels are tested against, so they favour
exactness over speed: every value is float32 and every contraction asks for
``Precision.HIGHEST`` (otherwise GPUs silently use TF32). Conventions follow fla's
``chunk_kda`` with a pre-activated gate: ``q, k [B, T, H, K]`` (already
L2-normalised), ``v [B, T, H, V]``, ``g [B, T, H, K]`` log-decay (<= 0),
``beta [B, T, H]`` and a K-first state ``[B, H, K, V]``.

Per token (kda.md section 1.1)::

    S <- diag(exp(g_t)) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale q_t)

``activate`` gives those inputs from K3's raw ones (what ``api.chunk_kda_fused`` takes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.linalg import solve_triangular

_HI = lax.Precision.HIGHEST
_F32 = jnp.float32
L2_NORM_EPS = 1e-6  # q, k L2 norm: x * rsqrt(sum x^2 + eps), as K3's release


def l2_normalize(x: jax.Array) -> jax.Array:
    """``x * rsqrt(sum x^2 + eps)`` over the last axis, in fp32 (a zero row stays zero)."""
    x = x.astype(_F32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_NORM_EPS)


def activate(
    q_raw: jax.Array,
    k_raw: jax.Array,
    g_raw: jax.Array,
    beta_logits: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    *,
    lower_bound: float,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """K3's input activations: ``(l2(q_raw), l2(k_raw), g, sigmoid(beta_logits))`` with
    ``g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias))``. The norms are taken in fp32
    and rounded to the raw inputs' dtype (as the reference's in-kernel L2 norm stores them); g and
    beta stay fp32.

    q_raw, k_raw, g_raw [..., H, K]; beta_logits [..., H]; A_log [H] (or K3's zero-padded
    [>= H], first H used); dt_bias [H * K]. A gate or beta logit of -inf (how a caller marks a
    step as an identity) gives exactly 0, with zero, never NaN, gradients for every input: the
    -inf is replaced before ``exp(A_log)`` multiplies it (the product's derivative would be
    ``0 * inf``).
    """
    H, K = q_raw.shape[-2:]
    z = g_raw.astype(_F32) + dt_bias.astype(_F32).reshape(H, K)
    off = z == -jnp.inf
    a = jnp.exp(A_log.reshape(-1)[:H].astype(_F32))[:, None]  # [H, 1]
    gate = lower_bound * jax.nn.sigmoid(a * jnp.where(off, 0.0, z))
    g = jnp.where(off, 0.0, gate)
    beta = jax.nn.sigmoid(beta_logits.astype(_F32))
    return l2_normalize(q_raw).astype(q_raw.dtype), l2_normalize(k_raw).astype(k_raw.dtype), g, beta


def _default_scale(q: jax.Array, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _step(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One fp32 recurrence step on [..., K] / [..., V] rows; ``q`` is already scaled."""
    state = state * jnp.exp(g)[..., None]  # decay key rows first: the delta uses the decayed S
    err = v - jnp.einsum("...k,...kv->...v", k, state, precision=_HI)
    state = state + (beta[..., None] * k)[..., :, None] * err[..., None, :]
    o = jnp.einsum("...k,...kv->...v", q, state, precision=_HI)  # read after the write
    return state, o


def recurrent_kda_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One decode step: q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state fp32 [B, H, K, V].

    Returns ``(o [B, H, V] in v.dtype, new_state fp32 [B, H, K, V])``.
    """
    scale = _default_scale(q, scale)
    new_state, o = _step(
        state.astype(_F32),
        q.astype(_F32) * scale,
        k.astype(_F32),
        v.astype(_F32),
        g.astype(_F32),
        beta.astype(_F32),
    )
    return o.astype(v.dtype), new_state


def naive_recurrent_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token ``lax.scan`` of the recurrence; the ground truth for everything else.

    Returns ``(o [B, T, H, V] in v.dtype, final_state fp32 [B, H, K, V])``.
    """
    B, _, H, K = q.shape
    V = v.shape[-1]
    scale = _default_scale(q, scale)
    if initial_state is None:
        initial_state = jnp.zeros((B, H, K, V), _F32)
    xs = (q.astype(_F32) * scale, k, v, g, beta)
    xs = tuple(jnp.moveaxis(x.astype(_F32), 1, 0) for x in xs)  # time-major [T, B, H, ...]
    state, o = lax.scan(lambda s, x: _step(s, *x), initial_state.astype(_F32), xs)
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), state


def _chunk_step(
    state: jax.Array,
    qs: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    runs: jax.Array | None = None,
    run_in: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Advance the state over one chunk (kda.md section 2.1).

    state [B, H, K, V]; qs (scaled q), k, g [B, H, C, K]; v [B, H, C, V]; beta [B, H, C, 1].
    ``runs`` int32 [B, C] (optional): the run (packed document) of each token, ``run_in`` [B] the
    run the incoming state belongs to. Tokens interact only within their run (the in-chunk
    matrices are masked to per-run blocks, so ``(I + L)^{-1}`` stays block-diagonal), only tokens of
    ``run_in`` read the incoming state, and the outgoing state holds the chunk's last run only.
    """
    C, V = v.shape[-2:]
    G = jnp.cumsum(g, axis=-2)  # in-chunk cumulative log-decay, non-increasing
    causal = jnp.tril(jnp.ones((C, C), bool))  # r >= i
    strict = jnp.tril(jnp.ones((C, C), bool), -1)  # r > i
    reads_state = keeps_state = 1.0
    last_run = 1.0
    if runs is not None:
        same = (runs[:, :, None] == runs[:, None, :])[:, None]  # [B, 1, C, C]
        causal, strict = causal & same, strict & same
        reads_state = (runs == run_in[:, None])[:, None, :, None].astype(_F32)  # [B, 1, C, 1]
        keeps_state = (runs[:, -1] == run_in)[:, None, None, None].astype(_F32)  # [B, 1, 1, 1]
        last_run = (runs == runs[:, -1:])[:, None, :, None].astype(_F32)
    # Mask before exp: the upper triangle has G_r - G_i > 0 and would overflow (inf * 0 = NaN).
    D = G[..., :, None, :] - G[..., None, :, :]  # [B, H, C, C, K]
    E = jnp.exp(jnp.where(causal[..., None], D, -jnp.inf))
    # Elementwise products + sums keep the pairwise forms exact fp32 (no matmul precision).
    Aqk = jnp.sum(qs[..., :, None, :] * k[..., None, :, :] * E, axis=-1)  # [B, H, C, C]
    Lkk = jnp.sum(k[..., :, None, :] * k[..., None, :, :] * E, axis=-1)
    L = jnp.where(strict, beta * Lkk, 0.0)
    # (I + L)^{-1} [beta*v, beta*k*exp(G)] by forward substitution: U, W of the UT transform.
    rhs = beta * jnp.concatenate([v, k * jnp.exp(G)], axis=-1)  # [B, H, C, V + K]
    UW = solve_triangular(jnp.eye(C, dtype=_F32) + L, rhs, lower=True, unit_diagonal=True)
    U, W = UW[..., :V], UW[..., V:]

    mm = functools.partial(jnp.einsum, precision=_HI)
    v_new = U - reads_state * mm("...ck,...kv->...cv", W, state)  # pseudo-values [B, H, C, V]
    o = reads_state * mm("...ck,...kv->...cv", qs * jnp.exp(G), state) + mm("...ci,...iv->...cv", Aqk, v_new)
    G_last = G[..., -1:, :]  # [B, H, 1, K]
    k_decayed = last_run * k * jnp.exp(G_last - G)  # decay to chunk end; exponent <= 0
    state = keeps_state * jnp.exp(G_last[..., 0, :])[..., None] * state
    state = state + mm("...ck,...cv->...kv", k_decayed, v_new)
    return state, o


@functools.partial(jax.jit, static_argnames="chunk_size")
def _chunked_batched(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    scale: float,
    initial_state: jax.Array,
    chunk_size: int,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    B, T, H, _ = q.shape
    C = chunk_size
    n = -(-T // C)

    def to_chunks(x: jax.Array) -> jax.Array:  # [B, T, H, D] -> [N, B, H, C, D]
        # Zero padding is an identity step: k = v = beta = 0 writes nothing, g = 0 keeps S.
        x = jnp.pad(x.astype(_F32), [(0, 0), (0, n * C - T), (0, 0), (0, 0)])
        return x.reshape(B, n, C, H, x.shape[-1]).transpose(1, 0, 3, 2, 4)

    xs = tuple(map(to_chunks, (q.astype(_F32) * scale, k, v, g, beta[..., None])))
    # Rematerialise each chunk in the backward pass so only the per-chunk input state is
    # kept, not the [B, H, C, C, K] pairwise-decay tensor of every chunk.
    if segment_ids is None:
        step = jax.checkpoint(lambda s, x: _chunk_step(s, *x))
        state, o = lax.scan(step, initial_state.astype(_F32), xs)  # o [N, B, H, C, V]
    else:
        runs = segment_runs(segment_ids)
        runs = jnp.pad(runs, [(0, 0), (0, n * C - T)], mode="edge").reshape(B, n, C).transpose(1, 0, 2)

        def seg_step(carry, x):
            s, run_in = carry
            *x, r = x
            s, o = _chunk_step(s, *x, runs=r, run_in=run_in)
            return (s, r[:, -1]), o

        carry = (initial_state.astype(_F32), runs[0, :, 0])  # the initial state is the first run's
        (state, _), o = lax.scan(jax.checkpoint(seg_step), carry, (*xs, runs))
    o = o.transpose(1, 0, 3, 2, 4).reshape(B, n * C, H, v.shape[-1])[:, :T]
    return o, state


def segment_runs(segment_ids: jax.Array) -> jax.Array:
    """int32 [B, T] run index of each token: 0 for the first run, +1 at every change of id, so
    tokens share a run exactly when they belong to one contiguous stretch of equal ids."""
    change = jnp.concatenate(
        [jnp.zeros_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jnp.cumsum(change, axis=1, dtype=jnp.int32)


def host_offsets(cu_seqlens: object, total_len: int) -> np.ndarray:
    """``cu_seqlens`` as a validated host int64 array (shapes depend on it: must be concrete)."""
    try:
        offsets = np.asarray(cu_seqlens)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(
            "cu_seqlens must be concrete host values (e.g. a numpy array), not a traced "
            "array: the packed-to-padded layout is built on the host. Pass it as a static "
            "argument or keep it outside jax.jit."
        ) from e
    if offsets.ndim != 1 or offsets.size < 2 or not np.issubdtype(offsets.dtype, np.integer):
        raise ValueError(
            f"cu_seqlens: expected a 1-D integer array [N + 1] with N >= 1, got shape "
            f"{offsets.shape} and dtype {offsets.dtype}"
        )
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != total_len or np.any(np.diff(offsets) < 0):
        raise ValueError(
            f"cu_seqlens: expected non-decreasing offsets from 0 to T={total_len}, got {offsets}"
        )
    return offsets


def _chunked_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    scale: float,
    initial_state: jax.Array,
    chunk_size: int,
    offsets: np.ndarray,
) -> tuple[jax.Array, jax.Array]:
    """Scatter packed sequences into a padded [N, Tmax] batch so no chunk straddles two."""
    lens = np.diff(offsets)
    t_max = int(lens.max())
    pos = np.arange(t_max)
    valid = pos[None, :] < lens[:, None]  # [N, Tmax]
    gather = np.where(valid, offsets[:-1, None] + pos[None, :], 0)

    def unpack(x: jax.Array) -> jax.Array:  # [1, T, H, ...] -> [N, Tmax, H, ...]
        y = x[0][gather]
        return jnp.where(valid.reshape(valid.shape + (1,) * (y.ndim - 2)), y, 0)

    o, state = _chunked_batched(
        *map(unpack, (q, k, v, g, beta)), scale, initial_state, chunk_size=chunk_size
    )
    seq = np.repeat(np.arange(lens.size), lens)  # token -> sequence
    return o[seq, np.arange(offsets[-1]) - offsets[seq]][None], state


def chunked_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float,
    initial_state: jax.Array | None,
    chunk_size: int = 64,
    cu_seqlens: object | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Exact chunk-parallel KDA (UT transform within chunks, ``lax.scan`` across them).

    With ``cu_seqlens`` (B == 1) the packed sequences are independent: ``initial_state``
    and the returned state are ``[N, H, K, V]``. With ``segment_ids`` (int [B, T], may be traced)
    the state resets wherever the id changes along a row, so each contiguous stretch of equal ids
    runs as if alone (``initial_state`` feeds each row's first stretch; the final state is its
    last one's). Returns ``(o in v.dtype, state fp32)``.
    """
    if cu_seqlens is not None and segment_ids is not None:
        raise ValueError("cu_seqlens and segment_ids: give one way of packing sequences, not both")
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    if cu_seqlens is None:
        offsets, n_states = None, q.shape[0]
    else:
        offsets = host_offsets(cu_seqlens, q.shape[1])
        n_states = offsets.size - 1
    if initial_state is None:
        initial_state = jnp.zeros((n_states, H, K, V), _F32)
    # The barrier keeps XLA from specialising the chunk scan on a constant (e.g. all-zero) state:
    # XLA:CPU in jaxlib 0.11.2 miscompiles that case when the final state is unused (its YNNPACK
    # fusions return garbage for some T; tests/pallas_kernels/kda/test_kda_reference.py checks it
    # under jit).
    initial_state = jax.lax.optimization_barrier(initial_state)
    if offsets is None:
        o, state = _chunked_batched(q, k, v, g, beta, scale, initial_state, chunk_size=chunk_size,
                                    segment_ids=segment_ids)
    else:
        o, state = _chunked_varlen(q, k, v, g, beta, scale, initial_state, chunk_size, offsets)
    return o.astype(v.dtype), state

"""Chunked KDA forward as one Mosaic TPU Pallas kernel, for the lower-bounded ("safe") gate.

Grid ``(H, N)`` over heads (parallel) and the ``N`` chunks of a chunk-aligned token layout
(sequential, "arbitrary"), which carries the fp32 state ``S [K, V]`` in a VMEM scratch buffer.
Every sequence starts on a chunk boundary: a batch ``[B, T]`` is B sequences of ``ceil(T / 64)``
chunks each, packed sequences (``cu_seqlens``) are gathered into the same layout
(``varlen_layout.py``). Three scalar-prefetched int32 arrays give each chunk its sequence and
whether it is that sequence's first chunk (load ``initial_state[seq]``) or last (store
``final_state[seq]``). On TPU a grid is a loop on one core anyway ("parallel" only splits it over
TensorCores), so serialising the sequences inside one head costs no parallelism, and batched and
packed inputs share one kernel. Each step does a whole chunk (kda.md section 2.1) with [64, *]
matmuls only, so everything runs on the MXU and no value is sliced or indexed by row (Mosaic tiles
are (8, 128); 16-row slices of a [64, 64] value would cut lanes):

* ``G = tril(1) @ g``: the in-chunk cumulative gate as a matmul (no cumsum lowering needed).
* ``Aqk`` and ``L`` with the midpoint offset per 16-row sub-chunk ``I`` (as the GPU kernels, ``chunk_math.py``):
  ``(q e^{G_r - G_mI}) (k e^{G_mI - G_i})^T`` restricted to the rows of ``I``, so four full
  [64, K] x [K, 64] products each, masked by row block. With every ``g >= -5`` a row factor is at
  most ``e^{8 * 5} = e^40`` and a needed column factor at most ``e^35`` (clamped at 40 for the
  masked-out ones), so no product exceeds ``e^80 < 3.4e38``: no inf, no NaN; a single offset for
  the whole 64-row chunk would need ``e^160`` and overflow.
* ``X = (I + L)^{-1}`` by recursive doubling: ``X <- X - X (O_s X)`` for block sizes
  ``s = 1, 2, ..., 32``, where ``O_s`` keeps ``L``'s entries whose row lies in the lower and column
  in the upper half of the same 2s-block. Every intermediate ``X`` is a block-diagonal part of the
  final inverse (diagonal blocks of the inverse of a triangular matrix are the inverses of its
  diagonal blocks), so nothing grows beyond the inverse itself. A Neumann product over the whole
  chunk, ``(I - L)(I + L^2)...(I + L^32)``, would be exact in exact arithmetic but sums powers of
  ``L`` with binomially large entries when keys are correlated, and cancels catastrophically in
  fp32. Twelve [64, 64] matmuls per chunk, all fp32.
* ``W = X (beta k e^G)``, ``U = X (beta v)``, ``v_new = U - W S``, ``o = (scale q e^G) S +
  Aqk v_new``, ``S <- e^{G_last} S + (k e^{G_last - G})^T v_new``.

Every contraction is fp32 with ``Precision.HIGHEST`` (multi-pass MXU), so the math is fp32
whatever the input dtype; bf16 operands for the products with q, k, v and the state (not for the
inverse) would be a later speed option once timed on hardware. Transposed operands are left to
the matmul (``dot_general`` dimension numbers), never materialised. Inputs are padded to whole
chunks with identity steps (k = v = beta = 0, g = 0) and moved head-major (``[H, tokens, D]``) in
the wrapper.

Status: tested only in TPU interpret mode on CPU (``pltpu.InterpretParams``, race detection on)
and cross-lowered to Mosaic; it has not run on TPU hardware, so the dispatch policy keeps the XLA
reference on TPU and this kernel runs only when asked for (``implementation="mosaic_tpu"``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda.reference import host_offsets
from pallas_kernels.kda.mosaic_tpu.decode import default_interpret
from pallas_kernels.kda.varlen_layout import chunk_layout, from_aligned, to_aligned

_F32 = jnp.float32
_HI = lax.Precision.HIGHEST
C = 64  # chunk
BC = 16  # sub-chunk sharing one midpoint offset
_CLAMP = 40.0  # column-factor exponent clamp; needed values are <= 35 when g >= -5


def _mm(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """a @ b with either operand transposed inside the contraction (Mosaic fuses the transpose
    into the matmul; no explicit relayout), fp32 operands and accumulation at full precision."""
    dims = ((0,) if trans_a else (1,), (1,) if trans_b else (0,))
    return lax.dot_general(a, b, (dims, ((), ())), precision=(_HI, _HI),
                           preferred_element_type=_F32)


def _row(x: jax.Array, r: int, rows: jax.Array) -> jax.Array:
    """Row ``r`` of ``x`` as [1, K] by a masked sublane sum (no dynamic row indexing)."""
    return jnp.sum(jnp.where(rows == r, x, 0.0), axis=0, keepdims=True)


def _unit_lower_inverse(L: jax.Array, ri: jax.Array, ci: jax.Array) -> jax.Array:
    """(I + L)^{-1} for strictly lower [C, C] ``L`` by recursive block doubling (see module doc)."""
    X = (ri == ci).astype(_F32)
    s, lg = 1, 0
    while s < C:
        same_block = lax.shift_right_logical(ri, lg + 1) == lax.shift_right_logical(ci, lg + 1)
        lower_row = (lax.shift_right_logical(ri, lg) & 1) == 1
        upper_col = (lax.shift_right_logical(ci, lg) & 1) == 0
        O = jnp.where(same_block & lower_row & upper_col, L, 0.0)
        X = X - _mm(X, _mm(O, X))
        s, lg = 2 * s, lg + 1
    return X


def _kernel(seq_ref, first_ref, last_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref,
            ht_ref, s_scr, *, scale):
    del seq_ref  # only used by the state index maps
    c = pl.program_id(1)

    @pl.when(first_ref[c] == 1)
    def _load_initial_state():
        s_scr[...] = h0_ref[...]

    K = q_ref.shape[-1]
    ri = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    ci = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    rows = lax.broadcasted_iota(jnp.int32, (C, K), 0)
    q = q_ref[...].astype(_F32) * scale
    k = k_ref[...].astype(_F32)
    v = v_ref[...].astype(_F32)
    beta = b_ref[...].astype(_F32)  # [C, 1]
    g = g_ref[...].astype(_F32)
    G = _mm((ri >= ci).astype(_F32), g)  # in-chunk cumulative gate
    G_last = _row(G, C - 1, rows)

    # Per-row midpoint offset: G_ref[r] = G[16 * (r // 16) + 8].
    G_ref = jnp.zeros_like(G)
    for i in range(C // BC):
        in_block = (rows >= i * BC) & (rows < (i + 1) * BC)
        G_ref = jnp.where(in_block, _row(G, i * BC + BC // 2, rows), G_ref)
    row_fac = jnp.exp(G - G_ref)
    ql, kl = q * row_fac, k * row_fac
    Aqk = jnp.zeros((C, C), _F32)
    Lkk = jnp.zeros((C, C), _F32)
    for i in range(C // BC):
        G_m = _row(G, i * BC + BC // 2, rows)
        kr = k * jnp.exp(jnp.minimum(G_m - G, _CLAMP))
        in_block = (ri >= i * BC) & (ri < (i + 1) * BC)
        Aqk = jnp.where(in_block, _mm(ql, kr, trans_b=True), Aqk)
        Lkk = jnp.where(in_block, _mm(kl, kr, trans_b=True), Lkk)
    Aqk = jnp.where(ri >= ci, Aqk, 0.0)
    L = jnp.where(ri > ci, beta * Lkk, 0.0)

    X = _unit_lower_inverse(L, ri, ci)
    eG = jnp.exp(G)
    W = _mm(X, beta * k * eG)
    U = _mm(X, beta * v)
    S = s_scr[...]
    v_new = U - _mm(W, S)
    o_ref[...] = (_mm(q * eG, S) + _mm(Aqk, v_new)).astype(o_ref.dtype)
    kd = k * jnp.exp(G_last - G)  # decayed to the chunk end; exponent <= 0
    # e^{G_last} along the state's K rows: G_last as a [K, V] matrix from g^T @ ones (a column
    # vector would need a lane-to-sublane relayout).
    decay = jnp.exp(_mm(g, jnp.ones((C, S.shape[1]), _F32), trans_a=True))
    S = decay * S + _mm(kd, v_new, trans_a=True)
    s_scr[...] = S

    @pl.when(last_ref[c] == 1)
    def _store_final_state():
        ht_ref[...] = S


def _chunk_flags(chunk_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per aligned chunk: its sequence, and 1 where it is that sequence's first / last chunk."""
    n_chunks = np.diff(chunk_offsets)
    seq = np.repeat(np.arange(n_chunks.size), n_chunks).astype(np.int32)
    first = np.zeros(seq.size, np.int32)
    last = np.zeros(seq.size, np.int32)
    first[chunk_offsets[:-1][n_chunks > 0]] = 1
    last[chunk_offsets[1:][n_chunks > 0] - 1] = 1
    return seq, first, last


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _aligned_kda(q, k, v, g, beta, initial_state, seq, first, last, *, scale, interpret):
    """Chunk-aligned inputs [1, Tp, H, D] (Tp a multiple of C), states [N, H, K, V]."""
    _, Tp, H, K = q.shape
    V = v.shape[-1]
    N = initial_state.shape[0]

    def head_major(x: jax.Array) -> jax.Array:  # [1, Tp, H, D] -> [H, Tp, D]
        return x[0].transpose(1, 0, 2)

    qh, kh, vh, gh = (head_major(x) for x in (q, k, v, g.astype(_F32)))
    bh = head_major(beta.astype(_F32)[..., None])  # [H, Tp, 1]

    def tok_block(d: int) -> pl.BlockSpec:
        return pl.BlockSpec((None, C, d), lambda h, c, seq, first, last: (h, c, 0))

    state_block = pl.BlockSpec(
        (None, None, K, V), lambda h, c, seq, first, last: (seq[c], h, 0, 0)
    )
    o, ht = pl.pallas_call(
        functools.partial(_kernel, scale=scale),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(H, Tp // C),
            in_specs=[tok_block(K), tok_block(K), tok_block(V), tok_block(K), tok_block(1),
                      state_block],
            out_specs=[tok_block(V), state_block],
            scratch_shapes=[pltpu.VMEM((K, V), _F32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((H, Tp, V), v.dtype),
                   jax.ShapeDtypeStruct((N, H, K, V), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kda_chunk_tpu_safe_gate",
    )(seq, first, last, qh, kh, vh, gh, bh, initial_state.astype(_F32))
    return o.transpose(1, 0, 2)[None], ht


def tpu_chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    cu_seqlens: object | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunked KDA forward on TPU (safe gate: every ``g`` in [-5, 0]; fla conventions).

    q, k [B, T, H, K] L2-normalised; v [B, T, H, V]; g [B, T, H, K]; beta [B, T, H];
    initial_state fp32 [B, H, K, V] or None. Returns ``(o [B, T, H, V] in v.dtype, final state
    fp32 [B, H, K, V])``. ``cu_seqlens``: host int offsets [N + 1] of packed sequences (B == 1);
    then the states are [N, H, K, V] and no state crosses a sequence boundary. ``interpret``:
    False (compile for TPU), True, or a ``pltpu.InterpretParams`` (TPU simulator on CPU); by
    default TPU interpret mode off TPU.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    for name, x, shape in (("k", k, (B, T, H, K)), ("g", g, (B, T, H, K)),
                           ("beta", beta, (B, T, H))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} (from q [B, T, H, K]), "
                             f"got {tuple(x.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v: expected shape [B, T, H, V] with B, T, H = {(B, T, H)}, "
                         f"got {tuple(v.shape)}")
    if cu_seqlens is None:
        n_states, layout_name = B, "[B, H, K, V]"
        n = -(-T // C)
        chunk_offsets = np.arange(B + 1, dtype=np.int32) * n
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B == 1, got q shape {q.shape}")
        layout = chunk_layout(host_offsets(cu_seqlens, T), C)
        chunk_offsets = layout.chunk_offsets
        n_states, layout_name = chunk_offsets.size - 1, "[N, H, K, V], N = len(cu_seqlens) - 1"
    if initial_state is None:
        initial_state = jnp.zeros((n_states, H, K, V), _F32)
    elif tuple(initial_state.shape) != (n_states, H, K, V):
        raise ValueError(f"initial_state: expected shape {(n_states, H, K, V)} {layout_name}, "
                         f"got {tuple(initial_state.shape)}")
    scale = K**-0.5 if scale is None else float(scale)
    interpret = default_interpret() if interpret is None else interpret
    flags = tuple(jnp.asarray(a) for a in _chunk_flags(chunk_offsets))
    if cu_seqlens is None:  # B sequences of n chunks: pad, then merge B into the token axis
        def aligned(x: jax.Array) -> jax.Array:
            x = jnp.pad(x, [(0, 0), (0, n * C - T)] + [(0, 0)] * (x.ndim - 2))
            return x.reshape((1, B * n * C) + x.shape[2:])

        o, ht = _aligned_kda(*map(aligned, (q, k, v, g, beta)), initial_state, *flags,
                             scale=scale, interpret=interpret)
        return o.reshape(B, n * C, H, V)[:, :T], ht
    o, ht = _aligned_kda(*(to_aligned(x, layout) for x in (q, k, v, g, beta)), initial_state,
                         *flags, scale=scale, interpret=interpret)
    empty = jnp.asarray(np.diff(chunk_offsets) == 0)[:, None, None, None]
    return from_aligned(o, layout), jnp.where(empty, initial_state, ht)  # unvisited: unchanged


__all__ = ["tpu_chunk_kda"]

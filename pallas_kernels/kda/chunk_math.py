"""Per-chunk KDA algebra on whole 64-token chunks, shared by the GPU kernels and the pure-JAX
backward that tests them.

Every function takes one chunk of one head as 2-D arrays (``[C, K]``, ``[C, V]``, ``[C, C]``,
``[K, V]``) and uses only elementwise ops, masks, row reductions, ``cumsum`` and 2-D dots, so the
same code runs under ``jax.vmap`` (the test oracle ``tests/pallas_kernels/kda/chunk_backward.py``)
and inside a Pallas-Triton kernel body (``triton/``, which cannot slice register values). Math:
kda.md section 2.1.

Pairwise decays ``exp(G_r - G_i)`` (``r >= i``) are never formed as ``[C, C, K]`` tensors: the
chunk is split into four 16-row sub-chunks and each factor is taken relative to the midpoint
``G_m`` of the *row's* sub-chunk, ``exp(G_r - G_m) * exp(G_m - G_i)``. With the safe gate
(``g >= -5``) both exponents stay inside ``[-280, 40]``: no overflow in fp32 or bf16, and a column
factor that underflows (below ``e^-87``) meets a row factor of at most ``e^40``, so the pair it
drops has a true decay below ``e^-47``. A sub-chunk's column factors are clamped at ``e^40`` so
that the masked (``i > r``) entries stay finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32
_HI = lax.Precision.HIGHEST
C = 64  # chunk
BC = 16  # sub-chunk
NC = C // BC
MID = 8  # midpoint row of a sub-chunk
CLAMP = 40.0
# The safe gate: every step's log-decay g >= LOWER_BOUND_MIN keeps the midpoint factors within
# e^40 (K3's ``gate_lower_bound``); the chunk kernels need it.
LOWER_BOUND_MIN = -5.0


TF32 = "tf32"  # a ``dot`` operand mode: fp32 operands, TF32 tensor-core products on GPU
# a ``dot`` operand mode: fp32 operands, each product as three bf16 tensor-core products on GPU
# (~1e-5 relative; XLA on CPU computes it in fp32)
BF16X3 = "bf16x3"


def dot(a: jax.Array, b: jax.Array, mm_dtype, *, trans_a: bool = False,
        trans_b: bool = False) -> jax.Array:
    """a @ b (optionally transposed) with fp32 accumulation; fp32 operands use IEEE fp32,
    ``mm_dtype=TF32`` fp32 operands at ``Precision.HIGH`` (TF32 in the Triton lowering),
    ``mm_dtype=BF16X3`` fp32 operands as three bf16 products (``BF16_BF16_F32_X3``)."""
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    if mm_dtype in (_F32, TF32, BF16X3):
        p = {_F32: (_HI, _HI), TF32: (lax.Precision.HIGH,) * 2,
             BF16X3: lax.DotAlgorithmPreset.BF16_BF16_F32_X3}[mm_dtype]
        return lax.dot_general(a.astype(_F32), b.astype(_F32), (dims, ((), ())),
                               precision=p, preferred_element_type=_F32)
    return lax.dot_general(a.astype(mm_dtype), b.astype(mm_dtype), (dims, ((), ())),
                           preferred_element_type=_F32)


def pair_output_types(q: jax.Array, store_dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The pair kernels' outputs for q [B, Tp, H, K]: ``(L fp32 [B, Tp, H, C] strictly lower,
    bk = beta k e^G, Qg, Kd [B, Tp, H, K], Aqk [B, Tp, H, C] causal, all in ``store_dtype``, and
    gl = e^{G_last} fp32 [B, N, H, K])``."""
    B, Tp, H, K = q.shape
    sds = jax.ShapeDtypeStruct
    return (sds((B, Tp, H, C), _F32), sds((B, Tp, H, K), store_dtype),
            sds((B, Tp, H, K), store_dtype), sds((B, Tp, H, K), store_dtype),
            sds((B, Tp, H, C), store_dtype), sds((B, Tp // C, H, K), _F32))


def pair_dtype(mm_dtype):
    """Operand mode of the pairwise-gradient products: at least TF32. In bf16 their row and
    column sides round differently, and dg (a reverse cumsum over the chunk, where the two sides
    of every pair cancel exactly in exact arithmetic) then loses about an order of magnitude of
    accuracy against the fp32 reference, where TF32 keeps it at bf16's level."""
    return _F32 if mm_dtype == _F32 else TF32


def _iota(shape: tuple[int, int], axis: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def _block_of(idx: jax.Array) -> jax.Array:
    """Sub-chunk of each row/column index (sums of comparisons: no integer division in-kernel)."""
    out = jnp.zeros_like(idx)
    for i in range(1, NC):
        out = out + (idx >= i * BC).astype(idx.dtype)
    return out


def row(x: jax.Array, r: int) -> jax.Array:
    """Row ``r`` of a 2-D array as ``[1, n]`` (a masked sum: Triton cannot index registers)."""
    return jnp.sum(jnp.where(_iota(x.shape, 0) == r, x, 0.0), axis=0)[None, :]


def causal_masks() -> tuple[jax.Array, jax.Array]:
    """(r >= i, r > i) masks of a [C, C] chunk matrix."""
    ri, ci = _iota((C, C), 0), _iota((C, C), 1)
    return ri >= ci, ri > ci


def _midpoints(G: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    """Each row's sub-chunk midpoint ``G_m(r)`` [C, K] and the four midpoints [1, K]."""
    mids = [row(G, i * BC + MID) for i in range(NC)]
    block = _block_of(_iota(G.shape, 0))
    g_mid = mids[0]
    for i in range(1, NC):
        g_mid = jnp.where(block == i, mids[i], g_mid)
    return g_mid, mids


def _col_factor(G: jax.Array, mid: jax.Array, unit: float, exp) -> jax.Array:
    """``exp(min(G_m - G_i, 40))`` [C, K]: finite also for the masked columns ``i > r``."""
    return exp(jnp.minimum(mid - G, CLAMP * unit))


def row_block(M: jax.Array, i: int) -> jax.Array:
    """``M`` with the rows outside sub-chunk ``i`` zeroed."""
    return jnp.where(_block_of(_iota(M.shape, 0)) == i, M, 0.0)


def pair_scores(x, y, G, mm_dtype) -> jax.Array:
    """P[r, i] = sum_d x_r[d] y_i[d] exp(G_r[d] - G_i[d]) for i <= r (upper triangle: garbage)."""
    return pair_scores_many((x,), y, G, mm_dtype)[0]


def pair_scores_many(xs, y, G, mm_dtype, unit: float = 1.0, exp=jnp.exp) -> list[jax.Array]:
    """``[pair_scores(x, y, G) for x in xs]`` making each sub-chunk's column factor once.
    A kernel may keep ``G`` in another ``unit`` (of natural log) with the matching ``exp``
    (``intra_blocks.gate_exp``); the clamp follows the unit."""
    g_mid, mids = _midpoints(G)
    rf = exp(G - g_mid)
    xrs = [x * rf for x in xs]
    outs = [None] * len(xs)
    for i, mid in enumerate(mids):
        yc = y * _col_factor(G, mid, unit, exp)
        for n, xr in enumerate(xrs):
            p = row_block(dot(xr, yc, mm_dtype, trans_b=True), i)
            outs[n] = p if outs[n] is None else outs[n] + p
    return outs


def pair_grads(dL_rows, dAqk_rows, k, bk, qs, G, mm_dtype, unit: float = 1.0,
               exp=jnp.exp) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Back through ``L = b_r P(k, k)`` and ``Aqk = P(qs, k)`` (lower-triangular dL, dAqk, given
    by row block: ``dL_rows(i)`` is dL with the rows outside sub-chunk i zeroed, [C, C]).

    Returns ``(rk, rq, c)``: ``rk[r] = sum_i dL[r, i] k_i e^{G_r - G_i}`` (the row side of P(k, k),
    without b_r), ``rq`` the same with dAqk, and the column side of both,
    ``c[i] = sum_r (dL[r, i] b_r k_r + dAqk[r, i] qs_r) e^{G_r - G_i}``. One column factor and
    one row block of dL and dAqk at a time, so that a kernel can load each block when needed.
    ``unit``, ``exp``: as in ``pair_scores_many``.
    """
    g_mid, mids = _midpoints(G)
    rf = exp(G - g_mid)
    bkr, qsr = bk * rf, qs * rf
    rk = rq = c = None
    for i, mid in enumerate(mids):
        cf = _col_factor(G, mid, unit, exp)
        kc = k * cf
        mL, mA = dL_rows(i), dAqk_rows(i)
        prk, prq = dot(mL, kc, mm_dtype), dot(mA, kc, mm_dtype)
        pc = cf * (dot(mL, bkr, mm_dtype, trans_a=True) + dot(mA, qsr, mm_dtype, trans_a=True))
        rk, rq, c = (prk, prq, pc) if rk is None else (rk + prk, rq + prq, c + pc)
    return rf * rk, rf * rq, c


def unit_lower_inverse(L: jax.Array) -> jax.Array:
    """(I + L)^{-1} for a strictly lower [C, C] L, in fp32, without slicing.

    I + L = (I + D)(I + N) with D the 16x16 diagonal blocks of L and N = (I + D)^{-1} (L - D)
    strictly block-lower, so (I + L)^{-1} = (I - N + N^2 - N^3)(I + D)^{-1}. Each diagonal block
    of (I + D)^{-1} is the exact Neumann product (I - D)(I + D^2)(I + D^4)(I + D^8) (D nilpotent of
    order 16). Same algebra as the forward kernel's block substitution; powers never exceed 16.
    """
    ri, ci = _iota((C, C), 0), _iota((C, C), 1)
    eye = (ri == ci).astype(_F32)
    diag = _block_of(ri) == _block_of(ci)
    D = jnp.where(diag, L, 0.0)
    mm = lambda a, b: dot(a, b, _F32)  # noqa: E731
    D2 = mm(D, D)
    P = mm(eye - D, eye + D2)
    D4 = mm(D2, D2)
    P = mm(P, eye + D4)
    Dinv = mm(P, eye + mm(D4, D4))
    N = mm(Dinv, jnp.where(diag, 0.0, L))
    S = eye - N
    S = eye - mm(N, S)
    S = eye - mm(N, S)
    return mm(S, Dinv)


def chunk_parts(qs, k, v, g, beta, mm_dtype) -> dict[str, jax.Array]:
    """The chunk's forward quantities (kda.md 2.1) from scaled q, k, v, g [C, *] and beta [C].

    A = (I + L)^{-1}, W = A (beta k e^G), U = A (beta v), Aqk (causal), Qg = qs e^G,
    Kd = k e^{G_last - G}, gl = e^{G_last} [1, K].
    """
    causal, strict = causal_masks()
    G = jnp.cumsum(g, axis=0)
    G_last = row(G, C - 1)
    b = beta[:, None]
    L = jnp.where(strict, b * pair_scores(k, k, G, mm_dtype), 0.0)
    aqk = jnp.where(causal, pair_scores(qs, k, G, mm_dtype), 0.0)
    A = unit_lower_inverse(L)
    eg = jnp.exp(G)
    return dict(
        A=A, W=dot(A, b * k * eg, mm_dtype), U=dot(A, b * v, mm_dtype), Aqk=aqk, Qg=qs * eg,
        Kd=k * jnp.exp(G_last - G), gl=jnp.exp(G_last),
    )


def value_terms(A, W, U, v, h, dh, do, dvn, beta, mm_dtype) -> tuple[dict, jax.Array]:
    """The terms of one chunk's gradients that contract over V, for a block of V columns.

    ``U, v, do, dvn`` [C, BV], ``h, dh`` [K, BV]: the returned sums are additive over V blocks
    (``key_grads`` takes their totals); ``dv`` [C, BV] is final for those columns.
    o = Qg h + Aqk vn,  vn = U - W h,  h_next = e^{G_last} h + Kd^T vn,  U = A (beta v).
    """
    vn = U - dot(W, h, mm_dtype)
    yu = dot(A, dvn, mm_dtype, trans_a=True)  # d(beta v)
    sums = dict(
        dQg=dot(do, h, mm_dtype, trans_b=True),
        dAqk=dot(do, vn, mm_dtype, trans_b=True),
        dW=-dot(dvn, h, mm_dtype, trans_b=True),
        dKd=dot(vn, dh, mm_dtype, trans_b=True),
        dgl=jnp.sum(h * dh, axis=1)[None, :],
        dLU=dot(yu, U, mm_dtype, trans_b=True),
        dbeta=jnp.sum(yu * v, axis=1),
    )
    return sums, beta[:, None] * yu


def key_grads(qs, k, g, beta, A, W, sums: dict, mm_dtype):
    """``(dqs, dk, dg, dbeta)`` of one chunk from the V-summed ``value_terms``.

    W = A (b k e^G), U = A (b v), A = (I + L)^{-1}: dL = -A^T dA A^T = -(A^T dW) W^T - (A^T dU) U^T.
    """
    yw = dot(A, sums["dW"], mm_dtype, trans_a=True)  # d(b k e^G)
    dL = -dot(yw, W, mm_dtype, trans_b=True) - sums["dLU"]
    causal, strict = causal_masks()
    dL, dAqk = jnp.where(strict, dL, 0.0), jnp.where(causal, sums["dAqk"], 0.0)
    dqs, dk, dg, dbeta = key_grads_from_sums(
        qs, k, g, beta, lambda i: row_block(dL, i), lambda i: row_block(dAqk, i),
        lambda: (yw, sums["dQg"], sums["dKd"], sums["dgl"]), mm_dtype)
    return dqs, dk, dg, sums["dbeta"] + dbeta


def key_grads_from_sums(qs, k, g, beta, dL_rows, dAqk_rows, v_sums, mm_dtype, unit: float = 1.0,
                        exp=jnp.exp):
    """``(dqs, dk, dg, dbeta)`` of one chunk, or of a block of its key channels (every term is
    per channel except dbeta's sum over them), from the chunk's masked ``dL``, ``dAqk`` by row
    block (as ``pair_grads`` takes them) and ``v_sums() = (yw, dQg, dKd, dgl)``: ``yw = A^T dW``
    (the gradient of ``b k e^G``), ``dQg``, ``dKd`` [C, K] and ``dgl`` [1, K]. ``v_sums`` is
    called after the pair terms, so that a kernel forms those products only then.

    ``g`` enters through ``G = cumsum(g)``, so ``dg`` is the reverse cumsum of ``dG`` plus
    ``dG_last`` on every row. A kernel may keep ``G`` in another ``unit`` with the matching
    ``exp`` (``intra_blocks.gate_exp``); the gradients stay those of natural log-decays.
    """
    G = jnp.cumsum(g * unit if unit != 1.0 else g, axis=0)
    G_last = row(G, C - 1)
    b = beta[:, None]

    # L = b_r P(k, k): its row side taken with dL (gives dbeta), column side with b_r dL.
    rk, rq, c = pair_grads(dL_rows, dAqk_rows, k, b * k, qs, G, pair_dtype(mm_dtype), unit, exp)
    yw, dQg, dKd, dgl = v_sums()
    eg = exp(G)
    ed = exp(G_last - G)
    kg = k * eg
    dbeta = jnp.sum(yw * kg, axis=1) + jnp.sum(k * rk, axis=1)

    dqs = dQg * eg + rq
    dk = b * rk + c + b * yw * eg + dKd * ed
    kd = k * ed
    dG = qs * dqs + b * k * rk - k * c + b * yw * kg - dKd * kd
    dG_last = jnp.sum(dKd * kd, axis=0)[None, :] + dgl * exp(G_last)
    dg = jnp.sum(dG, axis=0)[None, :] - jnp.cumsum(dG, axis=0) + dG + dG_last
    return dqs, dk, dg, dbeta


def chunk_grads(qs, k, v, g, beta, A, W, U, h, dh, do, dvn, mm_dtype):
    """Gradients of one chunk given its input state ``h`` [K, V], the gradient ``dh`` of its output
    state, ``do`` [C, V] and ``dvn = dL/dv_new`` [C, V] (from the reverse state pass).

    Returns ``(dqs, dk, dv, dg, dbeta)``; ``dqs`` is w.r.t. the scaled q.
    """
    sums, dv = value_terms(A, W, U, v, h, dh, do, dvn, beta, mm_dtype)
    dqs, dk, dg, dbeta = key_grads(qs, k, g, beta, A, W, sums, mm_dtype)
    return dqs, dk, dv, dg, dbeta

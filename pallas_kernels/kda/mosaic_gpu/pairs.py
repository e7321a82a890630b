"""The KDA intra stage's pair kernel in Mosaic GPU (Hopper: TMA copies, wgmma products).

Same outputs as ``triton.intra.intra_pairs`` (``L`` fp32, ``bk``, ``Qg``, ``Kd``, ``Aqk``,
``gl``), from bf16 q, k and a bf16 or fp32 gate, one chunk of one head per warpgroup (grid
``(N, H, B)``). Why a second backend for this one kernel: in the Pallas-Triton form it took about
half the forward because Triton cannot slice register tiles, so each 16-column block of ``L`` and
``Aqk`` is a masked ``[64, K] x [K, 64]`` product (4x the tensor-core work) at 255 registers. Here
each block is its own ``[64, K] x [K, 16]`` wgmma into a column slice of one accumulator, and the
operands go through shared memory explicitly (timings in benchmarks/RESULTS.md).

Work per chunk (``G`` in units of ln 2 and ``exp2``; kda.md 2.1 / 2.4, ``chunk_math``'s midpoint
factorisation with the column block's midpoint ``m_j``):

1. TMA the chunk's q, k, g (by 64-channel halves: one bf16 swizzle tile is 64 wide) and beta;
   the L2 norms (fused activations) as per-row factors over both halves. An fp32 gate (the
   model's pre-activated one) comes one half at a time into the second row-operand buffer,
   the next half's copy issued once this one is read, so its row operands are single-buffered.
2. Per channel half, which adds its share to both pair accumulators:
   a. the gate activation, split ``g = hi + lo`` into two bf16 terms, and the cumulative gate as
      two tensor-core products with the lower-triangular ones matrix (``G = T hi + T lo``; the
      split keeps 16 of fp32's 24 bits of each step, ~3e-4 relative in a 64-step decay, far below
      bf16 outputs' 2^-9). ``G`` stays in registers; a plain fp32 copy gives its rows ``m_j``.
   b. the column operand ``kc = k e^{m(c) - G}`` (each row against its own sub-chunk's
      midpoint), then per column block ``j`` the row operands ``k e^{min(G - m_j, 40)}``,
      ``qs e^{...}`` (double-buffered, so block j's are written while block j-1's products run)
      and two wgmmas into column block ``j`` of the ``L`` and ``Aqk`` accumulators.
   c. the half's ``Kd``, ``bk``, ``Qg``, ``gl``, staged in its own input buffers and stored by TMA
      while the next half runs.
3. The masked ``L`` (times beta_r) and ``Aqk``, staged in freed buffers and stored by TMA.

Shared memory ~105 KB and 255 registers: two warpgroups per SM. The body places its own barriers
(``commit_smem``) and runs with Mosaic GPU's automatic ones off (a first form with them, the rows
of G taken by cross-warp reductions and G reloaded from shared memory, was several times slower).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.chunk_math import BC, C, CLAMP, MID, NC, pair_output_types
from pallas_kernels.kda.reference import L2_NORM_EPS
from pallas_kernels.kda.mosaic_gpu.tiles import (
    BF16_TILES, COLS, F32_TILES, HALF, ROWS, WG, rows, sigmoid,
)

_F32, _BF16 = jnp.float32, jnp.bfloat16
LOG2E = 1.4426950408889634


def _iota(axis: int) -> jax.Array:
    return plgpu.broadcasted_iota(jnp.int32, (C, HALF), axis, layout=WG)


def _cols(v: jax.Array) -> jax.Array:
    return plgpu.layout_cast(lax.broadcast_in_dim(v, (C, HALF), [1]), WG)


def _tile(ref) -> jax.Array:
    """A [C, HALF] tile from shared memory, in fp32 and the wgmma accumulator layout."""
    return plgpu.load(ref, layout=WG).astype(_F32)


def _pairs_body(*refs, scale: float, fused: bool, lower_bound: float, nk: int, g_f32: bool):
    if fused:
        q_ref, k_ref, g_ref, bt_ref, gs_ref, db_ref, *refs = refs
    else:
        q_ref, k_ref, g_ref, bt_ref, *refs = refs
        gs_ref = db_ref = None
    (l_ref, bk_ref, qg_ref, kd_ref, a_ref, gl_ref,
     tq, tk, tg, tx, ty, gp, beta_s, gs_s, db_s, gl_s, bars) = refs
    # an fp32 gate comes one half at a time into ``ty``'s bytes (``tf``), so the row operands are
    # single-buffered then
    tf, ty = (ty, None) if g_f32 else (None, ty)
    c, h, b = lax.axis_index("c"), lax.axis_index("h"), lax.axis_index("b")
    ts = pl.ds(c * C, C)
    halves = [pl.ds(hh * HALF, HALF) for hh in range(nk)]
    unit = LOG2E

    # 1. loads, one barrier per copy
    copies = []
    for hh, cs in enumerate(halves):
        copies += [(q_ref.at[b, ts, h, cs], tq.at[hh]), (k_ref.at[b, ts, h, cs], tk.at[hh])]
        if not g_f32:
            copies.append((g_ref.at[b, ts, h, cs], tg.at[hh]))
        elif hh == 0:
            copies.append((g_ref.at[b, ts, h, cs], tf))
        if fused:
            copies += [(gs_ref.at[h, cs], gs_s.at[hh]), (db_ref.at[h, cs], db_s.at[hh])]
    copies.append((bt_ref.at[b, h, ts], beta_s))
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
    ri, ci = _iota(0), _iota(1)
    for i in range(len(copies)):
        plgpu.barrier_wait(bars.at[i])

    # per-row factors: L2 norms (fused) and beta
    if fused:
        ssq = ssk = None
        for hh in range(nk):
            qh, kh = _tile(tq.at[hh]), _tile(tk.at[hh])
            sq, sk = jnp.sum(qh * qh, axis=1), jnp.sum(kh * kh, axis=1)
            ssq, ssk = (sq, sk) if ssq is None else (ssq + sq, ssk + sk)
        rq = rows(lax.rsqrt(ssq + L2_NORM_EPS) * scale)
        rk = rows(lax.rsqrt(ssk + L2_NORM_EPS))
        beta = rows(sigmoid(plgpu.load(beta_s, layout=ROWS)))
    else:
        rq, rk = scale, 1.0
        beta = rows(plgpu.load(beta_s, layout=ROWS))

    def row(r):
        """Row ``r`` of the current half's G (stored in ``gp``) on every row."""
        return _cols(plgpu.load(gp.at[r], layout=COLS))

    def products(acc_l, acc_a):
        """Both pair matrices, summed over the channel halves (each half its own G)."""
        for hh in range(nk):
            # 2. gate activation and the cumulative gate G (units of ln 2) of this half
            if g_f32:
                if hh:
                    plgpu.barrier_wait(bars.at[len(copies) + hh - 1])
                g = _tile(tf)
                if hh + 1 < nk:  # the next half's gate, once every thread has read this one
                    plgpu.commit_smem()
                    plgpu.copy_gmem_to_smem(g_ref.at[b, ts, h, halves[hh + 1]], tf,
                                            bars.at[len(copies) + hh])
            else:
                g = _tile(tg.at[hh])
            if fused:
                gs = _cols(plgpu.load(gs_s.at[hh], layout=COLS))
                db = _cols(plgpu.load(db_s.at[hh], layout=COLS))
                g = (lower_bound * unit) * sigmoid(gs * (g + db))
            else:
                g = g * unit
            hi = g.astype(_BF16)
            tg[hh] = hi
            tx[1] = (g - hi.astype(_F32)).astype(_BF16)
            tx[0] = (ri >= ci).astype(_BF16)  # T: lower-triangular ones, the cumsum as a product
            plgpu.commit_smem()

            def cumsum(acc, hh=hh):
                plgpu.wgmma(acc, tx.at[0], tg.at[hh])
                plgpu.wgmma(acc, tx.at[0], tx.at[1])
                return acc[...]

            G = pl.run_scoped(cumsum, plgpu.ACC((C, HALF), _F32))
            gp[...] = G
            plgpu.commit_smem()

            # 3. the column operand kc = k e^{m(c) - G} (each row against its sub-chunk's
            # midpoint), then per column block j the row operands and two products
            m_row = row(MID)
            for j in range(1, NC):
                m_row = jnp.where(ri >= j * BC, row(j * BC + MID), m_row)
            k = _tile(tk.at[hh]) * rk
            tg[hh] = (k * jnp.exp2(m_row - G)).astype(_BF16)
            for j in range(NC):
                cols = pl.ds(j * BC, BC)
                rf = jnp.exp2(jnp.minimum(G - row(j * BC + MID), CLAMP * unit))
                if ty is None:
                    ops = tx
                    if j:
                        plgpu.wgmma_wait(0)
                else:  # double-buffered: block j's operands are written while block j - 1's
                    ops = tx if j % 2 == 0 else ty  # products run
                    if j >= 2:
                        plgpu.wgmma_wait(2)
                ops[0] = (k * rf).astype(_BF16)
                ops[1] = (_tile(tq.at[hh]) * rq * rf).astype(_BF16)
                plgpu.commit_smem()
                kc = tg.at[hh, cols].transpose((1, 0))
                plgpu.wgmma(acc_l.at[:, cols], ops.at[0], kc)
                plgpu.wgmma(acc_a.at[:, cols], ops.at[1], kc)

            # 4. this half's gate terms, staged in its own input buffers and stored by TMA
            g_last = plgpu.load(gp.at[C - 1], layout=COLS)
            eg = jnp.exp2(G)
            plgpu.wgmma_wait(0)  # the products have read kc
            tg[hh] = (k * jnp.exp2(_cols(g_last) - G)).astype(_BF16)  # Kd
            tk[hh] = (beta * k * eg).astype(_BF16)  # bk
            tq[hh] = (_tile(tq.at[hh]) * rq * eg).astype(_BF16)  # Qg
            gl_s[hh] = jnp.exp2(g_last)
            plgpu.commit_smem()
            cs = halves[hh]
            plgpu.copy_smem_to_gmem(tg.at[hh], kd_ref.at[b, ts, h, cs])
            plgpu.copy_smem_to_gmem(tk.at[hh], bk_ref.at[b, ts, h, cs])
            plgpu.copy_smem_to_gmem(tq.at[hh], qg_ref.at[b, ts, h, cs])
            plgpu.copy_smem_to_gmem(gl_s.at[hh], gl_ref.at[b, c, h, cs])
        return acc_l[...], acc_a[...]

    p_kk, p_qk = pl.run_scoped(products, plgpu.ACC((C, C), _F32), plgpu.ACC((C, C), _F32))

    # 5. the masked pair matrices, staged in freed buffers and stored by TMA ([C, C] is [C, HALF]:
    # the half tiles' iotas and beta serve)
    plgpu.commit_smem()  # every row load of gp is done
    gp[...] = jnp.where(ri > ci, beta * p_kk, 0.0)
    tx[0] = jnp.where(ri >= ci, p_qk, 0.0).astype(_BF16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(gp, l_ref.at[b, ts, h])
    plgpu.copy_smem_to_gmem(tx.at[0], a_ref.at[b, ts, h])
    plgpu.wait_smem_to_gmem(0)


def takes(q_dtype, k_dtype, g_dtype, K: int) -> bool:
    """Whether the kernel takes inputs of these dtypes and key width once T is padded to whole
    chunks: bf16 q, k (its operand tiles are bf16), a bf16 or fp32 gate, K a multiple of the
    swizzle tile."""
    return q_dtype == _BF16 and k_dtype == _BF16 and g_dtype in (_BF16, _F32) and K % HALF == 0


def intra_pairs_mgpu(ins, *, scale: float, fused: bool, lower_bound: float, interpret: bool):
    """``(L fp32, bk, Qg, Kd, Aqk, gl)`` of every chunk, as ``triton.intra.intra_pairs``.
    ``ins``: bf16 q, k (v unused), a bf16 or fp32 gate g, beta [, gate_scale, dt_bias when
    ``fused``], T a multiple of 64, K a multiple of 64. ``interpret``: Mosaic GPU's CPU
    interpreter (tests)."""
    q, k, _, g, beta = ins[:5]
    B, Tp, H, K = q.shape
    if not takes(q.dtype, k.dtype, g.dtype, K) or Tp % C:
        raise ValueError(f"mosaic_gpu_pairs: wants bf16 q, k [B, T, H, K] and a bf16 or fp32 g, "
                         f"T % {C} == 0 and K % {HALF} == 0, got q {q.dtype} {q.shape}, k "
                         f"{k.dtype}, g {g.dtype}")
    g_f32 = g.dtype == _F32
    nk = K // HALF
    n = Tp // C
    extra = [x.astype(_F32) for x in ins[5:]] if fused else []
    beta_t = jnp.swapaxes(beta, 1, 2).astype(_F32)  # [B, H, T]: one TMA row per chunk
    buf = lambda: plgpu.SMEM((max(nk, 2), C, HALF), _BF16, transforms=BF16_TILES)  # noqa: E731
    n_copies = nk * (5 if fused else 3) + 1  # with an fp32 gate, halves after the first later
    kernel = plgpu.kernel(
        functools.partial(_pairs_body, scale=scale, fused=fused, lower_bound=lower_bound, nk=nk,
                          g_f32=g_f32),
        out_type=pair_output_types(q, _BF16),
        grid=(n, H, B),
        grid_names=("c", "h", "b"),
        scratch_types=(
            buf(), buf(), buf(), buf(),
            plgpu.SMEM((C, HALF), _F32, transforms=F32_TILES) if g_f32 else buf(),  # ty or tf
            plgpu.SMEM((C, C), _F32),  # one half's G (for its rows), then L
            plgpu.SMEM((C,), _F32),  # beta
            plgpu.SMEM((nk, HALF), _F32),  # gate scale
            plgpu.SMEM((nk, HALF), _F32),  # dt bias
            plgpu.SMEM((nk, HALF), _F32),  # gl
            plgpu.Barrier(num_barriers=n_copies),
        ),
        # the body places its own barriers (commit_smem) between shared-memory writes and reads
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        kernel_name="kda_intra_pairs_mgpu",
    )
    return kernel(q, k, g, beta_t, *extra)

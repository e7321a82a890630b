"""The KDA forward's fused inter stage in Mosaic GPU (Hopper: TMA copies, wgmma products).

Same outputs as ``pallas_kda._inter_kernel`` forming W and U in its loop (``o`` in v's dtype and
the final fp32 state), from the intra stage's X, bk, Qg, Kd, Aqk, gl and the inputs v, beta.
Why a second backend: at B4 T8192 H96 the Triton kernel took ~2.7 of the forward's 6.9 ms
(benchmarks/RESULTS.md, tenth and eleventh runs), about twice its memory traffic. It loads every
chunk's tiles inside the serial loop (one pipeline stage, so that two programs fit an SM), and each
64-column value block re-reads the chunk's bk, Qg, Kd, X and Aqk. Here TMA loads chunk c + 1 while
chunk c is computed, and the value blocks of one (sequence, head) are the warpgroups of one CTA,
which share those copies: the forward 5.34 ms where the Triton kernel gave 6.91 (eleventh run).

Grid ``(V / (64 nw), H, B)``, ``nw`` warpgroups (64 value columns each, nw = 2 for V = 128) per
CTA; warpgroup w keeps its state columns ``S`` ([K, 64] fp32) in registers across the chunk loop.
Per chunk (kda.md 2.1):

1. ``S`` to shared memory in bf16 (the operand of its products);
2. ``P = bk S`` and ``O = Qg S`` (issued together); ``t = beta v - P``; ``v_new = X t``, which is
   ``U - W S`` for ``W = X bk``, ``U = X beta v``;
3. ``O += Aqk v_new``, ``S = gl * S + Kd^T v_new`` (the product accumulated onto the decayed
   state: a second [K, 64] array made the loop spill, 622 vs 450 us); o is staged in t's buffer
   and stored by TMA.

Every product takes bf16 operands and accumulates in fp32, as the Triton kernel's. Warpgroup 0
issues the copies of chunk c + 2 into the slot that chunk c used once both warpgroups have
released it (two slots). The initial state comes in and the final state goes out through shared
memory in scopes of their own, so the loop's buffers (~210 KB at K = V = 128) have the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.chunk_math import C
from pallas_kernels.kda.mosaic_gpu_tiles import (
    BF16_TILES, F32_TILES, HALF, ROWS, WG, rows, sigmoid,
)

_F32, _BF16 = jnp.float32, jnp.bfloat16
SLOTS = 2  # chunks in flight: the one being computed and the next one loading
# K up to 128 and two warpgroups (128 value columns) per CTA: the loop's buffers then fill the
# 227 KB of shared memory
MAX_HALVES = 2


def _accumulate_onto(init: jax.Array, products, interpret: bool) -> jax.Array:
    """``init`` plus what ``products(acc)`` accumulates, in an accumulator that starts at
    ``init``, so no second array of its size is live. Mosaic GPU's CPU interpreter cannot run an
    accumulator initialised by value; there the products start from zero and ``init`` is added
    after (the same sum)."""
    if interpret:
        def from_zero(acc):
            products(acc)
            return acc[...]

        return init + pl.run_scoped(from_zero, plgpu.ACC(init.shape, _F32))
    return pl.run_state(products)(plgpu.ACC.init(init))


def _body(x_ref, bk_ref, v_ref, bt_ref, qg_ref, kd_ref, a_ref, gl_ref, h0_ref, o_ref, ht_ref, *,
          n_chunks: int, nw: int, fused: bool, interpret: bool):
    K = bk_ref.shape[-1]
    b, h, vb = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
    w = lax.axis_index("wg")
    vcols = [pl.ds((vb * nw + j) * HALF, HALF) for j in range(nw)]
    mine = pl.ds((vb * nw + w) * HALF, HALF)  # this warpgroup's value columns

    def load_state(hs, bars):
        plgpu.copy_gmem_to_smem(h0_ref.at[b, h, :, mine], hs.at[w], bars.at[w])
        plgpu.barrier_wait(bars.at[w])
        return plgpu.load(hs.at[w], layout=WG)

    S = pl.run_scoped(load_state, plgpu.SMEM((nw, K, HALF), _F32, transforms=F32_TILES),
                      plgpu.Barrier(num_barriers=nw), collective_axes="wg")

    n_copies = 7 + nw

    def loop(x_s, bk_s, v_s, bt_s, qg_s, kd_s, a_s, gl_s, s_s, t_s, loaded, released):
        def issue(c, slot):
            """Warpgroup 0 copies chunk c's tiles into ``slot``, one barrier per copy."""
            ts = pl.ds(c * C, C)
            copies = [(x_ref.at[b, ts, h], x_s.at[slot]), (a_ref.at[b, ts, h], a_s.at[slot]),
                      (bt_ref.at[b, h, ts], bt_s.at[slot]), (gl_ref.at[b, c, h], gl_s.at[slot]),
                      (bk_ref.at[b, ts, h], bk_s.at[slot]), (qg_ref.at[b, ts, h], qg_s.at[slot]),
                      (kd_ref.at[b, ts, h], kd_s.at[slot])]
            copies += [(v_ref.at[b, ts, h, vs], v_s.at[slot, j]) for j, vs in enumerate(vcols)]
            for i, (src, dst) in enumerate(copies):
                plgpu.copy_gmem_to_smem(src, dst, loaded.at[slot * n_copies + i])

        @pl.when(w == 0)
        def _():
            for c in range(min(SLOTS, n_chunks)):
                issue(c, c)

        def chunk(c, S):
            slot = lax.rem(c, SLOTS)
            for i in range(n_copies):  # every warpgroup waits every copy: phases are per thread
                plgpu.barrier_wait(loaded.at[slot * n_copies + i])
            # 1. the state in bf16 (the last chunk's products have read the buffer)
            s_s[w] = S.astype(_BF16)
            plgpu.commit_smem()
            decayed = rows(plgpu.load(gl_s.at[slot], layout=ROWS)) * S

            def products(acc_p, acc_o, acc_v):
                # 2. P = bk S and O = Qg S together; t = beta v - P; v_new = X t
                plgpu.wgmma(acc_p, bk_s.at[slot], s_s.at[w])
                plgpu.wgmma(acc_o, qg_s.at[slot], s_s.at[w])
                beta = plgpu.load(bt_s.at[slot], layout=ROWS)
                if fused:
                    beta = sigmoid(beta)
                bv = rows(beta) * plgpu.load(v_s.at[slot, w], layout=WG).astype(_F32)
                p = plgpu.wgmma_accumulator_load(acc_p, wait_n=1)  # O's product may still run
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last o store has read t_s
                t_s[w] = (bv - p).astype(_BF16)
                plgpu.commit_smem()
                plgpu.wgmma(acc_v, x_s.at[slot], t_s.at[w])
                v_new = acc_v[...]
                t_s[w] = v_new.astype(_BF16)
                plgpu.commit_smem()
                # 3. O += Aqk v_new; S = gl * S + Kd^T v_new, accumulated onto the decayed state
                # (no second [K, 64] array live: the loop is at the register limit)
                plgpu.wgmma(acc_o, a_s.at[slot], t_s.at[w])

                def update(acc_s):
                    plgpu.wgmma(acc_s, kd_s.at[slot].transpose((1, 0)), t_s.at[w])

                return acc_o[...], _accumulate_onto(decayed, update, interpret)

            o, S = pl.run_scoped(products, plgpu.ACC((C, HALF), _F32), plgpu.ACC((C, HALF), _F32),
                                 plgpu.ACC((C, HALF), _F32))
            plgpu.barrier_arrive(released.at[slot])
            t_s[w] = o.astype(_BF16)  # every product has read v_new
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(t_s.at[w], o_ref.at[b, pl.ds(c * C, C), h, mine])

            @pl.when((w == 0) & (c + SLOTS < n_chunks))
            def _():
                plgpu.barrier_wait(released.at[slot])
                issue(c + SLOTS, slot)

            return S

        S_out = lax.fori_loop(0, n_chunks, chunk, S)

        @pl.when(w == 0)
        def _():  # the last chunks' releases, which issued nothing (every phase is observed)
            for c in range(max(0, n_chunks - SLOTS), n_chunks):
                plgpu.barrier_wait(released.at[c % SLOTS])

        plgpu.wait_smem_to_gmem(0)
        return S_out

    bf16 = lambda *shape: plgpu.SMEM(shape, _BF16, transforms=BF16_TILES)  # noqa: E731
    S = pl.run_scoped(
        loop,
        bf16(SLOTS, C, C),  # X
        bf16(SLOTS, C, K),  # bk
        bf16(SLOTS, nw, C, HALF),  # v
        plgpu.SMEM((SLOTS, C), _F32),  # beta
        bf16(SLOTS, C, K),  # Qg
        bf16(SLOTS, C, K),  # Kd
        bf16(SLOTS, C, C),  # Aqk
        plgpu.SMEM((SLOTS, K), _F32),  # gl
        bf16(nw, K, HALF),  # S in bf16, per warpgroup
        bf16(nw, C, HALF),  # t, then v_new, then o, per warpgroup
        plgpu.Barrier(num_barriers=SLOTS * n_copies),
        plgpu.Barrier(num_arrivals=nw, num_barriers=SLOTS),
        collective_axes="wg",
    )

    def store_state(hs):
        hs[w] = S
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(hs.at[w], ht_ref.at[b, h, :, mine])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store_state, plgpu.SMEM((nw, K, HALF), _F32), collective_axes="wg")


def takes(K: int, V: int, dtype, varlen: bool) -> bool:
    """Whether the kernel takes a forward with key / value widths K, V and inputs (so
    intermediates) of ``dtype``: bf16, K and V multiples of 64 with K up to ``MAX_HALVES`` swizzle
    tiles, one sequence per batch row (packed sequences take the Triton kernel)."""
    return (dtype == _BF16 and not varlen and K % HALF == 0 and V % HALF == 0
            and K // HALF <= MAX_HALVES)


def inter_mgpu(x, bk, v, beta, qg, kd, aqk, gl, h0, *, fused: bool, interpret: bool,
               warpgroups: int | None = None):
    """``(o, final state)`` of the fused inter stage with W and U formed in the loop.

    x, aqk [B, Tp, H, 64] and bk, qg, kd [B, Tp, H, K] bf16 from the intra stage, v [B, Tp, H, V]
    bf16, beta [B, Tp, H] (logits when ``fused``), gl fp32 [B, Tp / 64, H, K], h0 fp32
    [B, H, K, V]; Tp a multiple of 64. ``interpret``: Mosaic GPU's CPU interpreter (tests).
    ``warpgroups``: per CTA, each 64 value columns; by default as many as V has, up to
    ``MAX_HALVES``, and one in the interpreter: there each warpgroup is a host thread, and two
    that wait on each other inside a jit can starve a two-core host."""
    B, Tp, H, K = bk.shape
    V = v.shape[-1]
    if not takes(K, V, v.dtype, False) or x.dtype != _BF16 or bk.dtype != _BF16 or Tp % C:
        raise ValueError(f"mosaic_gpu_inter: wants bf16 X, bk and v with K, V multiples of {HALF} "
                         f"up to {MAX_HALVES * HALF} and T % {C} == 0, got bk {bk.dtype} "
                         f"{bk.shape}, X {x.dtype}, v {v.dtype} {v.shape}")
    if warpgroups is None:
        warpgroups = 1 if interpret else min(V // HALF, MAX_HALVES)
    nw = warpgroups
    if not 1 <= nw <= MAX_HALVES or (V // HALF) % nw:
        raise ValueError(f"mosaic_gpu_inter: warpgroups={nw} must be in [1, {MAX_HALVES}] and "
                         f"divide V / {HALF} = {V // HALF}")
    beta_t = jnp.swapaxes(beta, 1, 2).astype(_F32)  # [B, H, T]: one TMA row per chunk
    kernel = plgpu.kernel(
        functools.partial(_body, n_chunks=Tp // C, nw=nw, fused=fused, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype),
                  jax.ShapeDtypeStruct((B, H, K, V), _F32)),
        grid=(V // (HALF * nw), H, B),
        grid_names=("v", "h", "b"),
        num_threads=nw,
        thread_name="wg",
        # the body places its own barriers (commit_smem) between shared-memory writes and reads
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        kernel_name="kda_inter_mgpu",
    )
    return kernel(x, bk, v, beta_t, qg, kd, aqk, gl, h0.astype(_F32))

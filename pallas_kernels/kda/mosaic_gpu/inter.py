"""The KDA forward's fused inter stage in Mosaic GPU (Hopper: TMA copies, wgmma products).

Same outputs as ``triton.inter.inter_fused`` (``o`` in v's dtype and the final fp32 state), from
the intra stage's X, bk, Qg, Kd, Aqk, gl and the inputs v, beta. Why a second backend: the Triton
kernel moves about twice the stage's necessary memory traffic. It loads every chunk's tiles inside
the serial loop (one pipeline stage, so that two programs fit an SM), and each 64-column value
block re-reads the chunk's bk, Qg, Kd, X and Aqk. Here TMA loads chunk c + 1 while chunk c is
computed, and the value blocks of one (sequence, head) are the warpgroups of one CTA, which share
those copies (timings in benchmarks/RESULTS.md).

Grid ``(V / (64 nw), H, B)``, ``nw`` warpgroups (64 value columns each, nw = 2 for V = 128) per
CTA; warpgroup w keeps its state columns ``S`` ([K, 64] fp32) in registers across the chunk loop.
Per chunk (kda.md 2.1):

1. ``S`` to shared memory in bf16 (the operand of its products);
2. ``P = bk S`` and ``O = Qg S`` (issued together); ``t = beta v - P``; ``v_new = X t``, which is
   ``U - W S`` for ``W = X bk``, ``U = X beta v``;
3. ``O += Aqk v_new``, ``S = gl * S + Kd^T v_new`` (the product accumulated onto the decayed
   state: a second [K, 64] array made the loop spill); o is staged in t's buffer
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
from pallas_kernels.kda.mosaic_gpu.tiles import (
    F32_TILES, HALF, ROWS, WG, bf16_tiles, rows, sigmoid,
)

_F32, _BF16 = jnp.float32, jnp.bfloat16
SLOTS = 2  # chunks in flight: the one being computed and the next one loading
# K up to 128 and 128 value columns per CTA: the loop's buffers then fill the 227 KB of shared
# memory
MAX_K_TILES = 2
MAX_CTA_COLS = 128


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


def _body(*refs, n_chunks: int, nw: int, cols: int, fused: bool, interpret: bool,
          states_only: bool, v_width: int):
    """One CTA: ``nw`` warpgroups of ``cols`` state columns each. ``states_only``: no Qg, Aqk or o,
    only the final state; state columns at or past ``v_width`` (v's width) evolve with a zero v,
    so an identity there becomes the chunk range's transition matrix."""
    x_ref, bk_ref, v_ref, bt_ref, kd_ref, gl_ref, h0_ref, *rest = refs
    qg_ref, a_ref, o_ref, ht_ref = (None, None, None, *rest) if states_only else rest
    K = bk_ref.shape[-1]
    b, h, vb = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
    w = lax.axis_index("wg")
    first = [(vb * nw + j) * cols for j in range(nw)]  # each warpgroup's first state column
    # v's columns for each warpgroup (any in range past v_width: those are zeroed); the offsets'
    # divisibility stated, for the TMA copies' tiling
    vcols = [pl.ds(pl.multiple_of(jnp.minimum(f, v_width - cols), cols), cols) for f in first]
    mine = pl.ds(pl.multiple_of((vb * nw + w) * cols, cols), cols)  # this warpgroup's columns
    v_on = ((vb * nw + w) * cols < v_width).astype(_F32)

    def load_state(hs, bars):
        plgpu.copy_gmem_to_smem(h0_ref.at[b, h, :, mine], hs.at[w], bars.at[w])
        plgpu.barrier_wait(bars.at[w])
        return plgpu.load(hs.at[w], layout=WG)

    S = pl.run_scoped(load_state, plgpu.SMEM((nw, K, cols), _F32, transforms=F32_TILES),
                      plgpu.Barrier(num_barriers=nw), collective_axes="wg")

    def loop(x_s, bk_s, v_s, bt_s, kd_s, gl_s, s_s, t_s, loaded, released, *o_tiles):
        qg_s, a_s = o_tiles or (None, None)  # Qg, Aqk: only when forming o

        def tiles(c, slot):
            """Chunk c's copies into ``slot``: (source, destination) pairs."""
            ts = pl.ds(c * C, C)
            copies = [(x_ref.at[b, ts, h], x_s.at[slot]), (bt_ref.at[b, h, ts], bt_s.at[slot]),
                      (gl_ref.at[b, c, h], gl_s.at[slot]), (bk_ref.at[b, ts, h], bk_s.at[slot]),
                      (kd_ref.at[b, ts, h], kd_s.at[slot])]
            if not states_only:
                copies += [(a_ref.at[b, ts, h], a_s.at[slot]),
                           (qg_ref.at[b, ts, h], qg_s.at[slot])]
            return copies + [(v_ref.at[b, ts, h, vs], v_s.at[slot, j])
                             for j, vs in enumerate(vcols)]

        def issue(c, slot):
            """Warpgroup 0 copies chunk c's tiles into ``slot``, one barrier per copy."""
            for i, (src, dst) in enumerate(tiles(c, slot)):
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
            decayed = rows(plgpu.load(gl_s.at[slot], layout=ROWS), cols) * S

            def products(acc_p, acc_v, *acc_o):
                # 2. P = bk S and O = Qg S together; t = beta v - P; v_new = X t
                plgpu.wgmma(acc_p, bk_s.at[slot], s_s.at[w])
                if acc_o:
                    plgpu.wgmma(acc_o[0], qg_s.at[slot], s_s.at[w])
                beta = plgpu.load(bt_s.at[slot], layout=ROWS)
                if fused:
                    beta = sigmoid(beta)
                beta = beta * v_on  # no v in the transition columns
                bv = rows(beta, cols) * plgpu.load(v_s.at[slot, w], layout=WG).astype(_F32)
                p = plgpu.wgmma_accumulator_load(acc_p, wait_n=len(acc_o))  # O's may still run
                if acc_o:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last o store read t_s
                t_s[w] = (bv - p).astype(_BF16)
                plgpu.commit_smem()
                plgpu.wgmma(acc_v, x_s.at[slot], t_s.at[w])
                v_new = acc_v[...]
                t_s[w] = v_new.astype(_BF16)
                plgpu.commit_smem()
                # 3. O += Aqk v_new; S = gl * S + Kd^T v_new, accumulated onto the decayed state
                # (no second [K, cols] array live: the loop is at the register limit)
                if acc_o:
                    plgpu.wgmma(acc_o[0], a_s.at[slot], t_s.at[w])

                def update(acc_s):
                    plgpu.wgmma(acc_s, kd_s.at[slot].transpose((1, 0)), t_s.at[w])

                S = _accumulate_onto(decayed, update, interpret)
                return S, *(acc[...] for acc in acc_o)

            acc = plgpu.ACC((C, cols), _F32)
            S, *o = pl.run_scoped(products, acc, acc, *(() if states_only else (acc,)))
            plgpu.barrier_arrive(released.at[slot])
            if o:
                t_s[w] = o[0].astype(_BF16)  # every product has read v_new
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

    # every wgmma operand in the state columns' swizzle: a product's two operands must agree
    bf16 = lambda *shape: plgpu.SMEM(shape, _BF16, transforms=bf16_tiles(cols))  # noqa: E731
    n_copies = 5 + nw + (0 if states_only else 2)
    S = pl.run_scoped(
        loop,
        bf16(SLOTS, C, C),  # X
        bf16(SLOTS, C, K),  # bk
        bf16(SLOTS, nw, C, cols),  # v
        plgpu.SMEM((SLOTS, C), _F32),  # beta
        bf16(SLOTS, C, K),  # Kd
        plgpu.SMEM((SLOTS, K), _F32),  # gl
        bf16(nw, K, cols),  # S in bf16, per warpgroup
        bf16(nw, C, cols),  # t, then v_new, then o, per warpgroup
        plgpu.Barrier(num_barriers=SLOTS * n_copies),
        plgpu.Barrier(num_arrivals=nw, num_barriers=SLOTS),
        *(() if states_only else (bf16(SLOTS, C, K), bf16(SLOTS, C, C))),  # Qg, Aqk
        collective_axes="wg",
    )

    def store_state(hs):
        hs[w] = S
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(hs.at[w], ht_ref.at[b, h, :, mine])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store_state, plgpu.SMEM((nw, K, cols), _F32), collective_axes="wg")


def takes(K: int, V: int, dtype, varlen: bool) -> bool:
    """Whether the kernel takes a forward with key / value widths K, V and inputs (so
    intermediates) of ``dtype``: bf16, K and V multiples of 64 with K up to ``MAX_K_TILES`` swizzle
    tiles, one sequence per batch row (packed sequences take the Triton kernel)."""
    return (dtype == _BF16 and not varlen and K % HALF == 0 and V % HALF == 0
            and K // HALF <= MAX_K_TILES)


def _launch(x, bk, v, beta, tiles_o, kd, gl, h0, *, fused: bool, interpret: bool,
            warpgroups: int | None, value_cols: int):
    """Checks the inputs and runs ``_body`` over the state's columns (h0's width, at least v's);
    ``tiles_o``: ``(Qg, Aqk)`` to form o too, or ``()`` for the final state alone."""
    B, Tp, H, K = bk.shape
    V, width = v.shape[-1], h0.shape[-1]
    if not takes(K, V, v.dtype, False) or x.dtype != _BF16 or bk.dtype != _BF16 or Tp % C:
        raise ValueError(f"mosaic_gpu_inter: wants bf16 X, bk and v with K, V multiples of {HALF} "
                         f"up to {MAX_K_TILES * HALF} and T % {C} == 0, got bk {bk.dtype} "
                         f"{bk.shape}, X {x.dtype}, v {v.dtype} {v.shape}")
    if value_cols not in (HALF // 2, HALF):
        raise ValueError(f"mosaic_gpu_inter: value_cols={value_cols}, expected {HALF // 2} or "
                         f"{HALF}")
    if warpgroups is None:
        warpgroups = 1 if interpret else min(width, MAX_CTA_COLS) // value_cols
    nw = warpgroups
    if not 1 <= nw <= MAX_CTA_COLS // value_cols or width % (nw * value_cols):
        raise ValueError(f"mosaic_gpu_inter: warpgroups={nw} of {value_cols} value columns must "
                         f"cover at most {MAX_CTA_COLS} columns and divide the state's width "
                         f"{width}")
    if tiles_o and width != V:
        raise ValueError(f"mosaic_gpu_inter: h0 {h0.shape} must be as wide as v {v.shape}")
    state = jax.ShapeDtypeStruct((B, H, K, width), _F32)
    kernel = plgpu.kernel(
        functools.partial(_body, n_chunks=Tp // C, nw=nw, cols=value_cols, fused=fused,
                          interpret=interpret, states_only=not tiles_o, v_width=V),
        out_type=(jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype), state) if tiles_o else state,
        grid=(width // (value_cols * nw), H, B),
        grid_names=("v", "h", "b"),
        num_threads=nw,
        thread_name="wg",
        # the body places its own barriers (commit_smem) between shared-memory writes and reads
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        kernel_name="kda_inter_mgpu" if tiles_o else "kda_states_mgpu",
    )
    beta_t = jnp.swapaxes(beta, 1, 2).astype(_F32)  # [B, H, T]: one TMA row per chunk
    return kernel(x, bk, v, beta_t, kd, gl, h0.astype(_F32), *tiles_o)


def inter_mgpu(x, bk, v, beta, qg, kd, aqk, gl, h0, *, fused: bool, interpret: bool,
               warpgroups: int | None = None, value_cols: int = HALF):
    """``(o, final state)`` of the fused inter stage with W and U formed in the loop.

    x, aqk [B, Tp, H, 64] and bk, qg, kd [B, Tp, H, K] bf16 from the intra stage, v [B, Tp, H, V]
    bf16, beta [B, Tp, H] (logits when ``fused``), gl fp32 [B, Tp / 64, H, K], h0 fp32
    [B, H, K, V]; Tp a multiple of 64. ``interpret``: Mosaic GPU's CPU interpreter (tests).
    ``value_cols``: value columns per warpgroup, 64 or 32 (more CTAs per head when heads are
    few). ``warpgroups``: per CTA; by default as many as V has up to ``MAX_CTA_COLS`` columns,
    and one in the interpreter: there each warpgroup is a host thread, and two that wait on each
    other inside a jit can starve a two-core host."""
    return _launch(x, bk, v, beta, (qg, aqk), kd, gl, h0, fused=fused, interpret=interpret,
                   warpgroups=warpgroups, value_cols=value_cols)


def states_mgpu(x, bk, v, beta, kd, gl, h0, *, fused: bool, interpret: bool,
                warpgroups: int | None = None, value_cols: int = HALF):
    """The final state alone (fp32 [B, H, K, W]) of the same recurrence, from h0 fp32
    [B, H, K, W] with W >= V: columns past V see a zero v, so ``h0 = [s | I]`` gives
    ``[A s + B | A]`` with A the chunk range's transition matrix ([K, K]) and B the state it
    builds from zero; the segmented inter stage's first pass (``segmented_inter.py``). Other
    arguments as ``inter_mgpu``'s."""
    return _launch(x, bk, v, beta, (), kd, gl, h0, fused=fused, interpret=interpret,
                   warpgroups=warpgroups, value_cols=value_cols)

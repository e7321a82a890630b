"""The routed experts' grouped GEMMs as Mosaic TPU Pallas kernels: gate+up with a fused SiTU epilogue,
and the plain grouped matmul of the down projection.

Rows of ``x`` [M, in] are sorted by expert (``group_sizes`` [E], as for ``lax.ragged_dot``); weights are
[E, out, in] (the release layout). ``tpu_grouped_gate_up_situ``: ``hidden [M, F]`` with, for each row m
of expert e, ``hidden[m] = SiTU(w1[e] @ x[m], w3[e] @ x[m])`` where
``SiTU(g, u) = beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta)`` in fp32;
``tpu_grouped_matmul``: ``y[m] = w[e] @ x[m]`` (fp32 accumulation). One kernel body serves both.

Tile schedule (megablox-style, computed in plain JAX and scalar-prefetched into SMEM): rows are cut into
tiles of ``block_m``; a tile that straddles expert boundaries is visited once per expert it holds
("items"), consecutively, so its output block stays resident in VMEM and each visit overwrites only its
expert's rows. Rows past ``sum(group_sizes)`` form a virtual expert E whose items skip the GEMM and
store zeros. The item count is data dependent; the grid uses its static bound ``M/bm + E`` and the
trailing items are idle (same block indices as the last real item: no DMA, no write).

Grid: (output-column tiles [parallel], items [arbitrary], K tiles [arbitrary]); one fp32 VMEM accumulator
per weight (two for gate+up).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.moe.epilogue import situ_f32

F32 = jnp.float32
I32 = jnp.int32

_COMPUTE, _FIRST, _ACTIVE = 1, 2, 4  # item flag bits


class TileSchedule(NamedTuple):
    """Per-item int32 [P] arrays: row tile, expert (clamped to E-1), [lo, hi) global rows, flag bits."""

    tile: jax.Array
    expert: jax.Array
    lo: jax.Array
    hi: jax.Array
    flags: jax.Array


def make_schedule(group_sizes: jax.Array, num_rows: int, block_m: int) -> TileSchedule:
    """Items for ``num_rows`` (a multiple of ``block_m``) rows grouped by ``group_sizes`` [E]; P = M/bm + E."""
    E = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(I32)), num_rows)
    ends = jnp.concatenate([ends, jnp.array([num_rows], I32)])  # + virtual expert E: the padding rows
    starts = jnp.concatenate([jnp.zeros((1,), I32), ends[:-1]])
    sizes = ends - starts
    n_tiles = jnp.where(sizes > 0, (ends - 1) // block_m - starts // block_m + 1, 0)
    item_end = jnp.cumsum(n_tiles)
    item_start = item_end - n_tiles
    n_items = item_end[-1]
    P = num_rows // block_m + E
    idx = jnp.arange(P, dtype=I32)
    ic = jnp.minimum(idx, n_items - 1)
    grp = jnp.sum(ic[:, None] >= item_end[None, :], axis=1).astype(I32)  # E+1 groups: tiny broadcast
    tile = starts[grp] // block_m + (ic - item_start[grp])
    active = idx < n_items
    first = jnp.concatenate([jnp.ones((1,), bool), tile[1:] != tile[:-1]]) & active
    compute = active & (grp < E)
    flags = compute * _COMPUTE + first * _FIRST + active * _ACTIVE
    return TileSchedule(tile.astype(I32), jnp.minimum(grp, E - 1).astype(I32), starts[grp], ends[grp],
                        flags.astype(I32))


def _kernel(tile_ref, exp_ref, lo_ref, hi_ref, flags_ref, x_ref, *refs, block_m: int, num_k: int, fused: bool,
            beta: float | None, linear_beta: float | None, precision):
    """``refs``: the weight block(s) (w1, w3 when ``fused``, else w), the output block, then one fp32
    accumulator per weight."""
    del exp_ref
    n_w = 2 if fused else 1
    w_refs, o_ref, accs = refs[:n_w], refs[n_w], refs[n_w + 1:]
    i, kk = pl.program_id(1), pl.program_id(2)
    flags = flags_ref[i]

    @pl.when(kk == 0)
    def _init():
        for acc in accs:
            acc[...] = jnp.zeros_like(acc)

    @pl.when((flags & _COMPUTE) != 0)
    def _gemm():
        x = x_ref[...]
        dims = (((1,), (1,)), ((), ()))
        for acc, w_ref in zip(accs, w_refs):
            acc[...] += jax.lax.dot_general(x, w_ref[...], dims, precision=precision, preferred_element_type=F32)

    last = (kk == num_k - 1) & ((flags & _ACTIVE) != 0)

    def _epilogue():
        if fused:
            h = situ_f32(accs[0][...], accs[1][...], beta, linear_beta).astype(o_ref.dtype)
        else:
            h = accs[0][...].astype(o_ref.dtype)
        rows = tile_ref[i] * block_m + jax.lax.broadcasted_iota(I32, h.shape, 0)
        mask = (rows >= lo_ref[i]) & (rows < hi_ref[i])
        return h, mask

    @pl.when(last & ((flags & _FIRST) != 0))
    def _store_first():
        h, mask = _epilogue()
        o_ref[...] = jnp.where(mask, h, jnp.zeros_like(h))

    @pl.when(last & ((flags & _FIRST) == 0))
    def _store_merge():
        h, mask = _epilogue()
        o_ref[...] = jnp.where(mask, h, o_ref[...])


def _pick(n: int, pref: int) -> int:
    if n <= pref:
        return n
    for b in (pref, 512, 256, 128):
        if b <= pref and n % b == 0:
            return b
    return n


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "beta", "linear_beta",
                                             "out_dtype", "interpret", "precision"))
def _call(x, ws, group_sizes, *, block_m, block_n, block_k, beta, linear_beta, out_dtype, interpret,
          precision):
    """``ws``: (w1, w3) for gate+up+SiTU, (w,) for the plain grouped matmul."""
    m0, kdim = x.shape
    E, F, _ = ws[0].shape
    bm, bn, bk = block_m, block_n, block_k
    m = pl.cdiv(max(m0, 1), bm) * bm
    if m != m0:
        x = jnp.pad(x, ((0, m - m0), (0, 0)))
    sched = make_schedule(group_sizes, m, bm)
    P = sched.tile.shape[0]
    num_k = kdim // bk

    def k_eff(k, flags, i):
        return jnp.where((flags[i] & _COMPUTE) != 0, k, num_k - 1)

    def x_map(n, i, k, tile, exp, lo, hi, flags):
        return tile[i], k_eff(k, flags, i)

    def w_map(n, i, k, tile, exp, lo, hi, flags):
        return exp[i], n, k_eff(k, flags, i)

    def o_map(n, i, k, tile, exp, lo, hi, flags):
        return tile[i], n

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(F // bn, P, num_k),
        in_specs=[pl.BlockSpec((bm, bk), x_map)] + [pl.BlockSpec((None, bn, bk), w_map) for _ in ws],
        out_specs=pl.BlockSpec((bm, bn), o_map),
        scratch_shapes=[pltpu.VMEM((bm, bn), F32) for _ in ws],
    )
    kernel = functools.partial(_kernel, block_m=bm, num_k=num_k, fused=len(ws) == 2, beta=beta,
                               linear_beta=linear_beta, precision=precision)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((m, F), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
    )(*sched, x, *ws)
    return out[:m0]


def _tiles(n: int, kdim: int, block_m: int, block_n: int | None, block_k: int | None) -> tuple[int, int]:
    """(block_n, block_k), checked: each divides its dim and is a multiple of 128 or the whole dim."""
    bn = _pick(n, 512) if block_n is None else int(block_n)
    bk = _pick(kdim, 512) if block_k is None else int(block_k)
    for name, b, d in (("block_n", bn, n), ("block_k", bk, kdim)):
        if d % b or (b != d and b % 128):
            raise ValueError(f"{name}={b} must divide {d} and be a multiple of 128 (or equal it)")
    if block_m % 8:
        raise ValueError(f"block_m={block_m} must be a multiple of 8")
    return bn, bk


def _check(x: jax.Array, ws: tuple[jax.Array, ...], group_sizes: jax.Array) -> None:
    names = "w1/w3" if len(ws) == 2 else "w"
    if x.ndim != 2 or any(w.ndim != 3 or w.shape != ws[0].shape or w.shape[2] != x.shape[1] for w in ws):
        raise ValueError(f"x [M, in], {names} [E, out, in] expected; got {x.shape}, "
                         f"{', '.join(str(w.shape) for w in ws)}")
    if group_sizes.shape != (ws[0].shape[0],):
        raise ValueError(f"group_sizes must be [{ws[0].shape[0]}]; got {group_sizes.shape}")


def tpu_grouped_gate_up_situ(
    x: jax.Array, w1: jax.Array, w3: jax.Array, group_sizes: jax.Array, *, beta: float = 4.0,
    linear_beta: float | None = 25.0, block_m: int = 128, block_n: int | None = None,
    block_k: int | None = None, out_dtype=None, precision=None, interpret=False,
) -> jax.Array:
    """hidden [M, F] = SiTU(x w1[e]^T, x w3[e]^T) per expert group; rows past sum(group_sizes) are zero.

    x [M, in] sorted by expert; w1, w3 [E, F, in]; group_sizes int [E] with sum <= M. ``block_m`` a
    multiple of 8 (16 for bf16); ``block_n`` / ``block_k`` (default: up to 512) must divide F / in and be
    multiples of 128 or the full dim. ``interpret``: False, True, or ``pltpu.InterpretParams``.
    """
    _check(x, (w1, w3), group_sizes)
    bn, bk = _tiles(w1.shape[1], w1.shape[2], block_m, block_n, block_k)
    return _call(x, (w1, w3), group_sizes.astype(I32), block_m=int(block_m), block_n=bn, block_k=bk,
                 beta=float(beta), linear_beta=None if linear_beta is None else float(linear_beta),
                 out_dtype=jnp.dtype(out_dtype or x.dtype), interpret=interpret, precision=precision)


def tpu_grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, block_m: int = 128, block_n: int | None = None,
    block_k: int | None = None, out_dtype=None, precision=None, interpret=False,
) -> jax.Array:
    """y [M, N] = x w[e]^T per expert group (fp32 accumulation), the down projection; rows past
    sum(group_sizes) are zero. x [M, K] sorted by expert; w [E, N, K]; tiles as ``tpu_grouped_gate_up_situ``."""
    _check(x, (w,), group_sizes)
    bn, bk = _tiles(w.shape[1], w.shape[2], block_m, block_n, block_k)
    return _call(x, (w,), group_sizes.astype(I32), block_m=int(block_m), block_n=bn, block_k=bk,
                 beta=None, linear_beta=None, out_dtype=jnp.dtype(out_dtype or x.dtype), interpret=interpret,
                 precision=precision)

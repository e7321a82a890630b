"""Grouped (ragged) GEMM for the routed experts, in Pallas lowered through Triton.

Two entry points share one kernel body:

* ``grouped_gate_up_situ(x, w1, w3, group_sizes)`` = SiTU(x @ w1_e^T, x @ w3_e^T) per row group: gate and
  up are two fp32 accumulators of the same (row tile, column tile), fed from one load of the x tile, and the
  SiTU product b1*tanh(g/b1)*sigmoid(g) * b2*tanh(u/b2) is taken in fp32 in the epilogue, so neither the
  [M, F] gate nor the up tensor is ever written to device memory.
* ``grouped_matmul(x, w, group_sizes)`` = x @ w_e^T per row group (the down projection), the same kernel
  with one accumulator and a plain cast in the epilogue.

Layout: rows of ``x`` [M, K] are sorted by expert; ``group_sizes`` [E] (int32) counts each expert's rows;
weights keep the release layout [E, N, K] (``out, in``), so a weight tile is read K-contiguous and fed to
the MMA transposed (no host-side transpose). Rows past ``sum(group_sizes)`` come out as zeros, as in
``lax.ragged_dot``. bf16 operands, fp32 accumulation, output in ``x.dtype`` unless asked otherwise.

MXFP4 weights (``MXFP4Experts``: uint8 codes [E, N, K/2] + E8M0 scales [E, N, K/32], the release layout)
go through the same kernel: each k step loads the packed [bn, bk/2] code tile and its [bn, bk/32] scales
and decodes them to x's dtype in registers (mxfp4_tile.py)
right before the dot, so HBM traffic for weights is 4.25 bits per weight and no decoded copy of the layer
is ever written. Their default configs (`for_weights`) feed the decoded tile as the MMA's left operand so
it goes from registers straight to wgmma. block_k must be a multiple of 32 (one scale byte per 32 inputs).
On the H200 (2026-11-29) this ran at 224 / 238 TFLOP/s (gate+up / down, E=28; gate+up 269 with the
one-warpgroup tiles of 2026-11-30, `GATE_UP_MXFP4`) against 540 / 538 for bf16 weights and 342 / 339 for
XLA decoding the layer first: the per-tile decode (about 740 SASS instructions per thread and k step)
outweighs the MMAs, so at that size `routed_experts` still decodes in XLA (see api.py).

Work decomposition (computed in plain JAX inside the same jit, a few hundred int32 ops): every expert's
rows are cut into ``block_m`` row tiles that never straddle two experts (at most ``cdiv(M, bm) + E``
tiles); each (row tile, column block) pair is one program. Programs are numbered expert by expert, and
inside an expert column-block-major with the row tiles fastest, so the programs resident at one time
share one expert's weight column block (read from HBM once, then from L2) and the expert's x rows stay
in L2. A row tile always loads a full ``block_m`` rows (its start is shifted back at the end of x so the
load stays in bounds) and stores only its own rows under a mask, so no padding copy of x is needed. With
``cfg.tail_m`` an expert's last tile, when it holds at most tail_m rows, runs a second copy of the loop at
that height (same table, chosen per program by its row count), so few-row remainders are not padded to
block_m (``mma_rows`` counts the MMA rows a table costs). With ``cfg.merge_tail`` a program may also cover
block_m + tail_m rows as two MMAs per weight tile, so that a remainder shares its expert's weight loads
(`_row_tiling` picks the cut).

Why Pallas-Triton and not Mosaic GPU (``plgpu.kernel`` + ``emit_pipeline`` + ``wgmma``): Mosaic GPU is
JAX's documented direction on Hopper and Pallas-Triton is deprecated since JAX 0.11.0, but this kernel had
to be correct and tested within an afternoon and 10 minutes of GPU time. (1) Pallas-Triton kernels run
unchanged under ``interpret=True`` on CPU, which is what CI has, at any grid size; the Mosaic-GPU
interpreter is private (``jax._src``) and handles a single block only. (2) The Triton path lowers to
Triton IR on a CPU machine (``.lower(lowering_platforms=("cuda",))`` with an abstract H200, see
tests/moe/test_pallas_moe.py), so lowering errors are caught before any device time is spent; the Triton
compiler then chooses the MMA instructions, the async-copy pipeline (``num_stages``) and the register
layout itself (the measured rate, 0.98x ``torch._grouped_mm``, says the tensor cores are well used; the
Triton IR compiled offline with Triton 3.6 for sm_90 shows async wgmma with the accumulator kept in
flight across k steps, ``WARPGROUP.DEPBAR.LE gsb0, 0x2``). (3) Masked stores and data-dependent tile metadata are
one line each in Triton; in Mosaic GPU they need hand-built TMA descriptors/barriers and warp
specialisation to reach the same speed. The price: no TMA multicast, no warp-specialised producer, no
persistent grid, so the ceiling is that of a good non-persistent Triton GEMM. The metadata/ordering code
is backend-neutral and can be reused by a later Mosaic-GPU kernel. Pallas-Triton is slated for removal
after JAX 0.11, so pin jax<0.12 for this path or port it then. The forward's gate+up and down GEMMs for
large groups have since been written in Mosaic GPU (``mosaic_gpu_grouped_gemm.py``: warp-specialised,
persistent; 594 vs 488 TFLOP/s gate+up and 558 vs 495 down at 28 experts, timed in turns on the H200) and
are what the expert MLP runs there, as are the backward's products with the forward's weights; this kernel
keeps the small-group, decode-sized, MXFP4 and interpret-mode cases and the weight gradients.

Measured on one H200 (2026-11-29, benchmarks/RESULTS.md): gate+up+SiTU 528 TFLOP/s and down 540 TFLOP/s
at 28 experts x 16384 rows (torch._grouped_mm without the activation: 541 / 508; XLA ragged_dot: 28 / 27);
at 112 experts (146 rows each) gate+up 444-451 and down 422-427 TFLOP/s with merged tails (2026-11-30;
torch 369-374 / 353-359 in the same jobs).

Limits: K and N must be multiples of block_k / block_n (``pallas_experts.experts_pallas`` zero-pads odd
toy widths). Pallas-Triton computes 32-bit element offsets and switches to 64-bit by itself for operands
over 4 GiB, so expert count is not bounded by indexing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import ptx_math
from pallas_kernels.moe.batch_size import is_decode_sized
from pallas_kernels.moe.mxfp4_tile import BLOCK, decode_tile
from pallas_kernels.moe.reference import MXFP4Experts

F32 = jnp.float32
Weight = jax.Array | MXFP4Experts  # [E, N, K] dense, or packed codes [E, N, K/2] + scales [E, N, K/32]


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile sizes and Triton launch parameters. ``block_n`` is per accumulator (gate and up each get one).

    weights_lhs: feed the weight tile as the MMA's left operand (out^T = w x^T, accumulators [bn, bm],
    transposed once for the store). On Hopper the left wgmma operand may come from registers, so a tile
    decoded in registers (MXFP4) goes straight to the tensor cores and the MMA stays asynchronous, overlapping
    the next tile's decode; as the right operand it has to be written to shared memory first and Triton
    waits for each MMA before the next decode (seen in the SASS: ``WARPGROUP.DEPBAR.LE gsb0, 0x0``). The row
    tile becomes the MMA's N, which may be as small as 16 rows.

    tail_m: row tiles that hold at most tail_m rows (only an expert's last tile can) run a second copy of
    the loop at that height instead of block_m, so the expert's remainder is not padded to a full tile
    (at 146 rows per expert, 128 + 32 instead of 2 x 128 or 3 x 64 rows of MMA work). With weights_lhs
    the rows are the MMA's N, so 16 or 32 is cheap; without it tail_m should stay >= 64 (wgmma's M).

    merge_tail (needs tail_m and weights_lhs): a program may cover block_m + tail_m rows, as two MMAs (block_m
    and tail_m rows) per weight tile, so each weight tile is loaded (and, for MXFP4, decoded) once for both.
    Each expert is cut the cheaper way (`_row_tiling`): block_m tiles with a remainder of <= tail_m rows
    joining the last, or tiles of block_m + tail_m rows. At 146 rows per expert this is one 160-row program
    instead of a 128-row one and a 32-row one that repeats the whole k loop's weight traffic for a quarter
    of the MMA work: gate+up 451 vs 357 TFLOP/s, down 427 vs 350 (H200, 2026-11-30, one job).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4
    weights_lhs: bool = False
    tail_m: int | None = None
    merge_tail: bool = False

    def label(self) -> str:
        """Every field, for benchmark records: configs that differ get different labels."""
        return (f"bm{self.block_m}_bn{self.block_n}_bk{self.block_k}_w{self.num_warps}"
                f"_s{self.num_stages}" + ("_wlhs" if self.weights_lhs else "")
                + (f"_tail{self.tail_m}" if self.tail_m else "") + ("_merged" if self.merge_tail else ""))


# Picked on one H200 (2026-11-29/30, benchmarks/RESULTS.md): 128-row tiles when experts average >= 320 rows.
# Below that (146 rows per expert at E=112) every expert's remainder tile is mostly padding: 64-row tiles
# ran 329 TFLOP/s (31% of the MMA rows padding); the small-group configs below add a 32-row tail
# (128 + 32 rows, 9.6% padding) merged into the full tile's program, with the weights as the MMA's left
# operand so that the 32 rows are its N. At 585 rows per expert (E=28) merging gained nothing (tail 32:
# 523 vs 531 TFLOP/s; tail 16: 451), so the 28-expert defaults keep plain 128-row tiles.
GATE_UP_DEFAULT = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)
GATE_UP_SMALL_GROUPS = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                                  weights_lhs=True, tail_m=32, merge_tail=True)
DOWN_DEFAULT = TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4)
DOWN_SMALL_GROUPS = TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4,
                               weights_lhs=True, tail_m=32, merge_tail=True)
SMALL_GROUP_ROWS = 320  # average rows per expert below which the small-group configs are used
# Decode-sized batches (batch_size.is_decode_sized, e.g. 256 routed rows over 28
# experts): one 32-row tile per expert, 64 weight rows per program and 4 warps, one warpgroup, so that each
# program decodes (MXFP4) its own weight rows once rather than two warpgroups decoding the same tile. On the
# H200 (2026-11-29, 256 rows, E=28): gate+up 0.363 vs 0.392 ms (bf16 weights) and 0.461 vs 0.745 ms (MXFP4,
# before its 16-row tail below), down 0.195 vs 0.227 and 0.221 vs 0.281 ms against the small-group configs.
DECODE_TILES = TileConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4, weights_lhs=True)
# The same with MXFP4 weights, plus a 16-row tile for experts with at most 16 rows (the usual case at ~9 rows
# per expert). On the H200 (2026-11-30, 256 rows over 28 experts, three jobs of three interleaved repeats,
# median ms): gate+up 0.389-0.395 vs 0.444-0.469 for DECODE_TILES (0.90-1.00x the bf16 kernel on bf16 weights),
# down 0.222-0.233 vs 0.227-0.250 (0.85-1.05x). All-16-row tiles were close but decode an expert's weights
# twice past 16 rows; bf16 weights gained nothing from the tail (0.364 vs 0.357, 0.201 vs 0.198).
DECODE_TILES_MXFP4 = dataclasses.replace(DECODE_TILES, tail_m=16)


# MXFP4 weights at >= 320 rows per expert: one warpgroup per program (214 registers, 57 KB of shared memory),
# so two programs share an SM and one's tile decode overlaps the other's MMAs. gate+up at E=28 x 16384 rows on
# the H200 (2026-11-30, one job): 269.3 TFLOP/s against 232.0 for the bf16 tiles with the weights as the left
# operand (2 stages: 248.5; 64 x 128: 190.9; 64 x 64: 194.7). Decoding the layer first is still faster there
# (about 340), which is what routed_experts does at that size; the bf16 kernel gains nothing from these tiles
# (497.7 vs 536.2).
GATE_UP_MXFP4 = TileConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3, weights_lhs=True)


def for_weights(cfg: TileConfig, mxfp4: bool) -> TileConfig:
    """MXFP4 weights go in as the MMA's left operand (224 vs 176 TFLOP/s gate+up at E=28 on the H200,
    2026-11-29)."""
    return dataclasses.replace(cfg, weights_lhs=True) if mxfp4 else cfg


def gate_up_config(num_rows: int, num_groups: int, mxfp4: bool = False) -> TileConfig:
    """Tile choice from static shapes only (group sizes are data): average rows per expert."""
    if is_decode_sized(num_rows, num_groups):
        return DECODE_TILES_MXFP4 if mxfp4 else DECODE_TILES
    if num_rows < SMALL_GROUP_ROWS * num_groups:
        return for_weights(GATE_UP_SMALL_GROUPS, mxfp4)
    return GATE_UP_MXFP4 if mxfp4 else GATE_UP_DEFAULT


def down_config(num_rows: int, num_groups: int, mxfp4: bool = False, backward: bool = False) -> TileConfig:
    """As `gate_up_config`, for the down projection. backward: for the backward's grouped GEMMs, which keep
    the small-group tiles at decode sizes (DECODE_TILES were only measured forward)."""
    if is_decode_sized(num_rows, num_groups) and not backward:
        return DECODE_TILES_MXFP4 if mxfp4 else DECODE_TILES
    small = num_rows < SMALL_GROUP_ROWS * num_groups
    return for_weights(DOWN_SMALL_GROUPS if small else DOWN_DEFAULT, mxfp4)


def _height(count: jax.Array, block_m: int, tail: int) -> jax.Array:
    """MMA rows a program with `count` rows runs (the kernel's `run` picks the same): tail, block_m, or
    block_m + tail (merged)."""
    return jnp.where(count <= tail, tail, jnp.where(count <= block_m, block_m, block_m + tail))


def _row_tiling(sizes: jax.Array, block_m: int, tail: int) -> tuple[jax.Array, jax.Array]:
    """(tiles, stride) per group for merged tails: the cheaper in MMA rows of two cuts, a tie going to (a).

    (a) block_m-row tiles, a remainder of at most `tail` rows joining the last of them;
    (b) tiles of block_m + tail rows (two MMAs each).
    A tile's cost is the height its program runs (`_height`). At 146 rows, block_m 128, tail 32 both give one
    160-row tile; at 585 rows (b) gives 3 x 160 + 128 against 5 x 128; at 256 rows (a) gives 2 x 128.
    """
    full = (sizes + block_m - 1) // block_m
    last = sizes - (full - 1) * block_m  # rows of the last block_m tile
    merge = (full >= 2) & (last <= tail)
    tiles_a = full - merge
    cost_a = jnp.where(merge, (full - 1) * block_m + tail, (full - 1) * block_m + _height(last, block_m, tail))
    stride_b = block_m + tail
    tiles_b = (sizes + stride_b - 1) // stride_b
    cost_b = (tiles_b - 1) * stride_b + _height(sizes - (tiles_b - 1) * stride_b, block_m, tail)
    use_b = cost_b < cost_a
    return jnp.where(use_b, tiles_b, tiles_a), jnp.where(use_b, stride_b, block_m)


def group_bounds(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(starts, sizes) int32 [E + 1] of each group's rows, sizes clipped to num_rows; the extra
    group E holds the rows past sum(group_sizes) (a virtual expert whose rows come out zero)."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)
    sizes = jnp.concatenate([jnp.diff(ends, prepend=0), num_rows - ends[-1:]]).astype(jnp.int32)
    return jnp.cumsum(sizes) - sizes, sizes


def tile_programs(tiles: jax.Array, num_n_blocks: int, num_programs: int):
    """Programs numbered over groups' row tiles: (group, local tile, column block, valid) for
    programs 0 .. num_programs - 1, given each group's tile count [E + 1]. Groups in
    order; inside a group column-block-major with the row tiles fastest, so co-resident programs
    share a weight block. Programs past the last tile get valid False (group clamped to E)."""
    tile_off = jnp.cumsum(tiles) - tiles  # first tile of each group
    prog_end = (tile_off + tiles) * num_n_blocks  # programs of group g: [tile_off[g] * NB, prog_end[g])
    p = jnp.arange(num_programs, dtype=jnp.int32)
    grp = jnp.sum(p[:, None] >= prog_end[None, :], axis=1, dtype=jnp.int32)  # empty groups are skipped
    num_groups = tiles.shape[0] - 1
    valid = grp <= num_groups
    grp = jnp.minimum(grp, num_groups)
    q = p - tile_off[grp] * num_n_blocks
    per = jnp.maximum(tiles[grp], 1)
    return grp, q % per, q // per, valid


def _schedule(group_sizes: jax.Array, num_rows: int, block_m: int, num_n_blocks: int,
              merge_rows: int = 0) -> jax.Array:
    """int32 [P, 4] table, one row per program: (row_start, row_end, expert, n_block).

    Each expert's rows are cut into block_m-row tiles, or with merge_rows > 0 as `_row_tiling` picks; an
    expert's last tile takes the rest. Rows past sum(group_sizes) form a virtual expert E whose tiles store
    zeros. The table is sized for the worst case, P = (cdiv(M, bm) + E) * n_blocks (merged cuts have no more
    tiles); programs past the real tiles get row_start == row_end (idle). Written as closed-form broadcasts
    over [P] x [E+1] (no sort, scatter or search loop), so XLA fuses it into a couple of tiny kernels.
    """
    num_groups = group_sizes.shape[0]
    starts, sizes = group_bounds(group_sizes, num_rows)
    if merge_rows:
        tiles, stride = _row_tiling(sizes, block_m, merge_rows)
    else:
        tiles, stride = (sizes + block_m - 1) // block_m, jnp.full_like(sizes, block_m)
    num_programs = (pl.cdiv(num_rows, block_m) + num_groups) * num_n_blocks
    grp, local, n_block, valid = tile_programs(tiles, num_n_blocks, num_programs)
    row_start = starts[grp] + local * stride[grp]
    group_end = starts[grp] + sizes[grp]
    per = jnp.maximum(tiles[grp], 1)
    row_end = jnp.where(local == per - 1, group_end, row_start + stride[grp])  # the last tile takes the rest
    row_start = jnp.where(valid, row_start, 0)
    row_end = jnp.where(valid, row_end, 0)
    return jnp.stack([row_start, row_end, grp, jnp.where(valid, n_block, 0)], axis=1).astype(jnp.int32)


def _merge_rows(cfg: TileConfig) -> int:
    return cfg.tail_m if cfg.merge_tail else 0




def mma_rows(group_sizes: jax.Array, num_rows: int, cfg: TileConfig) -> jax.Array:
    """Rows of MMA work the kernel runs per column block (each tile at its height), rows past the groups
    excluded: the useful rows are sum(group_sizes), the rest is padding of partial tiles."""
    table = _schedule(group_sizes, max(num_rows, cfg.block_m), cfg.block_m, 1, _merge_rows(cfg))
    count = table[:, 1] - table[:, 0]
    height = _height(count, cfg.block_m, cfg.tail_m or 0)
    return jnp.sum(jnp.where((count > 0) & (table[:, 2] < group_sizes.shape[0]), height, 0))


def situ_f32(g: jax.Array, u: jax.Array, beta: float, linear_beta: float | None, approx: bool) -> jax.Array:
    """SiTU in fp32; sigmoid(g) = 1 / (1 + exp(-g)) (accurate in relative terms for any g).

    Exact: libdevice __nv_tanhf, expf and an IEEE division. With ``approx``: the PTX tanh.approx.f32
    instruction (one MUFU op, max relative error ~2^-11, below the bf16 output's rounding of 2^-9) and the
    sigmoid from ex2.approx and rcp.approx (``ptx_math.sigmoid``, ~1e-6 relative; 4 instructions instead of
    ~18). sigmoid is not taken from tanh.approx: (1 + tanh(g/2)) / 2 would lose all relative accuracy for
    strongly negative gates.
    """
    tanh = pltr.approx_tanh if approx else jnp.tanh
    sigmoid = ptx_math.sigmoid if approx else (lambda x: 1.0 / (1.0 + jnp.exp(-x)))
    gate = beta * tanh(g * (1.0 / beta)) * sigmoid(g)
    up = u if linear_beta is None else linear_beta * tanh(u * (1.0 / linear_beta))
    return gate * up


def _weight_tile(w_refs, grp, n0, k0, bn: int, bk: int, dtype, fragment: bool, kn: bool) -> jax.Array:
    """The [bn, bk] weight tile of expert grp at (n0, k0) ([bk, bn] when the weights are stored [E, K, N],
    ``kn``): a plain load, or packed codes + scales decoded (in fragment order when x's columns are)."""
    if len(w_refs) == 1:
        if kn:
            return w_refs[0][grp, pl.ds(k0, bk), pl.ds(n0, bn)]
        return w_refs[0][grp, pl.ds(n0, bn), pl.ds(k0, bk)]
    packed_ref, scale_ref = w_refs
    packed = packed_ref[grp, pl.ds(n0, bn), pl.ds(pl.multiple_of(k0 // 2, bk // 2), bk // 2)]
    scale = scale_ref[grp, pl.ds(n0, bn), pl.ds(pl.multiple_of(k0 // BLOCK, bk // BLOCK), bk // BLOCK)]
    return decode_tile(packed, scale, dtype, fragment)


def _kernel(meta_ref, x_ref, *refs, num_rows, num_groups, cfg: TileConfig, fused: bool, mxfp4: bool, beta,
            linear_beta, approx: bool, fragment: bool, kn: bool):
    per_weight = 2 if mxfp4 else 1  # refs: (packed, scale) per MXFP4 weight, else one array
    w1_refs = refs[:per_weight]
    w3_refs = refs[per_weight:2 * per_weight] if fused else None
    o_ref = refs[-1]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    num_k = x_ref.shape[1] // bk
    pid = pl.program_id(0)
    row_start = meta_ref[pid, 0]
    row_end = meta_ref[pid, 1]
    grp = meta_ref[pid, 2]
    n0 = pl.multiple_of(meta_ref[pid, 3] * bn, bn)
    active = row_start < row_end
    w_contract = 0 if kn else 1  # the weight tile's k axis: [bk, bn] or [bn, bk]

    def mma(xt, wt):
        if cfg.weights_lhs:  # [bn, rows]
            return jax.lax.dot_general(wt, xt, (((w_contract,), (1,)), ((), ())), preferred_element_type=F32)
        return jax.lax.dot_general(xt, wt, (((1,), (w_contract,)), ((), ())), preferred_element_type=F32)

    def tile(heights: tuple[int, ...], compute: bool):
        """Load sum(heights) rows from an in-bounds start, as one MMA operand per height (a merged tile is
        (block_m, tail_m): Triton tiles are powers of two); store only rows [row_start, row_end)."""
        load_start = jnp.minimum(row_start, num_rows - sum(heights))
        offsets = [sum(heights[:i]) for i in range(len(heights))]
        if not compute:  # rows past sum(group_sizes)
            for h, off in zip(heights, offsets):
                store_part(load_start + off, h, jnp.zeros((h, bn), o_ref.dtype))
            return

        def body(k, accs):
            k0 = pl.multiple_of(k * bk, bk)
            xts = [x_ref[pl.ds(load_start + off, h), pl.ds(k0, bk)] for h, off in zip(heights, offsets)]
            new = []
            for i, w_refs in enumerate((w1_refs, w3_refs) if fused else (w1_refs,)):
                wt = _weight_tile(w_refs, grp, n0, k0, bn, bk, xts[0].dtype, fragment, kn)  # once for all parts
                new.append(tuple(acc + mma(xt, wt) for acc, xt in zip(accs[i], xts)))
            return tuple(new)

        zeros = tuple(jnp.zeros((bn, h) if cfg.weights_lhs else (h, bn), F32) for h in heights)
        accs = jax.lax.fori_loop(0, num_k, body, (zeros, zeros) if fused else (zeros,))
        for part, (h, off) in enumerate(zip(heights, offsets)):
            if fused:
                out = situ_f32(accs[0][part], accs[1][part], beta, linear_beta, approx)
            else:
                out = accs[0][part]
            out = out.astype(o_ref.dtype)
            store_part(load_start + off, h, out.T if cfg.weights_lhs else out)

    def store_part(start, height: int, value):
        rows = start + jax.lax.broadcasted_iota(jnp.int32, (height, bn), 0)
        mask = (rows >= row_start) & (rows < row_end)
        pltr.store(o_ref.at[pl.ds(start, height), pl.ds(n0, bn)], value, mask=mask)

    def run(compute: bool):
        """One tile shape per program, picked by its row count (tile shapes are static in Triton)."""
        if not cfg.tail_m:
            return tile((bm,), compute)
        count = row_end - row_start
        short = count <= cfg.tail_m
        pl.when(short)(lambda: tile((cfg.tail_m,), compute))
        pl.when(~short & (count <= bm))(lambda: tile((bm,), compute))
        if cfg.merge_tail:
            pl.when(count > bm)(lambda: tile((bm, cfg.tail_m), compute))

    real = grp < num_groups
    pl.when(active & real)(lambda: run(True))
    pl.when(active & ~real)(lambda: run(False))  # rows past sum(group_sizes)


def _check(x, ws, group_sizes, cfg: TileConfig, kn: bool = False) -> tuple[bool, int]:
    """Validate shapes and tiles; (whether the weights are MXFP4-packed, N)."""
    m, k = x.shape
    mxfp4 = isinstance(ws[0], MXFP4Experts)
    k_axis, layout = (1, f"[E, {k}, N]") if kn else (2, f"[E, N, {k}]")
    for name, w in zip(("w1", "w3"), ws):
        if isinstance(w, MXFP4Experts) != mxfp4:
            raise ValueError(f"{name}: gate and up weights must both be MXFP4Experts or both arrays")
        if kn and mxfp4:
            raise ValueError(f"{name}: weights_kn=True takes dense weights; MXFP4 ones are stored [E, N, K/2]")
        if (len(w.shape) != 3 or w.shape[k_axis] != k or w.shape[0] != group_sizes.shape[0]
                or w.shape != ws[0].shape):
            raise ValueError(f"{name} must be {layout} with E={group_sizes.shape[0]} (decoded shape); got {w.shape}")
        if mxfp4 and w.scale.shape != (*w.shape[:2], k // BLOCK):
            raise ValueError(f"{name}: MXFP4 scale must be {(*w.shape[:2], k // BLOCK)}, got {w.scale.shape}")
    n = ws[0].shape[2 if kn else 1]
    if k % cfg.block_k or n % cfg.block_n:
        raise ValueError(f"K={k} and N={n} must be multiples of block_k={cfg.block_k} / block_n={cfg.block_n}")
    if cfg.tail_m is not None and not (16 <= cfg.tail_m < cfg.block_m and cfg.tail_m & (cfg.tail_m - 1) == 0):
        raise ValueError(f"tail_m={cfg.tail_m}: must be a power of two in [16, block_m={cfg.block_m})")
    if cfg.merge_tail and not (cfg.tail_m and cfg.weights_lhs):
        raise ValueError(f"merge_tail needs tail_m and weights_lhs (the tail rows as the MMA's N); got {cfg.label()}")
    if mxfp4 and cfg.block_k % BLOCK:
        raise ValueError(f"block_k={cfg.block_k}: MXFP4 weights need a multiple of {BLOCK} (one scale per {BLOCK})")
    if m == 0:
        raise ValueError("x has no rows")
    return mxfp4, n


def _grouped_call(x, ws, group_sizes, *, cfg: TileConfig, fused: bool, beta, linear_beta, out_dtype,
                  interpret: bool, approx: bool = False, fragment: bool = False, kn: bool = False):
    mxfp4, n = _check(x, ws, group_sizes, cfg, kn)
    if fragment and not mxfp4:
        raise ValueError("x_fragment_order=True is for MXFP4 weights (mxfp4_order.py); these are dense")
    m0, _ = x.shape
    tallest = cfg.block_m + _merge_rows(cfg)
    if m0 < tallest:  # tiny inputs: pad rows so the tallest row tile is always in bounds
        x = jnp.pad(x, ((0, tallest - m0), (0, 0)))
    m = x.shape[0]
    num_n_blocks = n // cfg.block_n
    meta = _schedule(group_sizes, m, cfg.block_m, num_n_blocks, _merge_rows(cfg))
    kernel = functools.partial(_kernel, num_rows=m, num_groups=group_sizes.shape[0], cfg=cfg, fused=fused,
                               mxfp4=mxfp4, beta=beta, linear_beta=linear_beta, approx=approx and not interpret,
                               fragment=fragment, kn=kn)
    operands = [a for w in ws for a in ((w.packed, w.scale) if mxfp4 else (w,))]
    name = "k3_moe_gate_up_situ" if fused else "k3_moe_grouped_matmul"
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(meta.shape[0],),
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=name + ("_mxfp4" if mxfp4 else ""),
    )(meta, x, *operands)
    return out[:m0]


@functools.partial(jax.jit, static_argnames=("beta", "linear_beta", "cfg", "out_dtype", "interpret", "approx_situ",
                                             "x_fragment_order"))
def grouped_gate_up_situ(
    x: jax.Array, w1: Weight, w3: Weight, group_sizes: jax.Array, *, beta: float = 4.0,
    linear_beta: float | None = 25.0, cfg: TileConfig | None = None, out_dtype=None, interpret: bool = False,
    approx_situ: bool = True, x_fragment_order: bool = False,
) -> jax.Array:
    """SiTU(x @ w1_e^T, x @ w3_e^T) for rows grouped by expert. x [M, K]; w1, w3 [E, F, K] -> [M, F].

    cfg: None picks `gate_up_config(M, E, packed)`. approx_situ: the epilogue's two tanh terms use the hardware
    tanh.approx.f32 and its sigmoid ex2.approx / rcp.approx (GPU only; interpret mode always runs the exact
    ops). The tanh alone was ~6% faster on the H200 at K3 shapes with the same error against an fp32 reference
    (1.66e-3, dominated by the bf16 output); with the sigmoid too the kernel ran 520.7 against 494.5 TFLOP/s
    exact, in one job (benchmarks/RESULTS.md, seventh run). Pass False for the libdevice ops. (Stages 3 vs 4
    differ by less than run-to-run noise, about 3%.)
    x_fragment_order: x's columns are x[:, mxfp4_order.fragment_order(K, cfg.block_k)] (MXFP4 weights only);
    the weight tiles are then decoded in that order, sparing the byte-by-byte gather of the packed codes.
    """
    cfg = cfg or gate_up_config(x.shape[0], w1.shape[0], isinstance(w1, MXFP4Experts))
    return _grouped_call(x, (w1, w3), group_sizes, cfg=cfg, fused=True, beta=beta, linear_beta=linear_beta,
                         out_dtype=out_dtype or x.dtype, interpret=interpret, approx=approx_situ,
                         fragment=x_fragment_order)


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "interpret", "x_fragment_order", "weights_kn"))
def grouped_matmul(
    x: jax.Array, w: Weight, group_sizes: jax.Array, *, cfg: TileConfig | None = None, out_dtype=None,
    interpret: bool = False, x_fragment_order: bool = False, weights_kn: bool = False,
) -> jax.Array:
    """x @ w_e^T for rows grouped by expert (fp32 accumulation). x [M, K]; w [E, N, K] -> [M, N].

    cfg: None picks `down_config(M, E, packed)`. x_fragment_order: as in `grouped_gate_up_situ`.
    weights_kn: w is [E, K, N] and the result x @ w_e (dense weights): the backward multiplies by the forward's
    weights untransposed (dh = dy W2_e with W2 [E, out, F]), and loading [bk, bn] tiles of them costs nothing
    where a transposed copy would read and write the whole layer."""
    cfg = cfg or down_config(x.shape[0], w.shape[0], isinstance(w, MXFP4Experts))
    return _grouped_call(x, (w,), group_sizes, cfg=cfg, fused=False, beta=None, linear_beta=None,
                         out_dtype=out_dtype or x.dtype, interpret=interpret, fragment=x_fragment_order,
                         kn=weights_kn)


# ---- transposed grouped GEMM (weight gradients): contraction over each group's rows ---------------------


def _tn_kernel(bounds_ref, a_ref, b_ref, o_ref, *, num_rows, bm, bp, bq):
    """Program (e, i, j): o[e, i-block, j-block] = sum over rows r of group e of a[r, i-block]^T b[r, j-block]."""
    e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = bounds_ref[e, 0]
    end = bounds_ref[e, 1]
    p0 = pl.multiple_of(i * bp, bp)
    q0 = pl.multiple_of(j * bq, bq)

    def body(t, acc):
        r0 = start + t * bm
        load_start = jnp.minimum(r0, num_rows - bm)  # full bm-row loads stay in bounds; rows outside masked
        rows = load_start + jax.lax.broadcasted_iota(jnp.int32, (bm, bp), 0)
        keep = (rows >= r0) & (rows < end)
        # a masked load (zero-filled by the async copy), not a select after the load: a tile changed in
        # registers could not go from the async copy straight to the MMA's shared memory
        at = pltr.load(a_ref.at[pl.ds(load_start, bm), pl.ds(p0, bp)], mask=keep, other=0.0)
        bt = b_ref[pl.ds(load_start, bm), pl.ds(q0, bq)]
        dims = (((0,), (0,)), ((), ()))  # a [bm, bp]^T . b [bm, bq]
        return acc + jax.lax.dot_general(at, bt, dims, preferred_element_type=F32)

    num_t = (end - start + bm - 1) // bm
    acc = jax.lax.fori_loop(0, num_t, body, jnp.zeros((bp, bq), F32))  # empty group: zeros
    o_ref[e, pl.ds(p0, bp), pl.ds(q0, bq)] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "interpret"))
def grouped_matmul_tn(
    a: jax.Array, b: jax.Array, group_sizes: jax.Array, *, cfg: TileConfig | None = None, out_dtype=None,
    interpret: bool = False,
) -> jax.Array:
    """Per group e: a_e^T @ b_e (fp32 accumulation), the weight-gradient GEMM. a [M, P]; b [M, Q] -> [E, P, Q].

    Rows of a and b are grouped as in `grouped_matmul`; rows past sum(group_sizes) are ignored and empty
    groups give zeros (as `lax.ragged_dot_general` with a ragged contracting dimension). One program per
    (group, block_m x block_n output tile): cfg.block_m is the P tile, cfg.block_n the Q tile, cfg.block_k
    the row (contraction) tile. P, Q must be multiples of block_m, block_n. Rows of other groups are
    zeroed by a masked load of a: on the H200 (2026-11-30, dW1 at 28 experts x 16384 rows, 3072 x 3584,
    128 x 256 x 64 tiles) 0.87 ms (413 TFLOP/s), against 1.32 ms with a select after the load.
    """
    cfg = cfg or TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    (m0, p), (mb, q) = a.shape, b.shape
    bp, bq, bm = cfg.block_m, cfg.block_n, cfg.block_k
    if mb != m0 or p % bp or q % bq:
        raise ValueError(f"a {a.shape}, b {b.shape}: same rows, P % {bp} == 0 and Q % {bq} == 0 required")
    if m0 < bm:  # tiny inputs: pad rows so a full row tile is always in bounds
        a, b = (jnp.pad(z, ((0, bm - m0), (0, 0))) for z in (a, b))
    m = a.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m0)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    bounds = jnp.stack([starts, ends], axis=1).astype(jnp.int32)  # [E, 2]
    num_groups = group_sizes.shape[0]
    kernel = functools.partial(_tn_kernel, num_rows=m, bm=bm, bp=bp, bq=bq)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, p, q), out_dtype or a.dtype),
        grid=(num_groups, p // bp, q // bq),
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="k3_moe_grouped_matmul_tn",
    )(bounds, a, b)

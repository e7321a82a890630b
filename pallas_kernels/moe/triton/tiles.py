"""Tile configurations of the Triton grouped GEMMs, chosen from static shapes only (group sizes are data).

The choice follows the average rows per expert (the tuning: benchmarks/RESULTS.md):
* large groups (>= SMALL_GROUP_ROWS rows per expert): 128-row tiles;
* small groups: an expert's remainder tile is mostly padding, so a 32-row tail is merged into the full
  tile's program, with the weights as the MMA's left operand so that the tail rows are its N;
* decode-sized batches (`batch_size.is_decode_sized`): one 32-row tile per expert, 64 weight rows per
  program and one warpgroup, so each program decodes (MXFP4) its own weight rows once; with MXFP4
  weights also a 16-row tile for experts with at most 16 rows (the usual case in a decode step);
* MXFP4 weights at large groups: one warpgroup per program, so that two programs share an SM and one's
  tile decode overlaps the other's MMAs.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.moe.batch_size import is_decode_sized
from pallas_kernels.mxfp4 import BLOCK


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
    Each expert is cut the cheaper way (`schedule.row_tiling`): block_m tiles with a remainder of <= tail_m
    rows joining the last, or tiles of block_m + tail_m rows. At 146 rows per expert this is one 160-row
    program instead of a 128-row one and a 32-row one that repeats the whole k loop's weight traffic for a
    quarter of the MMA work.
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


GATE_UP_DEFAULT = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)
GATE_UP_SMALL_GROUPS = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                                  weights_lhs=True, tail_m=32, merge_tail=True)
DOWN_DEFAULT = TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4)
DOWN_SMALL_GROUPS = TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4,
                               weights_lhs=True, tail_m=32, merge_tail=True)
SMALL_GROUP_ROWS = 320  # average rows per expert below which the small-group configs are used
DECODE_TILES = TileConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4, weights_lhs=True)
DECODE_TILES_MXFP4 = dataclasses.replace(DECODE_TILES, tail_m=16)
GATE_UP_MXFP4 = TileConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3, weights_lhs=True)
TN_DEFAULT = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)  # weight gradients


def has_small_groups(num_rows: int, num_groups: int) -> bool:
    """Fewer than SMALL_GROUP_ROWS rows per expert on average."""
    return num_rows < SMALL_GROUP_ROWS * num_groups


def for_weights(cfg: TileConfig, mxfp4: bool) -> TileConfig:
    """MXFP4 weights go in as the MMA's left operand (their tiles are decoded in registers)."""
    return dataclasses.replace(cfg, weights_lhs=True) if mxfp4 else cfg


def gate_up_config(num_rows: int, num_groups: int, mxfp4: bool = False) -> TileConfig:
    """Tiles of the fused gate+up for `num_rows` rows over `num_groups` experts."""
    if is_decode_sized(num_rows, num_groups):
        return DECODE_TILES_MXFP4 if mxfp4 else DECODE_TILES
    if has_small_groups(num_rows, num_groups):
        return for_weights(GATE_UP_SMALL_GROUPS, mxfp4)
    return GATE_UP_MXFP4 if mxfp4 else GATE_UP_DEFAULT


def down_config(num_rows: int, num_groups: int, mxfp4: bool = False, backward: bool = False) -> TileConfig:
    """As `gate_up_config`, for the down projection. backward: for the backward's grouped GEMMs, which keep
    the small-group tiles at decode sizes (the decode tiles were tuned for the forward only)."""
    if is_decode_sized(num_rows, num_groups) and not backward:
        return DECODE_TILES_MXFP4 if mxfp4 else DECODE_TILES
    small = has_small_groups(num_rows, num_groups)
    return for_weights(DOWN_SMALL_GROUPS if small else DOWN_DEFAULT, mxfp4)


def fit_config(cfg: TileConfig, k: int, n: int, *, mxfp4: bool = False) -> TileConfig:
    """cfg fitted to a GEMM with contraction K and output width N: the MXFP4 operand order for packed
    weights (`for_weights`), and block_k / block_n halved (powers of two) until they divide K / N.

    block_n stays >= 16; block_k stays >= 16 (BLOCK for MXFP4 weights: one scale byte per BLOCK inputs)
    and starts there if cfg's is smaller. Raises if no block divides."""
    cfg = for_weights(cfg, mxfp4)
    k_multiple = BLOCK if mxfp4 else 16

    def fit(block: int, dim: int, name: str, floor: int) -> int:
        while block >= floor and dim % block:
            block //= 2
        if block < floor:
            raise ValueError(f"{name}={dim} is not a multiple of {floor}: the Triton grouped GEMM needs that")
        return block

    block_k = fit(max(cfg.block_k, k_multiple), k, "K", k_multiple)
    return dataclasses.replace(cfg, block_k=block_k, block_n=fit(cfg.block_n, n, "N", 16))


def fit_tn_config(cfg: TileConfig, p: int, q: int) -> TileConfig:
    """Tiles for `grouped_matmul_tn` (block_m: P tile, block_n: Q tile, block_k: row tile) dividing P and Q."""
    fitted = fit_config(dataclasses.replace(cfg, block_k=cfg.block_m), p, q)  # fit shrinks block_k / block_n
    return dataclasses.replace(fitted, block_m=fitted.block_k, block_k=cfg.block_k)

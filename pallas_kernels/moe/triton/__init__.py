"""The routed experts' grouped GEMMs in Pallas-Triton: tile configs, work table, kernel, entry points."""

from pallas_kernels.moe.triton.grouped_gemm import grouped_gate_up_situ, grouped_matmul
from pallas_kernels.moe.triton.grouped_matmul_tn import grouped_matmul_tn
from pallas_kernels.moe.triton.schedule import mma_rows, schedule
from pallas_kernels.moe.triton.tiles import (
    DECODE_TILES, DECODE_TILES_MXFP4, DOWN_DEFAULT, DOWN_SMALL_GROUPS, GATE_UP_DEFAULT, GATE_UP_MXFP4,
    GATE_UP_SMALL_GROUPS, SMALL_GROUP_ROWS, TN_DEFAULT, TileConfig, down_config, fit_config, fit_tn_config,
    for_weights, gate_up_config,
)

__all__ = [
    "DECODE_TILES", "DECODE_TILES_MXFP4", "DOWN_DEFAULT", "DOWN_SMALL_GROUPS", "GATE_UP_DEFAULT", "GATE_UP_MXFP4",
    "GATE_UP_SMALL_GROUPS", "SMALL_GROUP_ROWS", "TN_DEFAULT", "TileConfig", "down_config", "fit_config",
    "fit_tn_config", "for_weights", "gate_up_config", "grouped_gate_up_situ", "grouped_matmul",
    "grouped_matmul_tn", "mma_rows", "schedule",
]

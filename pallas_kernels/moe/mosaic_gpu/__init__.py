"""The routed experts' grouped GEMMs in Mosaic GPU (Hopper): bf16 gate+up and plain products, and the
gate+up that decodes MXFP4 weights in registers."""

from pallas_kernels.moe.mosaic_gpu.gate_up_mxfp4 import gate_up_situ_mxfp4_mgpu, x_column_order
from pallas_kernels.moe.mosaic_gpu.grouped_gemm import (
    GATE_UP_COLS, PLAIN_COLS, TAIL_ROWS, gate_up_situ_mgpu, grouped_matmul_mgpu,
)
from pallas_kernels.moe.mosaic_gpu.work import sm_count

__all__ = ["GATE_UP_COLS", "PLAIN_COLS", "TAIL_ROWS", "gate_up_situ_mgpu", "gate_up_situ_mxfp4_mgpu",
           "grouped_matmul_mgpu", "sm_count", "x_column_order"]

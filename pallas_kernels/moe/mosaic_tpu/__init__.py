"""The routed experts' grouped GEMMs as Mosaic TPU kernels, and the "mosaic_tpu" implementation on them."""

from pallas_kernels.moe.mosaic_tpu.grouped_gemm import tpu_grouped_gate_up_situ, tpu_grouped_matmul

__all__ = ["tpu_grouped_gate_up_situ", "tpu_grouped_matmul"]

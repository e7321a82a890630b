"""Routed-expert SiTU-GLU MLPs (grouped GEMMs) with pure-JAX references."""

from pallas_kernels.moe.api import routed_experts
from pallas_kernels.moe.reference import MXFP4Experts, decode_experts, experts_all_dense, experts_ragged_dot

__all__ = ["MXFP4Experts", "decode_experts", "routed_experts", "experts_all_dense", "experts_ragged_dot"]

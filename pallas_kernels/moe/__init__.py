"""Routed-expert SiTU-GLU MLPs (grouped GEMMs) with pure-JAX references."""

from pallas_kernels.moe.api import routed_experts
from pallas_kernels.moe.reference import experts_all_dense, experts_ragged_dot

__all__ = ["routed_experts", "experts_all_dense", "experts_ragged_dot"]

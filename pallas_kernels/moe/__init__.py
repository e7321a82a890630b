"""Routed-expert SiTU-GLU MLPs (grouped GEMMs): the public entry points, the implementation table, and
the pure-JAX references."""

from pallas_kernels.moe.api import grouped_mlp, routed_experts
from pallas_kernels.moe.dispatch import IMPLEMENTATIONS, choose_implementation
from pallas_kernels.moe.reference import experts_all_dense, experts_ragged_dot
from pallas_kernels.mxfp4 import MXFP4Experts, decode_experts

__all__ = ["IMPLEMENTATIONS", "MXFP4Experts", "choose_implementation", "decode_experts", "experts_all_dense",
           "experts_ragged_dot", "grouped_mlp", "routed_experts"]

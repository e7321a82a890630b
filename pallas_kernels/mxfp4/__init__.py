"""MXFP4, the release's format for routed-expert weights: the codec, the packed-experts pytree, and the
in-register tile decode the Triton kernels use."""

from pallas_kernels.mxfp4.codec import BLOCK, check_mxfp4, decode_mxfp4, decode_mxfp4_jax, encode_mxfp4
from pallas_kernels.mxfp4.experts import MXFP4Experts, decode_experts
from pallas_kernels.mxfp4.tile import decode_tile

__all__ = ["BLOCK", "MXFP4Experts", "check_mxfp4", "decode_experts", "decode_mxfp4", "decode_mxfp4_jax",
           "decode_tile", "encode_mxfp4"]

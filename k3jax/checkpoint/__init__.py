"""Reading Hugging Face release checkpoints (safetensors headers, MXFP4 experts) without torch."""

from k3jax.checkpoint.safetensors_index import CheckpointError, CheckpointIndex, TensorInfo
from pallas_kernels.mxfp4 import decode_mxfp4, decode_mxfp4_jax, encode_mxfp4

__all__ = [
    "CheckpointError",
    "CheckpointIndex",
    "TensorInfo",
    "decode_mxfp4",
    "decode_mxfp4_jax",
    "encode_mxfp4",
]

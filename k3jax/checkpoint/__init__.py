"""The checkpoint formats on disk, below everything that builds models or conversions from them.

A Hugging Face release, read without torch: shard headers and byte ranges (`safetensors_index`),
release tensor names <-> model leaves (`names`), the plan of every leaf from the headers (`release_plan`),
the one transform that makes a leaf's array (`transform`, `region` for one device's slice of it),
and a writer of random releases (`release_writer`). A converted directory: per-item Orbax
checkpoints, manifest, checksums and the COMPLETE marker (`store`, `checksum`).
"""

from k3jax.checkpoint.safetensors_index import CheckpointError, CheckpointIndex, TensorInfo

__all__ = [
    "CheckpointError",
    "CheckpointIndex",
    "TensorInfo",
]

"""`from_pretrained`: the one call that turns a release directory into a ready model."""

from __future__ import annotations

from pathlib import Path

from k3jax.checkpoint.hf_loader import load_hf_model
from k3jax.model import K3Model

_DTYPES = ("bfloat16", "float32")


def from_pretrained(path: str | Path, *, dtype: str = "bfloat16", moe_implementation: str = "auto") -> K3Model:
    """Load a Hugging Face K3 release directory (config.json, safetensors index and shards).

    `dtype` is the storage and activation dtype of the bf16 tensors (fp32 tensors such as the KDA
    state parameters and the router bias stay fp32).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {_DTYPES}")
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json; expected a Hugging Face release directory")
    return load_hf_model(root, dtype=dtype, moe_implementation=moe_implementation)

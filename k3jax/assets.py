"""Files that ship inside the k3jax package, found with importlib.resources so an installed wheel
needs no checkout.

`k3jax/configs` is a link to the repository's `configs/` and `k3jax/tiny_k3` to the tiny K3
checkpoint in the exact release format that the golden tests use (`tests/golden/k3-tiny-a`:
config, index and safetensors shards, MXFP4 experts included): one copy of each, package data of
the wheel (pyproject.toml).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def packaged_config(name: str) -> dict:
    """A config shipped with k3jax (`configs/<name>.json`), e.g. "k3_tiny", "kimi_k3"."""
    path = resources.files("k3jax").joinpath("configs", f"{name}.json")
    if not path.is_file():
        raise FileNotFoundError(f"no packaged config {name!r} (configs/{name}.json)")
    return json.loads(path.read_text())


def tiny_checkpoint() -> Path:
    """The directory of the tiny K3 checkpoint (release format) that ships with k3jax."""
    return Path(str(resources.files("k3jax").joinpath("tiny_k3")))

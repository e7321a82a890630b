"""Load a converted directory (see `store`) into a K3Model: only a COMPLETE conversion loads.

Items are restored one at a time to host, moved to the device and dropped, so host memory stays at
about one item; the scan groups are then stacked on device by `assemble_model`. Leaves are cast to
the requested dtype, so a float32 conversion loads as bfloat16 too (and bfloat16 experts load
exactly as float32).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.config import K3Config
from k3jax.convert.assemble import assemble_model
from k3jax.convert.plan import abstract_items
from k3jax.convert.store import ItemStore, read_complete_manifest
from k3jax.model import K3Model


def load_converted(path: str | Path, *, dtype: str = "bfloat16", moe_implementation: str = "auto") -> K3Model:
    root = Path(path)
    return load_items(root, read_complete_manifest(root), dtype=dtype, moe_implementation=moe_implementation)


def load_items(root: Path, manifest: dict, *, dtype: str, moe_implementation: str = "auto") -> K3Model:
    """Build the model from the items `manifest` lists (`--verify` calls this before COMPLETE exists)."""
    cfg = K3Config.from_hf(root, dtype=dtype)
    abstract = nnx.eval_shape(lambda: K3Model.init(cfg, moe_implementation=moe_implementation))
    store = ItemStore(root)
    arrays = {}
    for item, slots in abstract_items(abstract).items():
        recorded = manifest["items"].get(item)
        if recorded is None:
            raise CheckpointError(f"{root}: the manifest has no item {item!r} that this model needs")
        expected = {slot.target: tuple(leaf.shape) for slot, leaf in slots.items()}
        found = {name: tuple(record["shape"]) for name, record in recorded.items()}
        if found != expected:
            diff = sorted(set(found.items()) ^ set(expected.items()))
            raise CheckpointError(f"{root}: item {item!r} does not match the model's leaves: {diff[:3]}")
        leaves = store.restore(item)
        for slot, leaf in slots.items():
            array = leaves.pop(slot.target, None)
            if array is None or array.shape != leaf.shape:
                raise CheckpointError(f"{store.path(item)}: leaf {slot.target!r} is missing or mis-shaped on disk")
            arrays[(item, slot.target)] = jnp.asarray(array, dtype=leaf.dtype)
    return assemble_model(abstract, lambda item, target: arrays.pop((item, target)))

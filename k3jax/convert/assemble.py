"""Fill an abstract K3Model from per-item leaves, stacking the scan groups back together.

Items hold one decoder layer each; the model stacks the layers of a scan group on a leading axis.
Both loaders (HF release and converted directory) go through here, so the stacking order is
defined once, by `plan.model_slots`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.convert.plan import model_slots, path_names
from k3jax.model import K3Model

Stack = Callable[[list, jax.ShapeDtypeStruct, tuple], jax.Array]


def _stack_here(arrays: list, leaf: jax.ShapeDtypeStruct, key_path: tuple) -> jax.Array:
    return jnp.stack(arrays)


def assemble_model(
    abstract: K3Model, fetch: Callable[[str, str], np.ndarray | jax.Array], stack: Stack = _stack_here
) -> K3Model:
    """`fetch(item, leaf)` gives one per-layer array; it is called once per slot, in model leaf order.

    `stack(arrays, abstract_leaf, key_path)` joins the layers of a scan-group leaf (the mesh loader
    passes one that stacks straight into the leaf's NamedSharding)."""

    def fill(key_path, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        path = path_names(key_path)
        arrays = [jnp.asarray(fetch(slot.item, slot.target), dtype=leaf.dtype)
                  for slot in model_slots(path, abstract.plan)]
        return stack(arrays, leaf, key_path) if path[0] == "group_layers" else arrays[0]

    return jax.tree_util.tree_map_with_path(fill, abstract)

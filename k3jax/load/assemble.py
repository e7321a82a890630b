"""The one loading road, for a Hugging Face release and a converted directory alike.

    abstract model -> per item: the source's leaves (planned, materialised; on a mesh, straight
    into each piece's sharding) -> assembled into the model (scan groups stacked) -> placed on the mesh

A source only says how to make one item's leaves (`ReadItem`); everything else is here, once: the
order of items and leaves and the stacking of scan groups (`checkpoint.names`), the shardings
(`placement`), the cast to each leaf's dtype, and expert (context) parallelism on a mesh that splits
experts (the MLA cache's positions).
Without a mesh, each item's leaves go to the device as soon as they are made, so the host holds
about one item at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from k3jax.checkpoint.names import Slot, abstract_items, model_slots, path_names
from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.load.placement import check_mesh, leaf_shardings, slot_shardings, stack_into
from k3jax.model import K3Model
from sharding import enable_context_parallelism, enable_expert_parallelism

# (item, its leaves' slots and per-layer abstract arrays, each leaf's sharding or None without a mesh)
# -> {leaf name: array}: host arrays, or jax.Arrays already in the given shardings.
ReadItem = Callable[[str, dict[Slot, jax.ShapeDtypeStruct], dict[str, NamedSharding] | None],
                    dict[str, np.ndarray | jax.Array]]


def load_model(abstract: K3Model, read_item: ReadItem, mesh: Mesh | None = None) -> K3Model:
    """Fill `abstract` item by item from `read_item`; on `mesh`, every leaf in its NamedSharding."""
    if mesh is not None:
        check_mesh(abstract.config, mesh)
    shardings = None if mesh is None else slot_shardings(abstract, mesh)
    arrays: dict[tuple[str, str], jax.Array] = {}
    for item, slots in abstract_items(abstract).items():
        placed = None if shardings is None else {slot.target: shardings[(item, slot.target)] for slot in slots}
        leaves = read_item(item, slots, placed)
        for slot, leaf in slots.items():
            array = leaves.pop(slot.target, None)
            if array is None or tuple(array.shape) != tuple(leaf.shape):
                raise CheckpointError(f"item {item!r}: leaf {slot.target!r} is missing, or not of shape "
                                      f"{list(leaf.shape)}")
            arrays[(item, slot.target)] = array if mesh is not None else jnp.asarray(array, dtype=leaf.dtype)
        del leaves

    def fetch(item: str, target: str) -> jax.Array:
        return arrays.pop((item, target))  # each piece dropped as soon as it is placed in the model

    if mesh is None:
        return assemble_model(abstract, fetch)
    by_path = leaf_shardings(abstract, mesh)

    def stack(pieces: list, leaf: jax.ShapeDtypeStruct, key_path: tuple) -> jax.Array:
        return stack_into(by_path[jax.tree_util.keystr(key_path)])(*pieces)

    model = assemble_model(abstract, fetch, stack)
    enable_expert_parallelism(model, mesh)
    enable_context_parallelism(model, mesh)
    return model


Stack = Callable[[list, jax.ShapeDtypeStruct, tuple], jax.Array]


def _stack_here(arrays: list, leaf: jax.ShapeDtypeStruct, key_path: tuple) -> jax.Array:
    return jnp.stack(arrays)


def assemble_model(
    abstract: K3Model, fetch: Callable[[str, str], np.ndarray | jax.Array], stack: Stack = _stack_here
) -> K3Model:
    """`fetch(item, leaf)` gives one per-layer array; it is called once per slot, in model leaf order,
    and cast to the leaf's dtype. `stack(arrays, abstract_leaf, key_path)` joins the layers of a
    scan-group leaf."""

    def fill(key_path, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        path = path_names(key_path)
        arrays = [jnp.asarray(fetch(slot.item, slot.target), dtype=leaf.dtype)
                  for slot in model_slots(path, abstract.plan)]
        return stack(arrays, leaf, key_path) if path[0] == "group_layers" else arrays[0]

    return jax.tree_util.tree_map_with_path(fill, abstract)

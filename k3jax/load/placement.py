"""Where a model being loaded goes on a mesh: each leaf's NamedSharding and each per-layer piece's.

Shardings are `sharding.param_shardings` (DEFAULT_RULES) of the abstract model, so a model loaded
onto a mesh is placed exactly as `sharding.shard_model` places one. A scan-group leaf [G, ...] is
split by its spec; its per-layer pieces take that spec without the leading `layers` entry (which the
rules never split), so each piece can be read or restored straight into place and the pieces
stacked on device into the group leaf's sharding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from k3jax.checkpoint.names import model_slots, path_names
from k3jax.config import K3Config
from k3jax.model import K3Model
from sharding import DEFAULT_RULES, param_shardings


def check_mesh(cfg: K3Config, mesh: Mesh | AbstractMesh) -> None:
    """Refuse a mesh this config cannot run on, before anything is read: routed experts are split
    evenly over the rules' expert axis (a forward needs E / size experts per device). Heads and widths
    that an axis does not divide are replicated instead (`sharding.logical_to_spec`), which gives the
    same results, so they are not errors."""
    axis = DEFAULT_RULES["exp"]
    size = mesh.shape.get(axis, 1) if isinstance(axis, str) else 1
    if size > 1 and cfg.num_experts % size:
        raise ValueError(f"mesh axis {axis!r} has size {size}, which does not divide the config's "
                         f"num_experts={cfg.num_experts}: routed experts are split evenly over it")


def leaf_shardings(abstract: K3Model, mesh: Mesh) -> dict[str, NamedSharding]:
    """`jax.tree_util.keystr` of every model leaf's key path -> its NamedSharding."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    shardings = jax.tree.leaves(param_shardings(abstract, mesh))
    if len(leaves) != len(shardings):
        raise AssertionError("param_shardings does not mirror the model's leaves")
    return {jax.tree_util.keystr(key_path): sharding for (key_path, _), sharding in zip(leaves, shardings)}


def slot_shardings(abstract: K3Model, mesh: Mesh) -> dict[tuple[str, str], NamedSharding]:
    """(item, leaf) -> the NamedSharding of that per-layer piece."""
    found = {}
    by_path = leaf_shardings(abstract, mesh)
    for key_path, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        sharding, path = by_path[jax.tree_util.keystr(key_path)], path_names(key_path)
        if path[0] == "group_layers":
            sharding = NamedSharding(mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
        for slot in model_slots(path, abstract.plan):
            found[(slot.item, slot.target)] = sharding
    return found


@functools.lru_cache(maxsize=None)
def stack_into(sharding: NamedSharding):
    """A jitted stack of per-layer pieces straight into `sharding` (one per sharding; recompiled per shape)."""
    return jax.jit(lambda *pieces: jnp.stack(pieces), out_shardings=sharding)

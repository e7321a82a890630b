"""Sharded inference: a mesh from a short string, one logical->mesh rule table, and model/cache placement.

    mesh = make_mesh("expert=4,tensor=2")
    model = shard_model(model, mesh)            # or k3jax.from_pretrained(path, mesh="expert=4,tensor=2")
    logits = model(shard_batch(ids, mesh))      # jit + GSPMD partition the forward from the shardings
"""

from sharding.mesh import MESH_AXES, make_mesh
from sharding.rules import DEFAULT_RULES, logical_to_spec
from sharding.shard_model import (
    cache_shardings, enable_expert_parallelism, param_shardings, shard_batch, shard_cache, shard_model,
)

__all__ = [
    "DEFAULT_RULES", "MESH_AXES", "cache_shardings", "enable_expert_parallelism", "logical_to_spec", "make_mesh", "param_shardings",
    "shard_batch", "shard_cache", "shard_model",
]

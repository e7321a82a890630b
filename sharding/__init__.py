"""Sharded inference: a mesh from a short string, one logical->mesh rule table, and model/cache placement.

    mesh = make_mesh("expert=4,tensor=2")
    model = shard_model(model, mesh)            # or k3jax.from_pretrained(path, mesh="expert=4,tensor=2")
    logits = model(shard_batch(ids, mesh))      # jit + GSPMD partition the forward from the shardings

Routed experts split over `expert` run under shard_map (`ep_routed_experts`), which the MoE layers
call once `shard_model` / `enable_expert_parallelism` has given them the mesh. MLA decode over a cache
split along `context` runs under shard_map too (`context_parallel_absorbed_attention`: one all-gather
per layer merges the devices' partial softmaxes), once `shard_model` / `enable_context_parallelism`
has given the MLA layers the mesh.
"""

from sharding.context_parallel import ContextParallel, context_parallel_absorbed_attention
from sharding.expert_parallel import ep_routed_experts
from sharding.mesh import DEFAULT_SPEC, MESH_AXES, abstract_mesh, make_mesh, mesh_device_count, parse_mesh_spec
from sharding.rules import DEFAULT_RULES, Rules, logical_to_spec
from sharding.shard_model import (
    cache_shardings, enable_context_parallelism, enable_expert_parallelism, param_shardings, shard_batch, shard_cache,
    shard_model,
)

__all__ = [
    "ContextParallel", "DEFAULT_RULES", "DEFAULT_SPEC", "abstract_mesh", "MESH_AXES", "Rules", "cache_shardings",
    "context_parallel_absorbed_attention", "enable_context_parallelism", "enable_expert_parallelism",
    "ep_routed_experts", "logical_to_spec", "make_mesh", "mesh_device_count", "param_shardings", "parse_mesh_spec",
    "shard_batch", "shard_cache", "shard_model",
]

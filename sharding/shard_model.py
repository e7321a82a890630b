"""Place a K3Model, its cache and its inputs on a mesh, from each array's logical axes and one rule table.

The model is a pytree (Flax NNX, tree-clean), so a sharded model is just the same tree with sharded
leaves: `jax.jit` (used by `forward`, `prefill`, `decode_step`, `generate`) reads the input shardings
and GSPMD partitions the whole program from them. No model code changes, no `jax.set_mesh` needed.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.context_parallel import ContextParallel
from sharding.rules import DEFAULT_RULES, Rules, logical_to_spec

LOGICAL_AXES = "LOGICAL_AXES"  # class attribute of a cache NamedTuple: {field: logical axes}


def _is_variable(x: object) -> bool:
    return isinstance(x, nnx.Variable)


def named_sharding(
    logical_axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, rules: Rules
) -> NamedSharding:
    """NamedSharding for one array. Extra leading dims (the stacked `layers` axis of scanned groups,
    which the per-layer declaration does not know about) are named "layers"."""
    extra = len(shape) - len(logical_axes)
    if extra < 0:
        raise ValueError(f"logical axes {logical_axes} have more entries than shape {shape}")
    return NamedSharding(mesh, logical_to_spec(("layers",) * extra + tuple(logical_axes), rules, mesh, shape))


def param_shardings(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """The model's tree with a NamedSharding in place of every Variable (a prefix of the model's pytree,
    as `jax.device_put` and `jax.jit(in_shardings=...)` accept). Params must declare `logical_axes`."""

    def sharding_of(path, leaf):
        if not _is_variable(leaf):  # a plain array attribute: nothing declares it, keep it whole
            return NamedSharding(mesh, PartitionSpec())
        axes = leaf.get_metadata().get("logical_axes")
        if axes is None:
            if isinstance(leaf, nnx.Param):
                raise ValueError(f"parameter {jax.tree_util.keystr(path)} declares no logical_axes")
            return NamedSharding(mesh, PartitionSpec())
        try:
            return named_sharding(axes, leaf.shape, mesh, rules)
        except (KeyError, ValueError) as e:
            raise type(e)(f"parameter {jax.tree_util.keystr(path)}: {e}") from None

    return jax.tree_util.tree_map_with_path(sharding_of, model, is_leaf=_is_variable)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """The model with every parameter placed on `mesh` by `rules` (a new tree; `model` is unchanged).

    When `exp` lands on a mesh axis of size > 1, the MoE layers are told the mesh, so their routed
    experts run expert-parallel under shard_map rather than as a GSPMD-partitioned ragged_dot; when
    `cache_length` does, the MLA layers are, so their decode runs context-parallel under shard_map
    (sharding/context_parallel.py) rather than as GSPMD-partitioned attention."""
    sharded = jax.device_put(model, param_shardings(model, mesh, rules))
    enable_expert_parallelism(sharded, mesh, rules)
    enable_context_parallelism(sharded, mesh, rules)
    return sharded


def enable_expert_parallelism(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> None:
    """Give every module with an `expert_mesh` attribute (the routed-expert layers) the mesh, if
    experts are split over it (in place; static attributes)."""
    expert_axis = rules.get("exp")
    if expert_axis is None or not isinstance(expert_axis, str) or mesh.shape.get(expert_axis, 1) == 1:
        return
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "expert_mesh"):
            module.expert_mesh = mesh


def enable_context_parallelism(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> None:
    """Give every module with a `context_parallel` attribute (the MLA layers) a `ContextParallel`: the
    mesh, the axis the cache's positions (`cache_length`) split over, and the axes of the batch
    (`activation_batch`) and of the heads (`mla_proj`), if positions split over one mesh axis of
    size > 1 (in place; a static attribute)."""
    axis = rules.get("cache_length")
    if axis is None or not isinstance(axis, str) or mesh.shape.get(axis, 1) == 1:
        return
    setting = ContextParallel(mesh, axis, _axes(rules.get("activation_batch")), _axes(rules.get("mla_proj")))
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "context_parallel"):
            module.context_parallel = setting


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def cache_shardings(cache: object, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> object:
    """NamedShardings for a cache pytree: every NamedTuple in it that declares `LOGICAL_AXES` gives
    its array fields' logical axes (batch on data/fsdp, KDA heads and conv channels on tensor);
    stacked group caches carry a leading layer axis (`named_sharding`); None fields stay None.
    These are the layouts GSPMD itself gives the caches prefill/decode_step return, so a decode
    step's output cache has its input's layout: no recompile on the second step, and donation can
    reuse the buffers."""

    def place(node: object) -> object:
        axes = getattr(type(node), LOGICAL_AXES, None)
        if axes is not None:
            return type(node)(**{name: place_field(getattr(node, name), axes.get(name)) for name in node._fields})
        if isinstance(node, (tuple, list)) and not hasattr(node, "_fields"):
            return type(node)(place(child) for child in node)
        raise TypeError(f"cache_shardings: {type(node).__name__} declares no {LOGICAL_AXES}")

    def place_field(value: object, axes: tuple[str | None, ...] | None) -> object:
        if value is None:
            return None
        return place(value) if axes is None else named_sharding(axes, value.shape, mesh, rules)

    return place(cache)


def shard_cache(cache: object, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> object:
    """The cache placed on `mesh` by `cache_shardings` (a new tree)."""
    return jax.device_put(cache, cache_shardings(cache, mesh, rules))


def shard_batch(input_ids: jax.Array, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> jax.Array:
    """Token ids [B, T] split over the batch axes, so jitted calls start data-parallel."""
    return jax.device_put(input_ids, named_sharding(("activation_batch", None), input_ids.shape, mesh, rules))

"""Load a converted directory (see `store`) into a K3Model: only a COMPLETE conversion loads.

Without a mesh, items are restored one at a time to host, moved to the device and dropped, so host
memory stays at about one item; the scan groups are then stacked on device by `assemble_model`.

With a mesh, nothing goes through a full host copy: each item is restored by Orbax straight into
the NamedShardings of its leaves (derived from the abstract model by `sharding.param_shardings`;
a scan-group leaf's per-layer piece gets the group leaf's sharding without its unsplit `layers`
axis), and the layers of a scan group are stacked on device into the group leaf's sharding.

Leaves are cast to the requested dtype, so a float32 conversion loads as bfloat16 too (and bfloat16
experts load exactly as float32). Experts stored MXFP4-packed load packed (decoded on the fly by
the model) or, with `experts="bf16"`, decoded at load time.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.config import K3Config
from k3jax.convert.assemble import assemble_model
from k3jax.convert.plan import EXPERTS_PREFIX, abstract_items, abstract_model, model_slots, path_names
from k3jax.convert.store import ItemStore, read_complete_manifest
from k3jax.model import K3Model
from pallas_kernels.mxfp4 import decode_mxfp4, decode_mxfp4_jax

EXPERTS = (None, "mxfp4", "bf16")


def load_converted(
    path: str | Path, *, dtype: str = "bfloat16", experts: str | None = None, moe_implementation: str = "auto",
    mesh: str | Mesh | None = None,
) -> K3Model:
    root = Path(path)
    return load_items(root, read_complete_manifest(root), dtype=dtype, experts=experts,
                      moe_implementation=moe_implementation, mesh=mesh)


def _model_shardings(abstract: K3Model, mesh: Mesh) -> list[tuple[tuple, NamedSharding]]:
    """(key path, NamedSharding) of every model leaf, from `sharding.param_shardings` (DEFAULT_RULES)."""
    from sharding import param_shardings  # noqa: PLC0415 (sharding imports k3jax.model)

    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    shardings = jax.tree.leaves(param_shardings(abstract, mesh))
    if len(leaves) != len(shardings):
        raise AssertionError("param_shardings does not mirror the model's leaves")
    return [(key_path, sharding) for (key_path, _), sharding in zip(leaves, shardings)]


def slot_shardings(abstract: K3Model, mesh: Mesh) -> dict[tuple[str, str], NamedSharding]:
    """(item, leaf) -> the NamedSharding of that per-layer piece.

    A scan-group leaf [G, ...] is split by `spec`; its per-layer piece takes `spec` without the leading
    entry (the `layers` axis, which the rules never split)."""
    found = {}
    for key_path, sharding in _model_shardings(abstract, mesh):
        path = path_names(key_path)
        if path[0] == "group_layers":
            sharding = NamedSharding(mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
        for slot in model_slots(path, abstract.plan):
            found[(slot.item, slot.target)] = sharding
    return found


def load_items(
    root: Path, manifest: dict, *, dtype: str, experts: str | None = None, moe_implementation: str = "auto",
    mesh: str | Mesh | None = None,
) -> K3Model:
    """Build the model from the items `manifest` lists (`--verify` calls this before COMPLETE exists)."""
    if experts not in EXPERTS:
        raise ValueError(f"experts={experts!r}: expected one of {EXPERTS}")
    stored_packed = manifest.get("experts") == "mxfp4"
    if experts == "mxfp4" and not stored_packed:
        raise CheckpointError(f"{root} stores decoded routed experts; packed experts need a conversion made "
                              "with --experts mxfp4 (or load the release directory itself)")
    packed = stored_packed if experts is None else experts == "mxfp4"
    cfg = K3Config.from_hf(root, dtype=dtype)
    abstract = abstract_model(cfg, packed_experts=packed, moe_implementation=moe_implementation)
    stored = abstract if packed == stored_packed else abstract_model(cfg, packed_experts=stored_packed)
    if mesh is not None:
        from sharding import make_mesh  # noqa: PLC0415

        mesh = make_mesh(mesh)
        restore_shardings = slot_shardings(stored, mesh)
        target_shardings = slot_shardings(abstract, mesh) if stored is not abstract else restore_shardings
    store = ItemStore(root)
    arrays = {}
    for item, slots in abstract_items(stored).items():
        recorded = manifest["items"].get(item)
        if recorded is None:
            raise CheckpointError(f"{root}: the manifest has no item {item!r} that this model needs")
        expected = {slot.target: tuple(leaf.shape) for slot, leaf in slots.items()}
        found = {name: tuple(record["shape"]) for name, record in recorded.items()}
        if found != expected:
            diff = sorted(set(found.items()) ^ set(expected.items()))
            raise CheckpointError(f"{root}: item {item!r} does not match the model's leaves: {diff[:3]}")
        if mesh is None:
            leaves = store.restore(item)
        else:
            leaves = store.restore_sharded(item, {
                slot.target: jax.ShapeDtypeStruct(leaf.shape, np.dtype(recorded[slot.target]["dtype"]),
                                                  sharding=restore_shardings[(item, slot.target)])
                for slot, leaf in slots.items()
            })
        for slot, leaf in slots.items():
            array = leaves.pop(slot.target, None)
            if array is None or array.shape != leaf.shape:
                raise CheckpointError(f"{store.path(item)}: leaf {slot.target!r} is missing or mis-shaped on disk")
            arrays[(item, slot.target)] = array if mesh is not None else jnp.asarray(array, dtype=leaf.dtype)
        if packed != stored_packed:
            _decode_item(arrays, item, slots, abstract.config.dtype,
                         None if mesh is None else lambda target: target_shardings[(item, target)])

    fill = (lambda item, target: arrays.pop((item, target)))
    if mesh is None:
        return assemble_model(abstract, fill)
    leaf_sharding = {jax.tree_util.keystr(key_path): s for key_path, s in _model_shardings(abstract, mesh)}

    def stack(pieces, leaf, key_path):
        return _stack_into(leaf_sharding[jax.tree_util.keystr(key_path)])(*pieces)

    from sharding import enable_expert_parallelism  # noqa: PLC0415 (sharding imports the model)

    model = assemble_model(abstract, fill, stack)
    enable_expert_parallelism(model, mesh)
    return model


def _decode_item(arrays: dict, item: str, slots: dict, dtype: str, sharding_of) -> None:
    """Replace an item's stored experts.wN.{packed,scale} by the decoded experts.wN (host, or on the mesh)."""
    for slot in slots:
        if not (slot.target.startswith(EXPERTS_PREFIX) and slot.target.endswith(".packed")):
            continue
        target = slot.target.removesuffix(".packed")
        packed, scale = arrays.pop((item, slot.target)), arrays.pop((item, target + ".scale"))
        if sharding_of is None:  # host: the same numpy decode and cast as the HF loader
            dense = decode_mxfp4(np.asarray(packed), np.asarray(scale)).astype(dtype)
        else:
            dense = _decode_into(dtype, sharding_of(target))(packed, scale)
        arrays[(item, target)] = dense


@functools.lru_cache(maxsize=None)
def _stack_into(sharding: NamedSharding):
    """One jitted stack per target sharding (recompiled per distinct shape only)."""
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _decode_into(dtype: str, sharding: NamedSharding):
    return jax.jit(lambda p, s: decode_mxfp4_jax(p, s, dtype), out_shardings=sharding)

"""Load a converted directory (`checkpoint.store`) into a K3Model: only a COMPLETE conversion loads.

Each item is checked against the model's leaves (names and shapes, from the manifest) and restored
by Orbax: to host without a mesh; with a mesh straight into the NamedShardings of its pieces, so
nothing goes through a full host copy. The road (`assemble.load_model`) does the rest.

Leaves are cast to the requested dtype, so a float32 conversion loads as bfloat16 too (and bfloat16
experts load exactly as float32). Experts stored MXFP4-packed load packed (decoded on the fly by
the model) or, with `experts="bf16"`, decoded at load time (on the host, or on the mesh into the
decoded leaf's sharding).

Loading checks names, shapes and dtypes only; `verify=True` also checks every leaf's bytes against
the manifest's crc32, which costs a full read and checksum of every item on the host.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from k3jax.checkpoint.names import EXPERTS_PREFIX, VISION, Slot, abstract_items
from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.checkpoint.store import CHECKSUM, MANIFEST, ItemStore, read_complete_manifest
from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.load.abstract import abstract_model
from k3jax.load.assemble import load_model
from k3jax.load.placement import slot_shardings
from k3jax.load.release import EXPERTS
from k3jax.model import K3Model
from pallas_kernels.mxfp4 import decode_mxfp4, decode_mxfp4_jax
from sharding import make_mesh


def load_converted(
    path: str | Path, *, dtype: str = "bfloat16", experts: str | None = None,
    kernels: Kernels | Mapping[str, str | None] | None = None, mesh: str | Mesh | None = None,
    verify: bool = False,
) -> K3Model:
    """The model of a COMPLETE conversion in `path` (see `load_items` for the options)."""
    root = Path(path).absolute()  # Orbax needs absolute paths
    return load_items(root, read_complete_manifest(root), dtype=dtype, experts=experts, kernels=kernels, mesh=mesh,
                      verify=verify)


def load_items(
    root: Path, manifest: dict, *, dtype: str, experts: str | None = None,
    kernels: Kernels | Mapping[str, str | None] | None = None, mesh: str | Mesh | None = None,
    verify: bool = False,
) -> K3Model:
    """Build the model from the items `manifest` lists (`--verify` calls this before COMPLETE exists).

    `experts`: None loads them as converted, "mxfp4" needs a packed conversion, "bf16" decodes.
    `verify`: check each item's leaves against the manifest's checksums before it is used (a full read
    of every item on the host; with a mesh that read comes on top of the sharded restore)."""
    if experts not in EXPERTS:
        raise ValueError(f"experts={experts!r}: expected one of {EXPERTS}")
    if verify and manifest.get("checksum") != CHECKSUM:
        raise CheckpointError(f"{root / MANIFEST} records {manifest.get('checksum', 'sha256')} checksums; "
                              f"verify=True checks {CHECKSUM} ones: convert again to verify while loading")
    stored_packed = manifest.get("experts") == "mxfp4"
    if experts == "mxfp4" and not stored_packed:
        raise CheckpointError(f"{root} stores decoded routed experts; packed experts need a conversion made "
                              "with --experts mxfp4 (or load the release directory itself)")
    packed = stored_packed if experts is None else experts == "mxfp4"
    cfg = K3Config.from_hf(root, dtype=dtype)
    if VISION not in manifest["items"]:  # converted from a text-only release (planning said so)
        cfg = dataclasses.replace(cfg, vision=None)
    abstract = abstract_model(cfg, packed_experts=packed, kernels=kernels)
    stored = abstract if packed == stored_packed else abstract_model(cfg, packed_experts=stored_packed)
    mesh = None if mesh is None else make_mesh(mesh)
    restore_shardings = None if mesh is None else slot_shardings(stored, mesh)
    stored_items = abstract_items(stored)
    store = ItemStore(root)

    def read_item(item: str, slots: dict[Slot, jax.ShapeDtypeStruct],
                  shardings: dict[str, NamedSharding] | None) -> dict[str, np.ndarray | jax.Array]:
        stored_slots = stored_items[item]  # `slots` differ only where experts are decoded after the restore
        recorded = manifest["items"].get(item)
        if recorded is None:
            raise CheckpointError(f"{root}: the manifest has no item {item!r} that this model needs")
        expected = {slot.target: tuple(leaf.shape) for slot, leaf in stored_slots.items()}
        found = {name: tuple(record["shape"]) for name, record in recorded.items()}
        if found != expected:
            diff = sorted(set(found.items()) ^ set(expected.items()))
            raise CheckpointError(f"{root}: item {item!r} does not match the model's leaves: {diff[:3]}")
        host = store.restore(item) if mesh is None or verify else None
        if verify:
            why = store.checksum_mismatch(item, recorded, host)
            if why is not None:
                raise CheckpointError(f"{root}: item {item!r} does not match the manifest's checksums: {why}")
        if mesh is None:
            leaves = host
        else:
            leaves = store.restore_sharded(item, {
                slot.target: jax.ShapeDtypeStruct(leaf.shape, np.dtype(recorded[slot.target]["dtype"]),
                                                  sharding=restore_shardings[(item, slot.target)])
                for slot, leaf in stored_slots.items()
            })
        for slot, leaf in stored_slots.items():
            array = leaves.get(slot.target)
            if array is None or array.shape != leaf.shape:
                raise CheckpointError(f"{store.path(item)}: leaf {slot.target!r} is missing or mis-shaped on disk")
        if packed != stored_packed:
            _decode_experts(leaves, cfg.dtype, shardings)
        return leaves

    return load_model(abstract, read_item, mesh)


def _decode_experts(leaves: dict, dtype: str, shardings: dict[str, NamedSharding] | None) -> None:
    """Replace an item's stored experts.wN.{packed,scale} by the decoded experts.wN (host, or on the mesh)."""
    for name in [n for n in leaves if n.startswith(EXPERTS_PREFIX) and n.endswith(".packed")]:
        target = name.removesuffix(".packed")
        packed, scale = leaves.pop(name), leaves.pop(target + ".scale")
        if shardings is None:  # host: the reference decode, bit for bit what loading the release gives
            leaves[target] = decode_mxfp4(np.asarray(packed), np.asarray(scale)).astype(dtype)
        else:
            leaves[target] = _decode_into(dtype, shardings[target])(packed, scale)


@functools.lru_cache(maxsize=None)
def _decode_into(dtype: str, sharding: NamedSharding):
    return jax.jit(lambda p, s: decode_mxfp4_jax(p, s, dtype), out_shardings=sharding)

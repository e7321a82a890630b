"""Write a K3 in the exact Hugging Face release layout: random weights, or a model's own.

`language_model.*` names, routed experts one tensor per expert (an MXFP4 `weight_packed` /
`weight_scale` pair, or a plain `.weight`), `A_log` zero-padded to head_dim, several shards plus
`model.safetensors.index.json`. `write_release` makes random releases for the demo (a release to
convert and load without downloading 1.45 TB) and for tests that need configs wider than the golden
checkpoint; `write_model_release` exports a model (e.g. a fine-tuned one) that `from_pretrained` reads
back, one item (a layer) in host memory at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from k3jax.checkpoint.names import (
    EXPERTS_PREFIX, MXFP4_SUFFIXES, Slot, abstract_items, model_slots, path_names, release_name,
)
from k3jax.checkpoint.release_plan import RELEASE_DTYPE
from k3jax.config import K3Config
from k3jax.model import K3Model
from pallas_kernels.mxfp4 import encode_mxfp4

INDEX = "model.safetensors.index.json"
_PACKED_LEAVES = (".packed", ".scale")  # a packed expert leaf's suffix, in MXFP4_SUFFIXES order


def slot_tensors(slot: Slot, array: np.ndarray, cfg: K3Config, *, pack_experts: bool) -> dict[str, np.ndarray]:
    """The release tensors of one slot's array: experts split per expert (MXFP4-encoded when
    `pack_experts`, byte for byte when already packed), `A_log` padded to head_dim, others as they are."""
    name = release_name(slot)
    if slot.target.startswith(EXPERTS_PREFIX):
        projection = slot.target.removeprefix(EXPERTS_PREFIX)
        base = name.removesuffix(slot.target) + EXPERTS_PREFIX
        for leaf_suffix, release_suffix in zip(_PACKED_LEAVES, MXFP4_SUFFIXES):
            if projection.endswith(leaf_suffix):  # already packed: one of the pair
                stem = projection.removesuffix(leaf_suffix)
                return {f"{base}{e}.{stem}{release_suffix}": array[e] for e in range(array.shape[0])}
        if not pack_experts:
            return {f"{base}{e}.{projection}.weight": array[e] for e in range(array.shape[0])}
        packed, scale = encode_mxfp4(np.asarray(array, np.float32))
        return {f"{base}{e}.{projection}{suffix}": pair[e]
                for e in range(array.shape[0]) for suffix, pair in zip(MXFP4_SUFFIXES, (packed, scale))}
    if slot.target == "self_attn.A_log":
        return {name: np.pad(array, (0, cfg.kda_head_dim - array.shape[0]))}
    return {name: array}


def write_shards(root: Path, config: dict, shards: Iterator[dict[str, np.ndarray]], num_shards: int) -> Path:
    """config.json, `num_shards` safetensors files named as the release names them, and the index."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{num_shards:06d}.safetensors"  # the release's 5/6-digit quirk
        save_file(tensors, str(root / file))
        weight_map.update({name: file for name in tensors})
    (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def write_release(root: Path, config: dict, *, seed: int = 0, num_shards: int = 2, std: float = 0.02) -> Path:
    """Random weights (normal, `std`; MXFP4 experts) for `config` (a release config.json dict), written as `root`."""
    cfg = K3Config.from_hf(config)
    abstract = nnx.eval_shape(lambda: K3Model.init(cfg))  # shapes and dtypes only
    rng = np.random.default_rng(seed)
    random = lambda shape, dtype: (std * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)  # noqa: E731
    shards: list[dict[str, np.ndarray]] = [{} for _ in range(num_shards)]
    for n, slots in enumerate(abstract_items(abstract).values()):
        for slot, leaf in slots.items():
            if slot.target == "self_attn.A_log":  # log U(1, 16) per head
                array = np.log(rng.uniform(1.0, 16.0, leaf.shape)).astype(np.float32)
            elif slot.target.endswith("norm.weight"):  # norm gains near 1, as trained models have
                array = (1.0 + random(leaf.shape, np.float32)).astype(leaf.dtype)
            else:
                array = random(leaf.shape, np.float32 if slot.target.startswith(EXPERTS_PREFIX) else leaf.dtype)
            shards[n % num_shards].update(slot_tensors(slot, array, cfg, pack_experts=True))
    return write_shards(root, config, iter(shards), num_shards)


def model_items(model: K3Model) -> dict[str, list[tuple[Slot, jax.Array]]]:
    """Per item (embed, layers, head): its slots with the model's arrays (a stacked group leaf indexed
    per group; nothing is copied to the host here)."""
    found: dict[str, list[tuple[Slot, jax.Array]]] = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
        path = path_names(key_path)
        for g, slot in enumerate(model_slots(path, model.plan)):
            found.setdefault(slot.item, []).append((slot, leaf[g] if path[0] == "group_layers" else leaf))
    return found


def write_model_release(root: Path, config: dict, model: K3Model, *, pack_experts: bool) -> Path:
    """`model` (parameters fully addressable by this process) as a release at `root` with `config`
    (its config.json dict): one shard per item, every tensor in the release's dtype (bf16, the few
    fp32 ones fp32) whatever the model's; dense routed experts MXFP4-encoded when `pack_experts`, else
    plain `.weight` tensors; packed experts written as they are."""
    cfg = K3Config.from_hf(config, dtype=RELEASE_DTYPE)
    release_dtypes = {(slot.item, slot.target): np.dtype(leaf.dtype) for item in
                      abstract_items(nnx.eval_shape(lambda: K3Model.init(cfg))).values() for slot, leaf in item.items()}
    items = model_items(model)

    def shards() -> Iterator[dict[str, np.ndarray]]:
        for slots in items.values():
            tensors: dict[str, np.ndarray] = {}
            for slot, leaf in slots:
                array = np.asarray(jax.device_get(leaf))
                dtype = release_dtypes.get((slot.item, slot.target), array.dtype)  # packed experts: uint8 as is
                if slot.target.startswith(EXPERTS_PREFIX) and pack_experts and array.dtype != np.uint8:
                    dtype = np.dtype(np.float32)  # dense experts to encode: the encoder's input
                tensors.update(slot_tensors(slot, array.astype(dtype), cfg, pack_experts=pack_experts))
            yield tensors

    return write_shards(root, config, shards(), len(items))

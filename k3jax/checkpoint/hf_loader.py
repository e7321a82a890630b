"""Load a Hugging Face K3 release directory into a K3Model.

Model attribute paths mirror the checkpoint's tensor names, so the map is mechanical:
`head_layers.2.self_attn.q_proj.weight` <- `model.layers.2.self_attn.q_proj.weight`. A few
tensors need a transform, each handled explicitly below: routed experts (one tensor per expert,
stacked here; MXFP4 `weight_packed`/`weight_scale` decoded when present, plain `.weight` otherwise —
decided per tensor, never from the config's `ignore` list), `A_log` (stored zero-padded to
head_dim), and the stacked scanned layer groups. Vision tower and projector tensors are skipped:
this is the text model. Anything missing, unexpected or mis-shaped is an error naming the tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.checkpoint.mxfp4 import decode_mxfp4
from k3jax.checkpoint.safetensors_index import CheckpointError, CheckpointIndex
from k3jax.config import K3Config
from k3jax.layer_plan import LayerPlan
from k3jax.model import K3Model

_NON_TEXT_PREFIXES = ("vision_tower.", "mm_projector.")
_MODEL_LEVEL = {"embed_tokens", "norm", "output_attn_res_proj", "output_attn_res_norm"}


class _TensorSource:
    """Reads checkpoint tensors by their text-model name and records which ones were used."""

    def __init__(self, index: CheckpointIndex) -> None:
        self.index = index
        names = index.names()
        self.prefix = "language_model." if any(n.startswith("language_model.") for n in names) else ""
        self.used: set[str] = set()

    def full_name(self, name: str) -> str:
        return self.prefix + name

    def has(self, name: str) -> bool:
        return self.full_name(name) in self.index

    def read(self, name: str) -> np.ndarray:
        full = self.full_name(name)
        if full not in self.index:
            raise CheckpointError(f"tensor {full} is missing from the checkpoint at {self.index.directory}")
        self.used.add(full)
        return self.index.read(full)

    def unused_text_tensors(self) -> list[str]:
        return sorted(
            n for n in self.index.names()
            if n not in self.used and not n.startswith(_NON_TEXT_PREFIXES)
        )


def _expert_weight(src: _TensorSource, name: str) -> np.ndarray:
    """One expert projection: MXFP4 (`weight_packed` + `weight_scale`) if present, else plain `.weight`."""
    if src.has(f"{name}.weight_packed"):
        return decode_mxfp4(src.read(f"{name}.weight_packed"), src.read(f"{name}.weight_scale"))
    return src.read(f"{name}.weight")


def _a_log(src: _TensorSource, name: str, num_heads: int) -> np.ndarray:
    """A_log is per head; the release stores it zero-padded to head_dim. Accept both forms."""
    stored = src.read(name)
    full = src.full_name(name)
    if stored.ndim != 1 or stored.shape[0] < num_heads:
        raise CheckpointError(f"tensor {full} has shape {list(stored.shape)}, expected [{num_heads}] or a padded 1-D vector")
    if np.any(stored[num_heads:] != 0):
        raise CheckpointError(f"tensor {full}: entries past the {num_heads} heads must be zero padding")
    return stored[:num_heads]


def _read_layer_param(src: _TensorSource, layer: int, local: list[str], cfg: K3Config) -> np.ndarray:
    base = f"model.layers.{layer}."
    joined = ".".join(local)
    if local[:2] == ["block_sparse_moe", "experts"]:
        projection = local[2]  # w1 | w2 | w3
        return np.stack([
            _expert_weight(src, f"{base}block_sparse_moe.experts.{e}.{projection}") for e in range(cfg.num_experts)
        ])
    if local == ["self_attn", "A_log"]:
        return _a_log(src, base + joined, cfg.kda_num_heads)
    return src.read(base + joined)


def _checkpoint_layers(path: list[str | int], plan: LayerPlan) -> tuple[list[int], list[str]]:
    """Which decoder layers a model path holds (several for stacked groups), and the in-layer path."""
    section, position, local = path[0], int(path[1]), [str(p) for p in path[2:]]
    if section == "head_layers":
        return [plan.head[position]], local
    if section == "tail_layers":
        return [plan.tail[position]], local
    return [plan.start + g * plan.period + position for g in range(plan.num_groups)], local


def _path_names(key_path: tuple[Any, ...]) -> list[str | int]:
    names: list[str | int] = []
    for key in key_path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            names.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            names.append(key.idx)
        elif isinstance(key, jax.tree_util.DictKey):
            names.append(key.key)
    return names[:-1] if names and names[-1] == "value" else names


def load_hf_model(path: str | Path, *, dtype: str = "bfloat16", moe_implementation: str = "auto") -> K3Model:
    """Build a K3Model from an HF release directory (config.json + safetensors index and shards)."""
    cfg = K3Config.from_hf(path, dtype=dtype)
    src = _TensorSource(CheckpointIndex.open(path))
    abstract = nnx.eval_shape(lambda: K3Model.init(cfg, moe_implementation=moe_implementation))
    plan = abstract.plan

    def load_leaf(key_path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        names = _path_names(key_path)
        if names[0] in _MODEL_LEVEL:
            arrays, expected = [src.read("model." + ".".join(map(str, names)))], leaf.shape
            tensor_names = ["model." + ".".join(map(str, names))]
        elif names[0] == "lm_head":
            arrays, expected, tensor_names = [src.read("lm_head.weight")], leaf.shape, ["lm_head.weight"]
        else:
            layers, local = _checkpoint_layers(names, plan)
            arrays = [_read_layer_param(src, i, local, cfg) for i in layers]
            tensor_names = [f"model.layers.{i}.{'.'.join(local)}" for i in layers]
            expected = leaf.shape[1:] if names[0] == "group_layers" else leaf.shape
        for name, array in zip(tensor_names, arrays):
            if tuple(array.shape) != tuple(expected):
                raise CheckpointError(
                    f"tensor {src.full_name(name)} has shape {list(array.shape)}, the model expects {list(expected)}"
                )
        stacked = np.stack(arrays) if names[0] == "group_layers" else arrays[0]
        return jnp.asarray(stacked.astype(np.float32) if stacked.dtype != leaf.dtype else stacked, dtype=leaf.dtype)

    model = jax.tree_util.tree_map_with_path(load_leaf, abstract)
    unexpected = src.unused_text_tensors()
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) in {path} that the model does not use: {shown}")
    return model

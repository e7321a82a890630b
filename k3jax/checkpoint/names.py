"""Names: a model leaf <-> its item and slot <-> the release tensor(s) it is made from.

The plan is cut into items — `embed`, one per decoder layer, `head` — because an item is the unit a
conversion writes and the most a loader holds in memory at once; the model's stacked scan groups
are rebuilt from the items when a model is assembled. Model attribute paths mirror the checkpoint:
item `layer_002`, leaf `self_attn.q_proj.weight` <- `model.layers.2.self_attn.q_proj.weight`, and
the release prefixes every text-model tensor with `language_model.`. Routed experts are one tensor
per expert in the release (`...experts.<e>.w1.weight`, or an MXFP4 `weight_packed` / `weight_scale`
pair) and one stacked leaf in the model. The vision tower and projector form one more item, `vision`,
whose leaves carry their release names unprefixed (`vision_tower.encoder.blocks.0.wqkv.weight`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from k3jax.layer_plan import LayerPlan

EMBED, HEAD, VISION = "embed", "head", "vision"
VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # release names (and model paths) of the vision item
EXPERTS_PREFIX = "block_sparse_moe.experts."
MXFP4_SUFFIXES = (".weight_packed", ".weight_scale")  # the release's MXFP4 pair: E2M1 codes, E8M0 scales
RELEASE_PREFIX = "language_model."
_HEAD_LEVEL = {"norm", "output_attn_res_proj", "output_attn_res_norm", "lm_head"}


def layer_item(layer: int) -> str:
    return f"layer_{layer:03d}"


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one model leaf (or one layer of a stacked group leaf) lives: an item and a leaf name in it."""

    item: str
    layer: int | None  # decoder layer index; None for the embed and head items
    target: str


def path_names(key_path: tuple[Any, ...]) -> list[str | int]:
    """A model leaf's key path as attribute names and list indices, without NNX's trailing `value`."""
    names: list[str | int] = []
    for key in key_path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            names.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            names.append(key.idx)
        elif isinstance(key, jax.tree_util.DictKey):
            names.append(key.key)
    return names[:-1] if names and names[-1] == "value" else names


def model_slots(path: list[str | int], plan: LayerPlan) -> list[Slot]:
    """The slots of one model leaf: one, or one per group (in group order) for a stacked scan-group leaf."""
    joined = ".".join(map(str, path))
    if path[0] == "embed_tokens":
        return [Slot(EMBED, None, joined)]
    if path[0] in _HEAD_LEVEL:
        return [Slot(HEAD, None, joined)]
    if joined.startswith(VISION_PREFIXES):
        return [Slot(VISION, None, joined)]
    section, position, local = path[0], int(path[1]), ".".join(map(str, path[2:]))
    if section == "head_layers":
        layers = [plan.head[position]]
    elif section == "tail_layers":
        layers = [plan.tail[position]]
    else:
        layers = [plan.start + g * plan.period + position for g in range(plan.num_groups)]
    return [Slot(layer_item(i), i, local) for i in layers]


def abstract_items(abstract) -> dict[str, dict[Slot, jax.ShapeDtypeStruct]]:
    """Per item (embed, layers in order, head) of an abstract K3Model: its leaves' slots and per-layer
    abstract arrays, leaves sorted by name."""
    found: dict[str, dict[Slot, jax.ShapeDtypeStruct]] = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        path = path_names(key_path)
        stacked = path[0] == "group_layers"
        shape = leaf.shape[1:] if stacked else leaf.shape
        for slot in model_slots(path, abstract.plan):
            found.setdefault(slot.item, {})[slot] = jax.ShapeDtypeStruct(shape, leaf.dtype)
    layers = sorted(name for name in found if name.startswith("layer_"))
    return {
        name: dict(sorted(found[name].items(), key=lambda kv: kv[0].target))
        for name in [EMBED, *layers, HEAD, VISION] if name in found
    }


def source_name(slot: Slot) -> str:
    """The text-model tensor name of a slot, without the release's `language_model.` prefix (a vision
    slot: its release name)."""
    if slot.item == VISION:
        return slot.target
    if slot.layer is not None:
        return f"model.layers.{slot.layer}.{slot.target}"
    return slot.target if slot.target.startswith("lm_head.") else f"model.{slot.target}"


def release_name(slot: Slot) -> str:
    """The release tensor name of a slot (for a stacked expert leaf: the stem the per-expert names extend)."""
    return source_name(slot) if slot.item == VISION else RELEASE_PREFIX + source_name(slot)

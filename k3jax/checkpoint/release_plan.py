"""The release plan: every model leaf, per item, with the checkpoint tensors it is made from.

Built from the safetensors index and shard headers only, against the abstract model (see
`k3jax.load.abstract_model`), so a missing, unexpected, mis-shaped or mis-typed tensor is reported
before any tensor data is read or anything is written. Loading a release and converting one run from
this one plan, so they cannot disagree about names or transforms (names: `names`).

Source dtypes: the release keeps its weights in bfloat16 and a few tensors (the KDA state parameters,
the router bias) in float32, exactly the dtypes of the bfloat16 model's leaves; MXFP4 codes and scales
are uint8. Each tensor's header dtype must be the one its leaf implies, so a tensor relabelled in its
header (bf16 bytes called F16) is an error naming it rather than garbage weights.

Transforms: routed experts are stacked from one tensor per expert (MXFP4 `weight_packed` +
`weight_scale` decoded when present, plain `.weight` otherwise — decided per tensor, never from the
config's `ignore` list); `A_log` is stored zero-padded to head_dim and sliced to the heads; anything
else is copied; every leaf is cast to its target dtype. Vision tower and projector tensors (release
names without the `language_model.` prefix) are copied into the `vision` item; a model without a
vision tower skips them (`text_only_without_vision` decides that from the config and the headers).

With packed experts (an abstract model whose experts are `experts.w1.packed` / `experts.w1.scale`,
uint8) the expert leaves are stacked from the release's `weight_packed` / `weight_scale` tensors
byte for byte, with no decode.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import warnings

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from k3jax.checkpoint.names import (
    EXPERTS_PREFIX, MXFP4_SUFFIXES, RELEASE_PREFIX, VISION_PREFIXES, Slot, abstract_items, source_name,
)
from k3jax.checkpoint.safetensors_index import CheckpointError, CheckpointIndex, TensorInfo
from k3jax.config import K3Config
from k3jax.model import K3Model

RELEASE_DTYPE = "bfloat16"  # the dtype of the release's weights (its config's `dtype`)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """One leaf of an item: target shape/dtype, how it is made, and from which tensors.

    `parts` holds one tuple of tensor names per piece: a single piece for copy / A_log, one per
    expert (stacked on a new leading axis) for routed experts; an MXFP4 piece is (packed, scale).
    The packed kinds stack one of the two (codes or scales) as stored; they keep the pair so that a
    scale leaf can check that its blocks decode to finite values.
    """

    target: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str  # "copy" | "a_log" | "experts" | "mxfp4_packed" | "mxfp4_scale"
    parts: tuple[tuple[str, ...], ...]
    transform: str  # human-readable, e.g. "stack 16 experts, MXFP4 decode -> bfloat16"
    source_bytes: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ItemPlan:
    name: str
    leaves: tuple[LeafPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    def leaf(self, target: str) -> LeafPlan:
        return next(leaf for leaf in self.leaves if leaf.target == target)


@dataclasses.dataclass(frozen=True)
class ReleasePlan:
    items: tuple[ItemPlan, ...]
    fingerprint: str  # sha256 over the leaf table and the source headers it relies on

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    @property
    def source_bytes(self) -> int:
        return sum(leaf.source_bytes for item in self.items for leaf in item.leaves)

    def item(self, name: str) -> ItemPlan:
        return next(item for item in self.items if item.name == name)


def source_experts_are_mxfp4(index: CheckpointIndex) -> bool:
    """True when the release has routed experts and every one of them is an MXFP4 pair (headers only)."""
    names = [n for n in index.names() if f".{EXPERTS_PREFIX}" in n]
    return bool(names) and all(n.endswith(MXFP4_SUFFIXES) for n in names)


def text_only_without_vision(cfg: K3Config, index: CheckpointIndex) -> K3Config:
    """`cfg` without its vision tower when the checkpoint holds no vision tensors (a text-only model,
    which refuses images); a warning says so. A config without `vision_config` loads text-only too,
    and any vision tensors are then left unread."""
    has_tensors = any(n.startswith(VISION_PREFIXES) for n in index.names())
    if cfg.vision is not None and not has_tensors:
        warnings.warn(f"{index.directory}: config.json describes a vision tower but the checkpoint holds no "
                      "vision_tower.* / mm_projector.* tensors: loading a text-only model (images are refused)",
                      stacklevel=2)
        return dataclasses.replace(cfg, vision=None)
    if cfg.vision is None and has_tensors:
        warnings.warn(f"{index.directory}: the checkpoint holds vision tensors but config.json has no "
                      "vision_config: loading a text-only model (images are refused)", stacklevel=2)
    return cfg


class _Sources:
    """Header-level view of the checkpoint by text-model name (vision tensors by their release names);
    records which tensors the plan uses."""

    def __init__(self, index: CheckpointIndex, *, vision: bool) -> None:
        self.index = index
        names = index.names()
        self.prefix = RELEASE_PREFIX if any(n.startswith(RELEASE_PREFIX) for n in names) else ""
        self.vision = vision  # False: vision tensors are left unread, not unexpected
        self.used: set[str] = set()

    def full(self, name: str) -> str:
        return name if name.startswith(VISION_PREFIXES) else self.prefix + name

    def has(self, name: str) -> bool:
        return self.full(name) in self.index

    def info(self, name: str) -> TensorInfo:
        full = self.full(name)
        if full not in self.index:
            raise CheckpointError(f"tensor {full} is missing from the checkpoint at {self.index.directory}")
        self.used.add(full)
        return self.index.info(full)

    def unexpected(self) -> list[str]:
        return sorted(
            n for n in self.index.names()
            if n not in self.used and (self.vision or not n.startswith(VISION_PREFIXES))
        )


def _shape_error(info: TensorInfo, expected: tuple[int, ...], note: str = "") -> CheckpointError:
    return CheckpointError(
        f"tensor {info.name} has shape {list(info.shape)}, the model expects {list(expected)}{note}"
    )


def _float_source(info: TensorInfo) -> TensorInfo:
    """Weights must be floats (numpy's or ml_dtypes' bf16 / fp8); an integer tensor is a mislabelled one."""
    try:
        ml_dtypes.finfo(info.dtype)
    except ValueError:
        raise CheckpointError(f"tensor {info.name} has dtype {info.dtype.name}, expected a floating-point tensor") from None
    return info


def _release_dtype(info: TensorInfo, expected: np.dtype) -> TensorInfo:
    """The header's dtype must be the one the release keeps this tensor in (see the module docstring)."""
    _float_source(info)
    if info.dtype != expected:
        raise CheckpointError(f"tensor {info.name} has dtype {info.dtype.name}, expected {expected.name} "
                              "(the release's dtype for this tensor; header relabelled?)")
    return info


def _plain(src: _Sources, name: str, shape: tuple[int, ...], expected: np.dtype) -> TensorInfo:
    info = _float_source(src.info(name))
    if info.shape != shape:
        raise _shape_error(info, shape)
    return _release_dtype(info, expected)


def _release_dtypes(abstract) -> dict[Slot, np.dtype]:
    """Each slot's dtype in the release: its leaf's dtype in the bfloat16 model (dense experts)."""
    cfg = abstract.config
    reference = nnx.eval_shape(lambda: K3Model.init(dataclasses.replace(cfg, dtype=RELEASE_DTYPE)))
    return {slot: np.dtype(leaf.dtype) for slots in abstract_items(reference).values() for slot, leaf in slots.items()}


def _mxfp4(src: _Sources, base: str, shape: tuple[int, ...]) -> list[TensorInfo]:
    """Header checks of one MXFP4 pair: uint8 [out, in/2] codes and uint8 [out, in/32] E8M0 scales."""
    out, cols = shape
    infos = [src.info(base + suffix) for suffix in MXFP4_SUFFIXES]
    for info, expected in zip(infos, [(out, cols // 2), (out, cols // 32)]):
        if info.dtype != np.uint8:
            raise CheckpointError(f"tensor {info.name} has dtype {info.dtype.name}, MXFP4 needs uint8")
        if info.shape != expected or cols % 32:
            raise _shape_error(info, expected, f" (MXFP4 packing of [{out}, {cols}])")
    return infos


def _plan_packed_leaf(src: _Sources, slot: Slot, shape: tuple[int, ...]) -> LeafPlan:
    """`experts.wN.packed` / `experts.wN.scale`: one release tensor per expert, stacked as stored."""
    projection, _, which = slot.target.removeprefix(EXPERTS_PREFIX).partition(".")
    columns = shape[-1] * (2 if which == "packed" else 32)
    parts, nbytes = [], 0
    for e in range(shape[0]):
        base = f"model.layers.{slot.layer}.{EXPERTS_PREFIX}{e}.{projection}"
        if not src.has(base + MXFP4_SUFFIXES[0]) and src.has(base + ".weight"):
            raise CheckpointError(
                f"tensor {src.prefix}{base}.weight is not MXFP4-packed; packed experts (--experts mxfp4) need "
                "weight_packed / weight_scale pairs (use --experts bf16)"
            )
        pair = _mxfp4(src, base, (shape[1], columns))
        parts.append(tuple(i.name for i in pair))
        nbytes += pair[0 if which == "packed" else 1].nbytes
    what = "MXFP4 E2M1 codes" if which == "packed" else "MXFP4 E8M0 scales"
    return LeafPlan(slot.target, shape, np.dtype(np.uint8), f"mxfp4_{which}", tuple(parts),
                    f"stack {shape[0]} experts, {what} as stored (no decode)", nbytes)


def _plan_leaf(src: _Sources, slot: Slot, abstract: jax.ShapeDtypeStruct, dtype: np.dtype,
               release: np.dtype) -> LeafPlan:
    name, shape = source_name(slot), tuple(abstract.shape)
    if slot.target.startswith(EXPERTS_PREFIX) and slot.target.endswith((".packed", ".scale")):
        return _plan_packed_leaf(src, slot, shape)
    if slot.target.startswith(EXPERTS_PREFIX):
        projection = slot.target.removeprefix(EXPERTS_PREFIX)
        parts, infos = [], []
        for e in range(shape[0]):
            base = f"model.layers.{slot.layer}.{EXPERTS_PREFIX}{e}.{projection}"
            if src.has(base + MXFP4_SUFFIXES[0]):
                pair = _mxfp4(src, base, shape[1:])
            else:
                pair = [_plain(src, base + ".weight", shape[1:], release)]
            parts.append(tuple(i.name for i in pair))
            infos.extend(pair)
        decode = ", MXFP4 decode" if any(len(p) == 2 for p in parts) else ""
        transform = f"stack {shape[0]} experts{decode} -> {dtype.name}"
        return LeafPlan(slot.target, shape, dtype, "experts", tuple(parts), transform, sum(i.nbytes for i in infos))
    if slot.target == "self_attn.A_log":
        info = _release_dtype(src.info(name), release)
        if len(info.shape) != 1 or info.shape[0] < shape[0]:
            raise CheckpointError(
                f"tensor {info.name} has shape {list(info.shape)}, expected [{shape[0]}] or a padded 1-D vector"
            )
        cast = "" if info.dtype == dtype else f", cast {info.dtype.name} -> {dtype.name}"
        transform = f"A_log slice [{info.shape[0]}] -> [{shape[0]}]{cast}"
        return LeafPlan(slot.target, shape, dtype, "a_log", ((info.name,),), transform, info.nbytes)
    info = _plain(src, name, shape, release)
    transform = "copy" if info.dtype == dtype else f"cast {info.dtype.name} -> {dtype.name}"
    return LeafPlan(slot.target, shape, dtype, "copy", ((info.name,),), transform, info.nbytes)


def build_plan(index: CheckpointIndex, abstract, *, experts_dtype: str | None = None) -> ReleasePlan:
    """Plan every leaf of `abstract` (an `nnx.eval_shape` K3Model) from `index`'s headers.

    Leaves are stored in the abstract model's dtypes; `experts_dtype` overrides that for dense routed
    experts (bfloat16 holds every MXFP4 value exactly, at half the bytes of float32). An abstract model
    with packed experts (`abstract_model(..., packed_experts=True)`) plans them as uint8 codes and scales.
    """
    src = _Sources(index, vision=abstract.vision_tower is not None)
    release_dtypes = _release_dtypes(abstract)
    items = []
    for item_name, slots in abstract_items(abstract).items():
        leaves = []
        for slot, leaf in slots.items():
            dtype = np.dtype(leaf.dtype)
            if experts_dtype is not None and slot.target.startswith(EXPERTS_PREFIX) and dtype != np.uint8:
                dtype = np.dtype(experts_dtype)
            # packed expert slots are not in the dense model: their pairs are uint8, which `_mxfp4` checks
            release = release_dtypes.get(slot, np.dtype(np.uint8))
            leaves.append(_plan_leaf(src, slot, leaf, dtype, release))
        items.append(ItemPlan(item_name, tuple(leaves)))
    unexpected = src.unexpected()
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise CheckpointError(
            f"{len(unexpected)} unexpected tensor(s) in {index.directory} that the model does not use: {shown}"
        )
    return ReleasePlan(tuple(items), _fingerprint(items, index))


def _fingerprint(items: list[ItemPlan], index: CheckpointIndex) -> str:
    """Identifies a conversion: the leaf table plus where each source tensor sits in its shard."""
    names: dict = {}  # dtype / shard path -> name, computed once (the release has ~500k tensors)

    def name(x) -> str:
        if x not in names:
            names[x] = x.name
        return names[x]

    table = []
    for item in items:
        for leaf in item.leaves:
            sources = [index.info(n) for part in leaf.parts for n in part]
            table.append([
                item.name, leaf.target, list(leaf.shape), leaf.dtype.name, leaf.kind,
                [[s.name, name(s.shard_path), name(s.dtype), list(s.shape), s.start, s.stop] for s in sources],
            ])
    return hashlib.sha256(json.dumps(table).encode()).hexdigest()

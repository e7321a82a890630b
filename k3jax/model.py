"""K3Model: embeddings -> 93 decoder layers with Block AttnRes -> output AttnRes -> norm -> lm_head.

The module is a pytree (Flax NNX, tree-clean): the forward pass is a pure function of the model
and the token ids, jitted once. Layers follow `LayerPlan`: an unrolled head, groups whose parameters
are stacked on a leading axis and run under `lax.scan`, and an unrolled tail. Attribute names
follow the checkpoint's tensor names, so the loader maps parameters by path.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.layer_plan import LayerPlan, plan_layers
from k3jax.nn.attn_res import AttnResStream, attn_res_mix
from k3jax.nn.decoder import DecoderLayer, LayerCache, LayerTaps
from k3jax.nn.layers import F32, Linear, RMSNorm, declare, linear, normal_init
from k3jax.nn.mla import MLACache
from k3jax.nn.moe import RouterStats
from k3jax.vision.embed import ImageInputs, image_embeds, prepare_images
from k3jax.vision.projector import Projector
from k3jax.vision.tower import VisionTower
from pallas_kernels.kda.reference import segment_runs


class ModelCache(NamedTuple):
    """Inference state: per-layer caches laid out like the layers, plus the number of tokens seen."""

    head: tuple[LayerCache, ...]
    groups: tuple[LayerCache, ...]  # one entry per position in a group, each stacked [G, ...]
    tail: tuple[LayerCache, ...]
    length: jax.Array  # int32 scalar
    # int32 [B]: position of each row's first real token; the positions before it are left padding
    # (masked out of attention, identity steps for KDA). None: no padding.
    start: jax.Array | None = None

    # Logical axes of the array fields, read by `sharding` (the layer caches declare their own).
    LOGICAL_AXES = {"length": (), "start": ("activation_batch",)}

    @property
    def capacity(self) -> int:
        for c in (*self.head, *self.groups, *self.tail):
            if isinstance(c, MLACache):
                return c.latent.shape[-2]
        return 2**31 - 1  # a model without MLA layers has no per-token cache


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [B, T, vocab] fp32
    final_hidden: jax.Array  # after the final norm
    final_attn_res: jax.Array  # the output AttnRes mix, input of the final norm
    taps: tuple[LayerTaps, ...] | None  # per layer, when requested
    # When requested: (head, groups, tail) laid out like the layers, a `RouterStats` per MoE layer
    # (None for dense ones), group entries stacked [G, ...] like the scanned parameters.
    router_stats: tuple[tuple[RouterStats | None, ...], ...] | None = None


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.weight = declare(rngs, (vocab, dim), dtype, ("vocab", "embed"), normal_init(1.0))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


def _stack(trees: list) -> object:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _unstack(stacked: jax.Array) -> tuple[jax.Array, ...]:
    """The [G, ...] array's G slices, each sharded like the stacked array minus its leading axis."""
    sharding = stacked.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec)[1:]
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return jax.jit(lambda a: tuple(a), out_shardings=sharding)(stacked)


class K3Model(nnx.Module):
    def __init__(self, cfg: K3Config, layers: list[DecoderLayer], *, rngs: nnx.Rngs) -> None:
        """Assemble a model from its decoder layers; embeddings, norms and head are declared here.

        `kernels` (static) is the kernel choice the layers were built with, which must be one choice.
        """
        if len(layers) != cfg.num_hidden_layers:
            raise ValueError(f"got {len(layers)} decoder layers, config has num_hidden_layers={cfg.num_hidden_layers}")
        choices = {layer.kernels for layer in layers}
        if len(choices) != 1:
            raise ValueError(f"decoder layers were built with different kernels {sorted(map(repr, choices))}; "
                             "a model runs one choice")
        (self.kernels,) = choices
        dtype = jnp.dtype(cfg.dtype)
        d = cfg.hidden_size
        self.config = cfg
        self.plan = plan_layers(cfg.layer_kinds)
        self.embed_tokens = Embedding(cfg.vocab_size, d, dtype=dtype, rngs=rngs)
        self.head_layers = nnx.List([layers[i] for i in self.plan.head])
        groups = [
            nnx.List(layers[self.plan.start + g * self.plan.period : self.plan.start + (g + 1) * self.plan.period])
            for g in range(self.plan.num_groups)
        ]
        self.group_layers = _stack(groups) if groups else None
        self.tail_layers = nnx.List([layers[i] for i in self.plan.tail])
        self.output_attn_res_proj = Linear(d, 1, dtype=dtype, axes=(None, "embed"), rngs=rngs)
        self.output_attn_res_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, axis="embed", rngs=rngs)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, axis="embed", rngs=rngs)
        self.lm_head = Linear(d, cfg.vocab_size, dtype=dtype, axes=("vocab", "embed"), rngs=rngs, gain=2.0)
        # MoonViT-V2 and its projector (release names `vision_tower.*`, `mm_projector.*`); None: text-only.
        if cfg.vision is not None:
            self.vision_tower = VisionTower(cfg.vision, dtype=dtype, rngs=rngs)
            self.mm_projector = Projector(cfg.vision, dtype=dtype, rngs=rngs)
        else:
            self.vision_tower = self.mm_projector = None

    @classmethod
    def init(
        cls, cfg: K3Config, *, seed: int = 0, kernels: Kernels | Mapping[str, str | None] | None = None
    ) -> "K3Model":
        """A randomly initialised model (tests, demos, abstract shapes via `nnx.eval_shape`).

        `kernels`: the implementation of each op (`Kernels`, or a mapping such as `{"moe": "xla"}`;
        None or a missing op: the dispatch policy). It is part of the model's static structure, so
        the forward, `prefill`, `decode_step` and `generate` all compile for it.
        """
        kernels = Kernels.of(kernels)
        rngs = nnx.Rngs(seed)
        dtype = jnp.dtype(cfg.dtype)
        layers = [
            DecoderLayer(cfg, mixer, ffn, dtype=dtype, rngs=rngs, kernels=kernels) for mixer, ffn in cfg.layer_kinds
        ]
        return cls(cfg, layers, rngs=rngs)

    def use_kernels(self, kernels: Kernels | Mapping[str, str | None] | None) -> None:
        """Switch this model to another kernel choice in place: the same weights, and the next
        jitted call compiles for the new choice (e.g. to compare a kernel with the reference)."""
        kernels = Kernels.of(kernels)
        for _, module in nnx.iter_modules(self):
            if hasattr(module, "kernels"):
                module.kernels = kernels

    def unroll_layers(self) -> None:
        """Hold every decoder layer's weights as arrays of its own, in place: the forward then runs
        the layers unrolled instead of under `lax.scan`.

        Why: each step of the scan slices its layer's weights out of the stacked arrays, and a slice
        feeding a custom call (the Pallas kernels, cuBLAS) is copied, so a GPU decode step copies
        most of the weights before reading them. Unrolled, every kernel reads its weights where they
        lie. The cost is compile time, which grows with the depth: meant for inference (training,
        with its larger step, keeps the scan). Each stacked array is dropped as soon as it is
        split, so unless something else holds it the peak memory is one array more, not a second model.
        """
        if self.group_layers is None:
            return
        graphdef, state = nnx.split(self.group_layers)
        self.group_layers = None
        leaves, treedef = jax.tree.flatten(state)
        del state  # `leaves` now holds the only references this model had
        per_group: list[list[jax.Array]] = [[] for _ in range(self.plan.num_groups)]
        for i, leaf in enumerate(leaves):
            for g, part in enumerate(_unstack(leaf)):
                per_group[g].append(part)
            leaves[i] = leaf = None  # freed now unless referenced elsewhere
        groups = [nnx.merge(graphdef, jax.tree.unflatten(treedef, parts)) for parts in per_group]
        layers = [*self.head_layers, *(layer for group in groups for layer in group), *self.tail_layers]
        n = self.config.num_hidden_layers
        self.plan = LayerPlan(num_layers=n, start=n, period=1, num_groups=0)  # all layers in the head
        self.head_layers = nnx.List(layers)
        self.tail_layers = nnx.List([])

    # ---- access by layer index ----------------------------------------------------------
    def layer(self, index: int) -> DecoderLayer:
        where, i, j = self.plan.slot(index)
        if where == "head":
            return self.head_layers[i]
        if where == "tail":
            return self.tail_layers[i]
        return jax.tree.map(lambda a: a[i], self.group_layers)[j]

    # ---- forward ------------------------------------------------------------------------
    def __call__(self, input_ids: jax.Array, pixel_values: Any = None, grid_thws: Any = None) -> jax.Array:
        """int32 [B, T] -> float32 logits [B, T, vocab].

        With images (`pixel_values` [L, 3, 14, 14] and `grid_thws` [N, 3], see `k3jax.vision`), each
        image's one placeholder token in `input_ids` is expanded to its features: the logits cover the
        expanded rows [B, T', vocab], rows shorter than the longest left-padded (see `forward_images`)."""
        if pixel_values is None and grid_thws is None:
            return forward(self, input_ids).logits
        return forward_images(self, input_ids, pixel_values, grid_thws)[0]

    def empty_cache(self, batch: int, capacity: int) -> ModelCache:
        dtype = jnp.dtype(self.config.dtype)
        make = lambda layer: layer.empty_cache(self.config, batch, capacity, dtype)  # noqa: E731
        groups = ()
        if self.group_layers is not None:
            per_position = [make(layer) for layer in self.group_layers]
            groups = tuple(_stack([c] * self.plan.num_groups) for c in per_position)
        return ModelCache(
            head=tuple(make(layer) for layer in self.head_layers),
            groups=groups,
            tail=tuple(make(layer) for layer in self.tail_layers),
            length=jnp.zeros((), jnp.int32),
        )


def check_input_ids(input_ids: Any, cfg: K3Config, *, name: str = "input_ids", ndim: int = 2) -> jax.Array:
    """Token ids as int32: [batch, seq], or [batch] (`ndim` 1) for one decode step.

    Checked before any cast, which would wrap wide ids (int64 2**32 + 5 -> 5) or truncate floats
    (3.7 -> 3); ids outside the vocabulary are an error (the embedding lookup would clamp them).
    Traced ids are checked for shape and dtype only.
    """
    ids = input_ids if isinstance(input_ids, jax.Array) else np.asarray(input_ids)
    layout = "[batch, seq]" if ndim == 2 else "[batch]"
    if ids.ndim != ndim or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array {layout}; got {ids.dtype} {ids.shape}")
    if ids.shape[0] == 0:
        raise ValueError(f"{name} has an empty batch (shape {ids.shape}): expected at least one row")
    if ndim == 2 and ids.shape[1] == 0:
        raise ValueError(f"{name} has no tokens (shape {ids.shape}): expected at least one per row")
    if not isinstance(ids, jax.core.Tracer):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= cfg.vocab_size:
            raise ValueError(f"{name} must lie in [0, vocab_size={cfg.vocab_size}); got values in [{low}, {high}]")
    return jnp.asarray(ids, jnp.int32)


def run_model(
    model: K3Model, input_ids: jax.Array, cache: ModelCache | None = None, *, collect_taps: bool = False,
    start: jax.Array | None = None, last_logits_only: bool = False, inputs_embeds: jax.Array | None = None,
    segment_ids: jax.Array | None = None, compute_logits: bool = True, collect_router_stats: bool = False,
    router_stats_mask: jax.Array | None = None, real_tokens: jax.Array | None = None,
) -> tuple[ForwardOutput, ModelCache | None]:
    """The whole forward pass. With a cache, the tokens continue the cached sequence.

    `segment_ids` int32 [B, T] (cache-free passes): documents packed in a row (1, 2, 3, ...; 0 =
    padding). Each contiguous stretch of one id computes what it would alone: the KDA state and
    conv window reset where the id changes and MLA attends within the stretch only (K3 has no
    positional encoding). `compute_logits=False` leaves `logits` None (a chunked loss reads
    `final_hidden` and the lm_head itself). `collect_router_stats` fills `router_stats` over the
    tokens of `router_stats_mask` (bool [B, T]; default: segment id > 0 when ids are given, else all).

    `last_logits_only` computes the logits of the last position only ([B, 1, vocab]): a prompt's
    continuation needs no more, and all positions' fp32 logits dominate memory for long prompts.

    `start` (int32 [B], or taken from the cache) marks left padding: row b's tokens before position
    start[b] are pads. K3 has no positional encoding, so a left-padded row computes exactly what the
    row alone would: pad keys are masked out of MLA, pad steps leave the KDA state and conv window
    untouched, AttnRes and MoE are per token. Logits at pad positions are meaningless.

    `real_tokens` (int32 scalar, with a cache) marks right padding: only the first `real_tokens` of
    the T new tokens of every row are real. Pad steps leave the KDA state and conv window as the
    real tokens left them, the cache's length advances by `real_tokens` (the pads' MLA latents are
    overwritten later), and `last_logits_only` gives the last real position's logits. So a
    continuation of any length runs at a bucketed width with the cache it would have unpadded.

    `inputs_embeds` [B, T, hidden] replaces the token embeddings (prompts with images; `input_ids`
    is then unused and may be None).
    """
    cfg, plan = model.config, model.plan
    if segment_ids is not None and cache is not None:
        raise ValueError("segment_ids (packed documents) are for cache-free passes; got a cache too")
    if real_tokens is not None and cache is None:
        raise ValueError("real_tokens (right padding) continues a cache; got no cache")
    position = cache.length if cache is not None else jnp.zeros((), jnp.int32)
    if start is None and cache is not None:
        start = cache.start
    embeds = model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    stream = AttnResStream.start(embeds, cfg.num_attn_res_blocks)
    taps: list[LayerTaps] = []
    runs = None if segment_ids is None else segment_runs(segment_ids)
    layer_kwargs = dict(
        segments=runs,
        stats_valid=router_stats_mask if router_stats_mask is not None or segment_ids is None else segment_ids > 0,
        collect_router_stats=collect_router_stats,
        real_tokens=real_tokens,
    )

    def run_unrolled(layers, indices, caches):
        nonlocal stream
        new_caches = []
        for k, (layer, index) in enumerate(zip(layers, indices)):
            stream, new_cache, tap = layer(stream, index, caches[k] if caches else None, position, start, **layer_kwargs)
            new_caches.append(new_cache)
            taps.append(tap)
        return tuple(new_caches)

    head = run_unrolled(model.head_layers, plan.head, cache.head if cache else None)
    head_stats = tuple(tap.router_stats for tap in taps)

    groups: tuple = ()
    group_stats: tuple = ()
    if model.group_layers is not None:
        def group_step(carry, xs):
            group, group_cache, g = xs
            new_caches, group_taps, group_stats = [], [], []
            for j, layer in enumerate(group):
                index = plan.start + g * plan.period + j
                carry, new_cache, tap = layer(
                    carry, index, group_cache[j] if cache else None, position, start, **layer_kwargs
                )
                new_caches.append(new_cache)
                group_taps.append(tap if collect_taps else None)
                group_stats.append(tap.router_stats)
            return carry, (tuple(new_caches) if cache else None, tuple(group_taps), tuple(group_stats))

        xs = (model.group_layers, cache.groups if cache else None, jnp.arange(plan.num_groups))
        stream, (groups, stacked_taps, group_stats) = jax.lax.scan(group_step, stream, xs)
        if collect_taps:
            for g in range(plan.num_groups):
                taps.extend(jax.tree.map(lambda a: a[g], tap) for tap in stacked_taps)
        groups = groups or ()

    n_before_tail = len(taps)
    tail = run_unrolled(model.tail_layers, plan.tail, cache.tail if cache else None)
    stats = None
    if collect_router_stats:
        stats = (head_stats, group_stats, tuple(tap.router_stats for tap in taps[n_before_tail:]))

    final_mix = attn_res_mix(
        stream, model.output_attn_res_proj.weight[...][0], model.output_attn_res_norm.weight[...], cfg.rms_norm_eps
    )
    hidden = model.norm(final_mix)
    logits = None
    new_tokens = embeds.shape[1] if real_tokens is None else real_tokens
    if compute_logits:
        scored = hidden
        if last_logits_only:
            scored = hidden[:, -1:] if real_tokens is None else jax.lax.dynamic_slice_in_dim(hidden, real_tokens - 1, 1, 1)
        logits = linear(scored, model.lm_head.weight[...]).astype(F32)
    out = ForwardOutput(logits, hidden, final_mix, tuple(taps) if collect_taps else None, stats)
    new_cache = ModelCache(head, groups, tail, position + new_tokens, start) if cache is not None else None
    return out, new_cache


def forward(model: K3Model, input_ids: jax.Array, *, collect_taps: bool = False) -> ForwardOutput:
    """Forward without a cache (training, scoring, teacher-forced checks); the ids are checked, then
    the pass runs jitted."""
    return _forward(model, check_input_ids(input_ids, model.config), collect_taps=collect_taps)


@functools.partial(jax.jit, static_argnames=("collect_taps",))
def _forward(model: K3Model, input_ids: jax.Array, *, collect_taps: bool = False) -> ForwardOutput:
    return run_model(model, input_ids, collect_taps=collect_taps)[0]



def forward_images(
    model: K3Model, input_ids: Any, pixel_values: Any, grid_thws: Any
) -> tuple[jax.Array, jax.Array | None]:
    """Forward of prompts with images, the official inference path: each image has exactly one
    placeholder (`media_placeholder_token_id`) in `input_ids`, expanded in place to its features.

    Returns (logits [B, T', vocab] fp32, start): the expanded rows left-aligned to the longest one,
    `start[b]` the first real position of row b (None when no row is padded); each row computes
    exactly what it would alone. Every input is checked before anything compiles."""
    ids = check_input_ids(input_ids, model.config)
    images, start = prepare_images(model, ids, None, pixel_values, grid_thws)
    return _forward_images(model, ids, images, start), start


def embed_images(model: K3Model, ids: jax.Array, images: ImageInputs) -> jax.Array:
    """The merged input embeddings of prompts with images (`k3jax.vision.embed`), for `run_model`."""
    return image_embeds(model.embed_tokens, model.vision_tower, model.mm_projector, ids, images)


@jax.jit
def _forward_images(model: K3Model, ids: jax.Array, images: ImageInputs, start: jax.Array | None) -> jax.Array:
    return run_model(model, None, start=start, inputs_embeds=embed_images(model, ids, images))[0].logits

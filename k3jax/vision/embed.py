"""Images into the text model: checks, the expanded layout, and the merged input embeddings.

Official inference semantics: `input_ids` hold exactly ONE placeholder token
(`media_placeholder_token_id`, `<|media_pad|>`) per image, in the order the images are given (row by
row over the batch); each placeholder is replaced in place by that image's (h/2)(w/2) feature rows.
Rows then differ in length, so the expanded rows are left-aligned into [B, T'] with `start` marking
each row's first real position (K3 has no positional encoding, so a left-padded row computes what it
would alone). Embeddings at `pad_token_id` positions are zero, as the official merge makes them.

The layout is computed on the host from the concrete ids (a gather into [token embeddings; image
features; one zero row]), so the compiled program sees only static shapes; the grids are static too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.vision.position import ROPE_MAX_SIDE
from k3jax.vision.tower import Grid


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """The images of one call, ready for a jitted forward (a pytree; `grids` is static)."""

    pixel_values: jax.Array  # [L, 3, p, p]
    gather: jax.Array  # int32 [B, T']: row of [token embeddings (B*T); features; zero row] per position
    grids: tuple[Grid, ...]


jax.tree_util.register_dataclass(ImageInputs, data_fields=["pixel_values", "gather"], meta_fields=["grids"])


def tokens_per_image(grid: Grid) -> int:
    """Feature rows (text positions) one item takes: its 2x2-merged grid, frames averaged."""
    return (grid[1] // 2) * (grid[2] // 2)


def check_grids(grid_thws: Any, vision, name: str = "grid_thws") -> tuple[Grid, ...]:
    """grid_thws [N, 3] integers (frames, rows, columns in patches) -> a static tuple, checked."""
    grids = np.asarray(grid_thws)
    if grids.ndim != 2 or grids.shape[1] != 3 or grids.shape[0] == 0 or not np.issubdtype(grids.dtype, np.integer):
        raise ValueError(f"{name} must be integers [num_images, 3] = (t, h, w) in patches; got {grids.dtype} "
                         f"{grids.shape}")
    for i, (t, h, w) in enumerate(grids.tolist()):
        if not 1 <= t <= vision.pos_emb_time:
            raise ValueError(f"{name}[{i}] = {(t, h, w)}: t must lie in [1, {vision.pos_emb_time}] frames")
        if h < 2 or w < 2 or h % 2 or w % 2 or h > ROPE_MAX_SIDE or w > ROPE_MAX_SIDE:
            raise ValueError(f"{name}[{i}] = {(t, h, w)}: h and w must be even patch counts in [2, {ROPE_MAX_SIDE}] "
                             "(the 2x2 merge; the processor pads images to a multiple of 28 pixels)")
    return tuple(tuple(g) for g in grids.tolist())


def check_pixels(pixel_values: Any, grids: tuple[Grid, ...], patch: int) -> jax.Array:
    """pixel_values [sum t*h*w, 3, p, p] floats, finite, matching the grids."""
    pixels = pixel_values if isinstance(pixel_values, jax.Array) else np.asarray(pixel_values)
    expected = (sum(t * h * w for t, h, w in grids), 3, patch, patch)
    if not jnp.issubdtype(pixels.dtype, jnp.floating) or tuple(pixels.shape) != expected:
        raise ValueError(f"pixel_values must be floats of shape {list(expected)} (the patches of grid_thws); got "
                         f"{pixels.dtype} {list(pixels.shape)}")
    finite = np.isfinite(pixels).all() if isinstance(pixels, np.ndarray) else jnp.isfinite(pixels).all()
    if not bool(finite):
        raise ValueError("pixel_values hold NaN or inf")
    return jnp.asarray(pixels)


def prepare_images(model, ids: jax.Array, start: jax.Array | None, pixel_values: Any,
                   grid_thws: Any) -> tuple[ImageInputs, jax.Array | None]:
    """Check the images against `model` and the ids [B, T] (`start`: left padding, or None) and lay
    out the expanded rows. -> (ImageInputs, start of the expanded rows or None when none is padded)."""
    cfg = model.config
    if model.vision_tower is None:
        raise ValueError("this model has no vision tower (its checkpoint holds no vision_tower weights or its "
                         "config no vision_config): it is text-only and cannot take images")
    if pixel_values is None or grid_thws is None:
        raise ValueError("images need both pixel_values and grid_thws (see k3jax.vision.process_images)")
    grids = check_grids(grid_thws, cfg.vision)
    pixels = check_pixels(pixel_values, grids, cfg.vision.patch_size)
    host = np.asarray(ids)
    batch, width = host.shape
    first = np.zeros(batch, np.int64) if start is None else np.asarray(start)
    counts = [tokens_per_image(g) for g in grids]
    feature_at = np.cumsum([0] + counts) + batch * width  # row of image i's first feature in the table
    zero_row = int(feature_at[-1])
    rows, image = [], 0
    for b in range(batch):
        real = host[b, int(first[b]):]
        sources = b * width + np.arange(int(first[b]), width)
        if cfg.pad_token_id is not None:
            sources = np.where(real == cfg.pad_token_id, zero_row, sources)
        pieces, previous = [], 0
        for mark in np.flatnonzero(real == cfg.media_placeholder_token_id).tolist():
            pieces.append(sources[previous:mark])
            if image < len(grids):
                pieces.append(np.arange(feature_at[image], feature_at[image] + counts[image]))
            image, previous = image + 1, mark + 1
        rows.append(np.concatenate(pieces + [sources[previous:]]))
    if image != len(grids):
        raise ValueError(f"input_ids hold {image} image placeholder(s) (media_placeholder_token_id="
                         f"{cfg.media_placeholder_token_id}) but {len(grids)} image(s) were given: each image "
                         "needs exactly one placeholder")
    longest = max(len(r) for r in rows)
    gather = np.full((batch, longest), zero_row, np.int32)
    for b, row in enumerate(rows):
        gather[b, longest - len(row):] = row
    pads = np.asarray([longest - len(r) for r in rows], np.int32)
    new_start = None if start is None and not pads.any() else jnp.asarray(pads)
    return ImageInputs(pixels, jnp.asarray(gather), grids), new_start


def image_embeds(embed_tokens: Callable[[jax.Array], jax.Array], tower, projector, ids: jax.Array,
                 images: ImageInputs) -> jax.Array:
    """The merged input embeddings [B, T', hidden]: token embeddings with every placeholder replaced
    by its image's projected features."""
    tokens = embed_tokens(ids)
    features = projector(tower(images.pixel_values, images.grids)).astype(tokens.dtype)
    table = jnp.concatenate([tokens.reshape(-1, tokens.shape[-1]), features,
                             jnp.zeros((1, tokens.shape[-1]), tokens.dtype)])
    return table[images.gather]

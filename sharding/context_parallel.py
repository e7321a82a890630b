"""Context-parallel MLA decode under `jax.shard_map`: the latent cache's positions split over one mesh
axis (`cache_length` -> `context` in DEFAULT_RULES), each device attending over its own positions and
one collective merging the partials (the math: `pallas_kernels.mla.absorbed`).

    out = context_parallel_absorbed_attention(q_latent, q_pe, latents, w_uv, scale=s, position=p, start=start,
                                              mesh=mesh, axis="context", batch_axes=("data", "fsdp"),
                                              head_axes=("tensor",))  # fp32 [B, T, H, V]

Per device: the scores, softmax statistics and weighted latents of its S/c positions only (its own
cache shard: 1/c of the work and of the cache reads), the un-normalised output projected by W_UV,
then ONE `all_gather` over `axis` of (max, sum, output) packed in one fp32 array [B, T, H, V + 2], and
every device merges the c partials by their log-sum-exp itself. Why an all-gather: a merge by
all-reductions alone needs the global max before the sums can be rescaled, i.e. a `pmax` and then a
`psum` — two collectives one after the other on the decode's critical path, where GSPMD's own
partitioning of the softmax issues three (max, sum, weighted latents). One all-gather is one
latency hop. It receives c x (V + 2) fp32 per (row, query, head) where a ring all-reduce moves
~2 x (V + 1): 4 c B H (V + 2) bytes per layer per step, small at decode batch sizes.
W_UV is applied before the gather because the merge is linear: the gathered payload is V + 2 floats
per head rather than R + 2 (kv_lora_rank).

The shard_map is manual over every axis it names: `axis` splits the positions, `batch_axes` the
rows and `head_axes` the heads (each kept only where its devices divide the dimension, as
`logical_to_spec` does), so each device's partial covers its rows and heads only and the one
all-gather runs over `axis` alone. (Leaving batch and heads to GSPMD, manual over `axis` only, makes
the partitioner replicate the gathered partials over the other axes first: a second collective.)
A positions axis laid out otherwise is resharded by the in_specs (replicated latents: a local slice,
no communication).

`GatedMLA` (k3jax/nn/mla.py) calls it, through the `ContextParallel` that `shard_model` /
`enable_context_parallelism` gives the layer, for single-token decode when the cache's positions
divide over `axis` (exactly when `shard_cache` splits them).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.mla import Partial, absorbed_partial, merge_partials

F32 = jnp.float32


def _shard_body(q_latent, q_pe, latents, w_uv, position, start, *, scale: float, axis: str) -> jax.Array:
    """One device: the partial over its positions, projected by W_UV, gathered once and merged."""
    local = latents.shape[1]
    key_pos = jax.lax.axis_index(axis) * local + jnp.arange(local)
    query_pos = position + jnp.arange(q_latent.shape[1])
    part = absorbed_partial(q_latent, q_pe, latents, scale=scale, query_pos=query_pos, key_pos=key_pos,
                            start=start)
    out = jnp.einsum("bthr,hvr->bthv", part.out, w_uv, precision=jax.lax.Precision.HIGHEST)
    packed = jnp.concatenate([part.max[..., None], part.sum[..., None], out], axis=-1)
    # [c, B, T, H, V + 2], the one collective; the same on every device of `axis` ("invarying"), as
    # out_specs (which do not name `axis`) say.
    every = jax.lax.all_gather(packed, axis, axis=0, to="invarying")
    return merge_partials(Partial(every[..., 0], every[..., 1], every[..., 2:]))


def _split(dim: int, axes: tuple[str, ...], mesh: Mesh) -> str | tuple[str, ...] | None:
    """The longest prefix of `axes` (size-1 axes dropped) whose devices divide `dim`, as a spec entry."""
    kept = [a for a in axes if mesh.shape[a] > 1]
    while kept and dim % math.prod(mesh.shape[a] for a in kept):
        kept.pop()
    return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def context_parallel_absorbed_attention(
    q_latent: jax.Array, q_pe: jax.Array, latents: jax.Array, w_uv: jax.Array, *, scale: float,
    position: jax.Array | int, start: jax.Array | None, mesh: Mesh, axis: str,
    batch_axes: tuple[str, ...] = (), head_axes: tuple[str, ...] = (),
) -> jax.Array:
    """Absorbed attention of T queries at positions position..position+T-1 over latents split along
    their positions over `axis` -> fp32 [B, T, H, V], rows over `batch_axes` and heads over `head_axes`.

    q_latent [B, T, H, R] (q_nope W_UK), q_pe [B, T, H, P], latents [B, S, R + P] with S divisible by
    the size of `axis`, w_uv [H, V, R], position int scalar, start int32 [B] or None (left padding)."""
    size = mesh.shape[axis]
    if latents.shape[1] % size:
        raise ValueError(f"context_parallel_absorbed_attention: latents {latents.shape} have "
                         f"{latents.shape[1]} positions, not divisible by mesh axis {axis!r} of size {size}")
    rows = _split(latents.shape[0], tuple(a for a in batch_axes if a != axis), mesh)
    heads = _split(q_latent.shape[2], tuple(a for a in head_axes if a != axis), mesh)
    query_spec = P(rows, None, heads, None)
    body = functools.partial(_shard_body, scale=scale, axis=axis)
    args = (q_latent.astype(F32), q_pe.astype(F32), latents, w_uv.astype(F32), jnp.asarray(position, jnp.int32))
    specs = (query_spec, query_spec, P(rows, axis, None), P(heads, None, None), P())
    if start is not None:
        args, specs = (*args, start), (*specs, P(rows))
    else:
        body = functools.partial(body, start=None)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=query_spec)(*args)


@dataclass(frozen=True)
class ContextParallel:
    """A layer's context-parallel decode setting (static, hashable): the mesh, the axis the cache's
    positions split over, and the axes of the rows and heads (from the rule table)."""

    mesh: Mesh
    axis: str
    batch_axes: tuple[str, ...] = ()
    head_axes: tuple[str, ...] = ()

    def splits(self, capacity: int) -> bool:
        """Whether a cache of `capacity` positions splits over the axis (as `shard_cache` splits it:
        only when they divide evenly)."""
        return capacity % self.mesh.shape[self.axis] == 0

    def attend(self, q_latent: jax.Array, q_pe: jax.Array, latents: jax.Array, w_uv: jax.Array, *,
               scale: float, position: jax.Array | int, start: jax.Array | None) -> jax.Array:
        """`context_parallel_absorbed_attention` with this setting."""
        return context_parallel_absorbed_attention(
            q_latent, q_pe, latents, w_uv, scale=scale, position=position, start=start, mesh=self.mesh,
            axis=self.axis, batch_axes=self.batch_axes, head_axes=self.head_axes)


__all__ = ["ContextParallel", "context_parallel_absorbed_attention"]

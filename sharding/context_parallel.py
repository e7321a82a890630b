"""Context-parallel MLA decode under `jax.shard_map`: the latent cache's positions split over one mesh
axis (`cache_length` -> `context` in DEFAULT_RULES), each device attending over its own positions and
one collective merging the partials (the math: `pallas_kernels.mla.absorbed`).

    out = context_parallel_absorbed_attention(q_latent, q_pe, latents, w_uv, scale=s, position=p,
                                              start=start, mesh=mesh, axis="context")  # fp32 [B, T, H, V]

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

Only `axis` is manual (`axis_names`): batch (data/fsdp) and heads (tensor) stay with GSPMD, as the
rest of the model has them. A positions axis not split over `axis` is resharded by the in_specs
(replicated latents: a local slice, no communication).

`GatedMLA` (k3jax/nn/mla.py) calls this for single-token decode when `shard_model` /
`enable_context_parallelism` has given it the mesh and the cache's positions divide over the axis
(exactly when `shard_cache` splits them).
"""

from __future__ import annotations

import functools

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
    # [c, B, T, H, V + 2], the one collective; the same on every device ("invarying"), as out_specs P() says.
    every = jax.lax.all_gather(packed, axis, axis=0, to="invarying")
    return merge_partials(Partial(every[..., 0], every[..., 1], every[..., 2:]))


def context_parallel_absorbed_attention(
    q_latent: jax.Array, q_pe: jax.Array, latents: jax.Array, w_uv: jax.Array, *, scale: float,
    position: jax.Array | int, start: jax.Array | None, mesh: Mesh, axis: str,
) -> jax.Array:
    """Absorbed attention of T queries at positions position..position+T-1 over latents split along
    their positions over `axis` -> fp32 [B, T, H, V].

    q_latent [B, T, H, R] (q_nope W_UK), q_pe [B, T, H, P], latents [B, S, R + P] with S divisible by
    the size of `axis`, w_uv [H, V, R], position int scalar, start int32 [B] or None (left padding)."""
    size = mesh.shape[axis]
    if latents.shape[1] % size:
        raise ValueError(f"context_parallel_absorbed_attention: latents {latents.shape} have "
                         f"{latents.shape[1]} positions, not divisible by mesh axis {axis!r} of size {size}")
    position = jnp.asarray(position, jnp.int32)
    body = functools.partial(_shard_body, scale=scale, axis=axis)
    args = (q_latent.astype(F32), q_pe.astype(F32), latents, w_uv.astype(F32), position)
    specs = (P(), P(), P(None, axis, None), P(), P())
    if start is not None:
        args, specs = (*args, start), (*specs, P())
    else:
        body = functools.partial(body, start=None)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), axis_names={axis})(*args)


__all__ = ["context_parallel_absorbed_attention"]

"""Work decomposition shared by the GPU grouped GEMMs (Triton and Mosaic GPU): groups' row ranges and
the order in which (row tile, column block) programs are numbered.

Computed in plain JAX inside the same jit (a few hundred int32 ops over [programs] x [groups] arrays).
Programs are numbered expert by expert, and inside an expert column-block-major with the row tiles
fastest, so the programs resident at one time share one expert's weight column block (read from HBM
once, then from L2) and the expert's rows stay in L2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_bounds(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(starts, sizes) int32 [E + 1] of each group's rows, sizes clipped to num_rows; the extra
    group E holds the rows past sum(group_sizes) (a virtual expert whose rows come out zero)."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)
    sizes = jnp.concatenate([jnp.diff(ends, prepend=0), num_rows - ends[-1:]]).astype(jnp.int32)
    return jnp.cumsum(sizes) - sizes, sizes


def tile_programs(tiles: jax.Array, num_n_blocks: int, num_programs: int):
    """Programs numbered over groups' row tiles: (group, local tile, column block, valid) for
    programs 0 .. num_programs - 1, given each group's tile count [E + 1]. Groups in
    order; inside a group column-block-major with the row tiles fastest, so co-resident programs
    share a weight block. Programs past the last tile get valid False (group clamped to E)."""
    tile_off = jnp.cumsum(tiles) - tiles  # first tile of each group
    prog_end = (tile_off + tiles) * num_n_blocks  # programs of group g: [tile_off[g] * NB, prog_end[g])
    p = jnp.arange(num_programs, dtype=jnp.int32)
    grp = jnp.sum(p[:, None] >= prog_end[None, :], axis=1, dtype=jnp.int32)  # empty groups are skipped
    num_groups = tiles.shape[0] - 1
    valid = grp <= num_groups
    grp = jnp.minimum(grp, num_groups)
    q = p - tile_off[grp] * num_n_blocks
    per = jnp.maximum(tiles[grp], 1)
    return grp, q % per, q // per, valid

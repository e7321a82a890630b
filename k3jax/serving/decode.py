"""The engine's decode step, with the model flattened once.

A jitted call that takes an NNX model walks its module graph in Python to flatten it, every call:
for an unrolled model that costs a sizeable share of a decode step's host time. The engine holds its
model for its whole life, so it flattens it once (`FlatModel`) and its steps pass the leaves, which
cross into the jitted step as a plain list of arrays.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from k3jax.model import K3Model, ModelCache, run_model
from k3jax.serving.sampler import RowParams, sample_rows


@jax.tree_util.register_pytree_node_class
class FlatModel:
    """A model's leaves and tree structure, taken once; the model itself comes back inside jit."""

    def __init__(self, leaves: list[jax.Array], treedef: Any) -> None:
        self.leaves, self.treedef = leaves, treedef

    @classmethod
    def of(cls, model: K3Model) -> "FlatModel":
        return cls(*jax.tree.flatten(model))

    def model(self) -> K3Model:
        return jax.tree.unflatten(self.treedef, self.leaves)

    def tree_flatten(self) -> tuple[list[jax.Array], Any]:
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef: Any, leaves: list[jax.Array]) -> "FlatModel":
        return cls(list(leaves), treedef)


@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("any_sampling",))
def decode_rows(flat: FlatModel, cache: ModelCache, tokens: jax.Array, keys: jax.Array, params: RowParams,
                any_sampling: bool) -> tuple[jax.Array, ModelCache]:
    """One decode step of every slot: each row's next token, sampled with its key and settings."""
    out, cache = run_model(flat.model(), tokens[:, None], cache)
    return sample_rows(out.logits[:, 0], keys, params, any_sampling=any_sampling), cache

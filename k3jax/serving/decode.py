"""The engine's decode step: the model flattened once, and steps read one step late.

A jitted call that takes an NNX model walks its module graph in Python to flatten it, every call:
for an unrolled model that costs a sizeable share of a decode step's host time. The engine holds its
model for its whole life, so it flattens it once (`FlatModel`) and its steps pass the leaves, which
cross into the jitted step as a plain list of arrays.

The engine dispatches step k+1 before it reads step k's tokens (`InFlight`): a row that was in step
k is fed its token from the device array step k returned, so the host's work between steps (handing
out tokens, retiring rows, admitting) overlaps the device's. A row whose last token came from the
host (just admitted: its first token is sampled with its prefill) is fed from the host. A row that
ends at step k has also run step k+1 when the engine learns it: that step's token is dropped, and its
cache then holds every token it generated (the prefix snapshot keeps them all).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.model import K3Model, ModelCache, run_model
from k3jax.serving.request import EngineRequest
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


@dataclass(frozen=True)
class InFlight:
    """A dispatched decode step whose tokens the host has not read: the device array and the request
    each slot held when it was dispatched."""

    tokens: jax.Array  # [max_batch] int32, on the device
    rows: dict[int, EngineRequest]


class StepInputs(NamedTuple):
    host_tokens: np.ndarray  # [max_batch] int32: the last token of rows fed from the host
    from_host: np.ndarray  # [max_batch] bool: False where the token is the previous step's, on the device
    keys: np.ndarray  # [max_batch, 2] uint32: the key of the token each row samples
    params: RowParams


def step_inputs(active: dict[int, EngineRequest], previous: InFlight | None, max_batch: int,
                pad_id: int) -> StepInputs:
    """Each active row's input token and sampling key for the next decode step. A row that was in the
    step in flight is fed that step's token (on the device) and samples the token after it; a row that
    was not (just admitted) is fed its last token from the host. Token i samples with key i (token 0
    with its prefill); a key past the budget is zero (that token is dropped). Idle rows feed the pad id."""
    host_tokens = np.full(max_batch, pad_id, np.int32)
    from_host = np.ones(max_batch, bool)
    keys = np.zeros((max_batch, 2), np.uint32)
    rows = [(0.0, None, None)] * max_batch
    for slot, request in active.items():
        in_flight = previous is not None and previous.rows.get(slot) is request
        if in_flight:
            from_host[slot] = False
        else:
            host_tokens[slot] = request.generated[-1]
        sampled = len(request.generated) + in_flight
        if sampled < len(request.keys):
            keys[slot] = request.keys[sampled]
        rows[slot] = (request.req.temperature, request.req.top_k, request.req.top_p)
    return StepInputs(host_tokens, from_host, keys, RowParams.of(rows))


@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("any_sampling",))
def decode_rows(flat: FlatModel, cache: ModelCache, previous: jax.Array, inputs: StepInputs,
                any_sampling: bool) -> tuple[jax.Array, ModelCache]:
    """One decode step of every slot: each row's next token, sampled with its key and settings. Rows
    take their input token from `inputs.host_tokens` or, where `inputs.from_host` is False, from
    `previous` (the tokens of the step before, still on the device)."""
    tokens = jnp.where(inputs.from_host, inputs.host_tokens, previous)
    out, cache = run_model(flat.model(), tokens[:, None], cache)
    return sample_rows(out.logits[:, 0], inputs.keys, inputs.params, any_sampling=any_sampling), cache

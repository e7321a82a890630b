"""The inference programs a plan compiles, lowered over the abstract sharded state (nothing runs).

prefill: one `seq_len`-token chunk appended to a cache of capacity `max_len` (the cache donated, only
the last position's logits kept), as `k3jax.prefill` runs every chunk of a long prompt; decode: one
token per row, the cache donated. The train step is `memory_plan.train`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.memory_plan.state import abstract_state
from k3jax.model import run_model
from sharding import DEFAULT_RULES, logical_to_spec

Lowering = Callable[[], jax.stages.Lowered]


def lowerings(cfg: K3Config, mesh: Mesh, *, experts: str, batch: int, max_len: int, seq_len: int,
              kernels: Kernels) -> dict[str, Lowering]:
    """Program name -> a thunk that lowers it ("prefill", "decode")."""
    state = abstract_state(cfg, mesh, experts=experts, batch=batch, max_len=max_len, kernels=kernels)
    params, model_def, caches, cache_def = state.params, state.model_def, state.caches, state.cache_def
    batch_spec = logical_to_spec(("activation_batch", None), DEFAULT_RULES, mesh, (batch, 1))
    ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=NamedSharding(mesh, batch_spec))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(*batch_spec[:1])))
    cache_sh = [c.sharding for c in caches]

    def prefill(p, c, ids):
        m = jax.tree.unflatten(model_def, p)
        out, new = run_model(m, ids, jax.tree.unflatten(cache_def, c), last_logits_only=True)
        return out.logits[:, 0], jax.tree.leaves(new)

    def decode(p, c, tokens):
        m = jax.tree.unflatten(model_def, p)
        out, new = run_model(m, tokens[:, None], jax.tree.unflatten(cache_def, c))
        return out.logits[:, 0], jax.tree.leaves(new)

    return {
        "prefill": lambda: jax.jit(prefill, out_shardings=(None, cache_sh), donate_argnums=1)
        .lower(params, caches, ids),
        "decode": lambda: jax.jit(decode, out_shardings=(None, cache_sh), donate_argnums=1)
        .lower(params, caches, tokens),
    }

"""The programs a plan compiles, lowered over the abstract sharded state (nothing runs).

prefill: one `seq_len`-token chunk appended to a cache of capacity `max_len` (the cache donated, only
the last position's logits kept), as `k3jax.prefill` runs every chunk of a long prompt; decode: one
token per row, the cache donated; train (optional):
cross-entropy on `seq_len` tokens and one adamw update, parameters and optimizer state donated.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.memory_plan.state import abstract_state, optimizer_state
from k3jax.model import run_model
from sharding import DEFAULT_RULES, logical_to_spec

Lowering = Callable[[], jax.stages.Lowered]


def lowerings(cfg: K3Config, mesh: Mesh, *, experts: str, batch: int, max_len: int, seq_len: int, train: bool,
              kernels: Kernels, lr: float = 1e-4) -> dict[str, Lowering]:
    """Program name -> a thunk that lowers it ("prefill", "decode", and "train" when asked)."""
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

    found: dict[str, Lowering] = {
        "prefill": lambda: jax.jit(prefill, out_shardings=(None, cache_sh), donate_argnums=1)
        .lower(params, caches, ids),
        "decode": lambda: jax.jit(decode, out_shardings=(None, cache_sh), donate_argnums=1)
        .lower(params, caches, tokens),
    }
    if not train:
        return found
    opt_leaves, opt_def, opt = optimizer_state(params, mesh, lr)
    replicated = NamedSharding(mesh, PartitionSpec())

    def loss_fn(p, ids):
        m = jax.tree.unflatten(model_def, p)
        logits = run_model(m, ids[:, :-1])[0].logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    def train_step(p, o, ids):
        loss, grads = jax.value_and_grad(loss_fn)(p, ids)
        updates, o = opt.update(grads, jax.tree.unflatten(opt_def, o), p)
        return loss, optax.apply_updates(p, updates), jax.tree.leaves(o)

    train_ids = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32, sharding=ids.sharding)
    found["train"] = lambda: jax.jit(
        train_step, out_shardings=(replicated, [p.sharding for p in params], [o.sharding for o in opt_leaves]),
        donate_argnums=(0, 1)).lower(params, opt_leaves, train_ids)
    return found

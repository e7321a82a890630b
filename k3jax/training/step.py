"""`Trainer`: one jitted fine-tuning step of a K3Model (full or LoRA), with the state that resumes it exactly.

The model is split once (`nnx.split`) into what the optimizer trains, the router biases (state that
Quantile Balancing rewrites outside the gradient), the LoRA dropout keys and everything frozen. The
trained leaves are kept as fp32 masters, which the optimizer (optax, fp32 moments) updates; each
step casts them to the model's dtype for the forward, so a bf16 model trains with bf16 compute and
fp32 weights and moments (the gradient of the cast returns fp32 gradients). Frozen weights stay as
loaded (packed MXFP4 experts stay packed: integer leaves are never trained) and are passed to the
step, not donated. With a mesh the model is placed by `sharding.shard_model` and the batch split
over the data axes; GSPMD partitions the step from those shardings (masters and moments inherit
their parameter's layout, so FSDP / tensor / expert splits hold for the optimizer state too).
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from k3jax.model import K3Model, run_model
from k3jax.nn.decoder import DecoderLayer
from k3jax.nn.moe import LatentMoE, RouterBias
from k3jax.training.balance import load_imbalance, quantile_balance
from k3jax.training.config import Batch, TrainConfig
from k3jax.training.lora import LoRALinear, LoRARoutedExperts, add_lora, merge_lora
from k3jax.training.lora_dropout import LoRADropoutKey, refresh_dropout_keys
from k3jax.training.loss import LossSums, chunked_cross_entropy
from k3jax.training.optim import learning_rate_schedule, make_optimizer, path_name
from sharding.rules import DEFAULT_RULES
from sharding.shard_model import named_sharding, shard_model

F32 = jnp.float32


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _fill(template: nnx.State, pure: Any, cast: bool = False) -> nnx.State:
    """A fresh State shaped like `template` holding `pure`'s arrays (cast to the template's dtypes)."""
    state = _abstract(template)
    if cast:
        pure = jax.tree.map(lambda x, t: x.astype(t.dtype), pure, nnx.to_pure_dict(template))
    nnx.replace_by_pure_dict(state, pure)
    return state


def _committed(x: Any) -> Any:
    """`x` committed to the devices it lies on; a tracer (a Trainer built under `jax.eval_shape`) as is."""
    return x if isinstance(x, jax.core.Tracer) else jax.device_put(x, x.sharding)


def _stats_like(bias: dict, stats: tuple, field: str) -> dict:
    """The `field` of `run_model`'s router stats arranged like the router-bias state's pure dict."""
    parts = {"head_layers": 0, "group_layers": 1, "tail_layers": 2}
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(stats[parts[path[0].key]][path[1].key], field), bias
    )


def check_batch(batch: Batch, vocab: int, accum: int) -> Batch:
    """The batch as device arrays, checked on the host before any cast or compile."""
    if not isinstance(batch, Batch):
        raise TypeError(f"batch: expected a k3jax.training.Batch, got {type(batch).__name__}")
    arrays = {name: np.asarray(getattr(batch, name)) for name in Batch._fields}
    shape = arrays["input_ids"].shape
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"batch.input_ids: expected a non-empty [B, T] array, got shape {shape}")
    for name, kind in (("input_ids", "i"), ("targets", "i"), ("loss_mask", "f"), ("segment_ids", "i")):
        a = arrays[name]
        if a.shape != shape:
            raise ValueError(f"batch.{name}: expected shape {shape} like input_ids, got {a.shape}")
        if (kind == "i" and not np.issubdtype(a.dtype, np.integer)) or (kind == "f" and not np.issubdtype(a.dtype, np.number)):
            raise ValueError(f"batch.{name}: expected {'an integer' if kind == 'i' else 'a numeric'} array, got {a.dtype}")
    for name in ("input_ids", "targets"):
        a = arrays[name] if name == "input_ids" else np.where(arrays["loss_mask"] != 0, arrays[name], 0)
        if a.min() < 0 or a.max() >= vocab:
            raise ValueError(f"batch.{name}: ids must lie in [0, {vocab}) (targets where loss_mask != 0); "
                             f"got [{a.min()}, {a.max()}]")
    if arrays["segment_ids"].min() < 0:
        raise ValueError("batch.segment_ids: expected ids >= 0 (0 = padding)")
    if shape[0] % accum:
        raise ValueError(f"batch: {shape[0]} rows do not split into TrainConfig.grad_accum_steps={accum} micro-batches")
    return Batch(jnp.asarray(arrays["input_ids"], jnp.int32), jnp.asarray(arrays["targets"], jnp.int32),
                 jnp.asarray(arrays["loss_mask"], F32), jnp.asarray(arrays["segment_ids"], jnp.int32))


class Trainer:
    """Fine-tunes `model` by `config`; the model passed in is not modified."""

    def __init__(self, model: K3Model, config: TrainConfig, *, mesh: Mesh | None = None, seed: int = 0) -> None:
        if not isinstance(model, K3Model):
            raise TypeError(f"model: expected a k3jax K3Model, got {type(model).__name__}")
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config: expected a k3jax.training.TrainConfig, got {type(config).__name__}")
        self.config, self.mesh = config, mesh
        model = nnx.merge(*nnx.split(model))  # new module objects over the same arrays
        for _, module in nnx.iter_modules(model):
            if isinstance(module, DecoderLayer):
                module.remat_policy = None if config.remat == "none" else config.remat
        self.lora_modules = ()
        if config.lora_rank:
            self.lora_modules = tuple(add_lora(model, rank=config.lora_rank, alpha=config.lora_alpha,
                                               dropout=config.lora_dropout, targets=config.lora_targets, seed=seed))
        if mesh is not None:
            model = shard_model(model, mesh)
            if any(isinstance(m, LatentMoE) and m.expert_mesh is not None and isinstance(m.experts, LoRARoutedExperts)
                   for _, m in nnx.iter_modules(model)):
                raise ValueError(f"TrainConfig.lora_targets: LoRA on the routed experts ('*.experts') does not run "
                                 f"expert-parallel; use a mesh without an expert axis (got {dict(mesh.shape)})")
        self.model_config = model.config

        def trainable(path: tuple, value: Any) -> bool:
            if not isinstance(value, nnx.Param) or not jnp.issubdtype(value.dtype, jnp.floating):
                return False  # integer leaves (MXFP4 codes and scales) are never trained
            if config.lora_rank and not isinstance(value, nnx.LoRAParam):
                return False
            return not any(fnmatch.fnmatchcase(".".join(map(str, path)), p) for p in config.freeze)

        self._graphdef, params, bias, keys, self._frozen = nnx.split(model, trainable, RouterBias, LoRADropoutKey, ...)
        if not jax.tree.leaves(params):
            raise ValueError(f"TrainConfig.freeze: {config.freeze} leaves nothing to train")
        for _, module in nnx.iter_modules(model):
            if isinstance(module, (LoRALinear, LoRARoutedExperts)):
                module.deterministic = True
        self._eval_graphdef = nnx.split(model, trainable, RouterBias, LoRADropoutKey, ...)[0]
        self._templates = (_abstract(params), _abstract(bias), _abstract(keys))
        self.trainable_names = tuple(path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(params)))
        self.optimizer = make_optimizer(config, model.config)
        self.schedule = learning_rate_schedule(config)
        masters = jax.tree.map(lambda x: x.astype(F32), nnx.to_pure_dict(params))
        self._state = {
            "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(jax.random.key(seed)),
            "params": masters,
            "opt_state": self.optimizer.init(masters),
            "router_bias": nnx.to_pure_dict(bias),
        }
        # Every leaf committed to where it lies, as `restore` places a resumed run's state: an uncommitted
        # leaf lowers without a sharding annotation, so a fresh and a resumed run would compile two programs.
        self._state = jax.tree.map(_committed, self._state)
        self._step = jax.jit(self._train_step, donate_argnums=0, static_argnames="packed")
        self._grads = jax.jit(functools.partial(self._accumulate, deterministic=True), static_argnames="packed")
        self._eval = jax.jit(self._eval_sums, static_argnames="packed")

    # ---- the math ---------------------------------------------------------------------------
    def _model(self, params: Any, bias: Any, keys: Any, frozen: nnx.State, *, deterministic: bool) -> K3Model:
        p_t, b_t, k_t = self._templates
        graphdef = self._eval_graphdef if deterministic else self._graphdef
        return nnx.merge(graphdef, _fill(p_t, params, cast=True), _fill(b_t, bias), _fill(k_t, keys), frozen)

    def _sums(self, params, bias, keys, frozen, batch: Batch, *, deterministic: bool, stats: bool, packed: bool):
        model = self._model(params, bias, keys, frozen, deterministic=deterministic)
        out, _ = run_model(model, batch.input_ids, segment_ids=batch.segment_ids if packed else None,
                           compute_logits=False, collect_router_stats=stats, router_stats_mask=batch.segment_ids > 0)
        hidden = out.final_hidden.reshape(-1, out.final_hidden.shape[-1])
        sums = chunked_cross_entropy(hidden, model.lm_head.weight[...], batch.targets.reshape(-1),
                                     batch.loss_mask.reshape(-1), vocab_chunk=self.config.vocab_chunk)
        return sums, out.router_stats

    def _accumulate(self, state: dict, frozen: nnx.State, batch: Batch, *, packed: bool, deterministic: bool = False):
        """Gradients of the step's mean loss (fp32, like the masters), loss sums and router stats,
        summed over `grad_accum_steps` micro-batches (a `lax.scan`)."""
        accum, qb = self.config.grad_accum_steps, self.config.quantile_balancing
        total = jnp.maximum(jnp.sum(batch.loss_mask), 1.0)
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        keys_pure = nnx.to_pure_dict(self._templates[2])

        def objective(params, micro, index):
            keys = refresh_dropout_keys(keys_pure, jax.random.fold_in(step_key, index)) if not deterministic else \
                jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), keys_pure)
            sums, stats = self._sums(params, state["router_bias"], keys, frozen, micro,
                                     deterministic=deterministic, stats=qb, packed=packed)
            hist = _stats_like(state["router_bias"], stats, "histogram") if qb else None
            load = _stats_like(state["router_bias"], stats, "load") if qb else None
            return (sums.nll + self.config.z_loss * sums.z) / total, (sums, hist, load)

        grad_fn = jax.value_and_grad(objective, has_aux=True)
        micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

        def body(carry, xs):
            (_, aux), grads = grad_fn(state["params"], *xs)
            return jax.tree.map(jnp.add, carry, (grads, aux)), None

        (_, aux0), grads0 = grad_fn(state["params"], jax.tree.map(lambda x: x[0], micro), 0)
        carry = (grads0, aux0)
        if accum > 1:
            rest = (jax.tree.map(lambda x: x[1:], micro), jnp.arange(1, accum))
            carry, _ = jax.lax.scan(body, carry, rest)
        grads, (sums, hist, load) = carry
        return grads, sums, hist, load

    def _train_step(self, state: dict, frozen: nnx.State, batch: Batch, packed: bool) -> tuple[dict, dict]:
        grads, sums, hist, load = self._accumulate(state, frozen, batch, packed=packed)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        bias = state["router_bias"]
        metrics = {
            "loss": sums.nll / jnp.maximum(sums.tokens, 1.0),
            "z_loss": sums.z / jnp.maximum(sums.tokens, 1.0),
            "grad_norm": optax.tree.norm(grads),
            "lr": self.schedule(state["step"]),
            "tokens": sums.tokens,
        }
        if self.config.quantile_balancing:
            top_k = self.model_config.num_experts_per_token
            bias = jax.tree.map(lambda h, b: quantile_balance(h, b, top_k), hist, bias)
            metrics["max_load_ratio"] = jnp.max(jnp.stack([jnp.max(load_imbalance(x)) for x in jax.tree.leaves(load)]))
        new_state = {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state, "router_bias": bias}
        return new_state, metrics

    def _eval_sums(self, state: dict, frozen: nnx.State, batch: Batch, packed: bool) -> LossSums:
        keys = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), nnx.to_pure_dict(self._templates[2]))
        return self._sums(state["params"], state["router_bias"], keys, frozen, batch, deterministic=True,
                          stats=False, packed=packed)[0]

    # ---- public -----------------------------------------------------------------------------
    def _place(self, batch: Batch) -> tuple[Batch, bool]:
        """The checked batch on the mesh, and whether any row packs documents. A row holding one document
        then padding (ids c..c 0..0) needs no resets (padding after a document cannot reach it), so
        such batches run without segment ids and keep the fused KDA kernels, which do not take them."""
        batch = check_batch(batch, self.model_config.vocab_size, self.config.grad_accum_steps)
        seg = np.asarray(batch.segment_ids)
        first = seg[:, :1]
        packed = bool(np.any((seg != first) & (seg != 0)) or np.any((seg[:, 1:] != 0) & (seg[:, :-1] == 0)))
        if self.mesh is not None:
            sharding = named_sharding(("activation_batch", None), batch.input_ids.shape, self.mesh, DEFAULT_RULES)
            batch = jax.device_put(batch, sharding)
        return batch, packed

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch` (its rows split into `grad_accum_steps` micro-batches).

        Returns metrics: loss (mean next-token NLL over counted tokens), z_loss (mean logsumexp^2),
        grad_norm (before clipping), lr (this step's), tokens (counted), and with Quantile Balancing
        max_load_ratio (max over MoE layers of max / mean expert load in this batch)."""
        self._state, metrics = self._step(self._state, self._frozen, *self._place(batch))
        return {name: float(value) for name, value in metrics.items()}

    def gradients(self, batch: Batch) -> tuple[float, dict]:
        """(mean loss, fp32 gradients of the trained leaves as a pure dict) at the current weights,
        without dropout and without updating anything."""
        batch, packed = self._place(batch)
        grads, sums, _, _ = self._grads(self._state, self._frozen, batch, packed=packed)
        return float(sums.nll / jnp.maximum(sums.tokens, 1.0)), grads

    def eval_loss(self, batch: Batch) -> float:
        """Mean next-token NLL over the batch's counted tokens (no dropout, nothing updated)."""
        sums = self._eval(self._state, self._frozen, *self._place(batch))
        return float(sums.nll / jnp.maximum(sums.tokens, 1.0))

    def state(self) -> dict:
        """Everything that resumes training exactly, as a pytree of arrays Orbax saves as is:
        step, rng (key data), params (fp32 masters of the trained leaves, pure dict), opt_state
        (optax), router_bias (pure dict). Frozen weights are not in it: they come from the model."""
        return self._state

    def frozen_state(self) -> nnx.State:
        """The leaves every step reads but never updates (the frozen base, MXFP4 codes), as passed to it."""
        return self._frozen

    def trained_templates(self) -> tuple[nnx.State, nnx.State]:
        """Shapes and dtypes (in the model's layout) of the trained leaves and of the router biases."""
        return self._templates[0], self._templates[1]

    def lower_step(self, state: dict, frozen: nnx.State, batch: Batch, *, packed: bool) -> jax.stages.Lowered:
        """The training step lowered on `state` / `frozen` / `batch` (arrays or ShapeDtypeStructs carrying
        shardings), not run: what `k3jax plan --train` compiles to read its memory."""
        return self._step.lower(state, frozen, batch, packed=packed)

    def restore(self, state: dict) -> None:
        """Resume from a `state()` pytree (e.g. restored by Orbax); structure, shapes and dtypes must match."""
        expected = jax.tree.structure(self._state)
        if jax.tree.structure(state) != expected:
            raise ValueError(f"restore: the state's structure does not match this trainer's ({expected})")
        for (path, new), old in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(self._state)):
            if tuple(np.shape(new)) != tuple(old.shape) or jnp.asarray(new).dtype != old.dtype:
                raise ValueError(f"restore: {jax.tree_util.keystr(path)} is {np.shape(new)} "
                                 f"{jnp.asarray(new).dtype}, expected {old.shape} {old.dtype}")
        self._state = jax.tree.map(lambda new, old: jax.device_put(jnp.asarray(new), old.sharding), state, self._state)

    def merged_model(self) -> K3Model:
        """The trained model in its own dtype: LoRA adapters folded into their base weights, current
        router biases, no remat (what export writes and inference runs)."""
        keys = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), nnx.to_pure_dict(self._templates[2]))
        model = self._model(self._state["params"], self._state["router_bias"], keys, self._frozen, deterministic=True)
        model = merge_lora(nnx.merge(*nnx.split(model)))
        for _, module in nnx.iter_modules(model):
            if isinstance(module, DecoderLayer):
                module.remat_policy = None
        return model

"""The train step a plan compiles: the real `k3jax.training.Trainer` step, over abstract sharded state.

The Trainer is built inside `jax.eval_shape` on `K3Model.init` (routed experts packed MXFP4 if asked),
so its own code runs unchanged on shapes: the remat policy, `add_lora` (LoRA mode), `shard_model`
(which also turns on expert parallelism), the split into trained / router-bias / frozen leaves, the
fp32 masters and `make_optimizer`'s optax state. Nothing is allocated. The trainer's state is then
replaced by its sharded abstract counterpart and the step is lowered (`Trainer.lower_step`, the jitted
program `Trainer.step` runs) over ShapeDtypeStructs carrying the NamedShardings the trainer's
arrays would have (`sharding.param_shardings` for the model's leaves; masters and moments take
their parameter's layout, as in the trainer; step, rng and optimizer counts replicated).

What the Trainer holds per device, hence what this plans:
  full  trained: fp32 masters of every float parameter; optimizer: AdamW mu + nu (fp32) of each;
        frozen: integer leaves only (routed experts must be dense bf16 to be trained)
  lora  trained: the fp32 adapters; optimizer: AdamW mu + nu of the adapters; frozen: the whole
        base as loaded (bf16, routed experts packed MXFP4 or bf16); gradients w.r.t. adapters only
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.memory_plan.programs import Lowering
from k3jax.memory_plan.state import shard_bytes, total_bytes
from k3jax.model import K3Model
from k3jax.nn.moe import pack_routed_experts
from k3jax.training import Batch, TrainConfig, Trainer
from sharding import DEFAULT_RULES, param_shardings
from sharding.shard_model import named_sharding

TRAIN_MODES = ("full", "lora")
# Frozen top-level parts the text train step never reads: the trainer holds them on every device, but
# `jax.jit` drops unused arguments, so the compiled step's arguments leave them out (`AbstractTrainer.bytes`
# counts them as "unread" and the plan adds them to the peak).
UNREAD_BY_TEXT_STEP = ("vision_tower", "mm_projector")


def train_config(mode: str, *, lora_rank: int, remat: str) -> TrainConfig:
    """The TrainConfig of a planned run: the trainer's defaults (AdamW, default LoRA targets), with
    `lora_rank` adapters in "lora" mode and the `remat` policy."""
    if mode not in TRAIN_MODES:
        raise ValueError(f"train mode {mode!r}: expected one of {TRAIN_MODES}")
    return TrainConfig(lora_rank=lora_rank if mode == "lora" else 0, remat=remat)


def check_train_experts(mode: str, experts: str) -> None:
    """A full fine-tune trains the routed experts, which packed MXFP4 codes cannot be (no gradient)."""
    if mode == "full" and experts == "mxfp4":
        raise ValueError("--train full trains the routed experts, so they must be dense: use --experts bf16 (as "
                         "`k3jax finetune` loads them for a full fine-tune), or --train lora to keep them packed")


def _is_variable(x: object) -> bool:
    return isinstance(x, nnx.Variable)


def _placed(state: nnx.State, mesh: Mesh) -> nnx.State:
    """`state` with every Variable's value a ShapeDtypeStruct carrying its `param_shardings` layout."""
    shardings = param_shardings(state, mesh)
    return jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
                        state, shardings, is_leaf=_is_variable)


def _like_params(tree: Any, masters: dict, replicated: NamedSharding) -> Any:
    """Optimizer-state ShapeDtypeStructs: a leaf whose key path ends in a master's path (and has its shape)
    takes that master's sharding, every other leaf (step counts) is replicated. Matched by path because
    `optax.multi_transform` masks each group's state, so it is not a prefix tree of the parameters."""
    by_path = {tuple(k.key for k in path): x for path, x in jax.tree_util.tree_leaves_with_path(masters)}

    def place(path: tuple, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        keys: list = []
        for k in reversed(path):
            if not isinstance(k, jax.tree_util.DictKey):
                break
            keys.insert(0, k.key)
        master = by_path.get(tuple(keys))
        sharding = master.sharding if master is not None and master.shape == x.shape else replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(place, tree)


@dataclasses.dataclass
class AbstractTrainer:
    """A Trainer built on shapes, and the sharded abstract arguments of its step."""

    trainer: Trainer
    state: dict  # Trainer.state() as ShapeDtypeStructs: step, rng, params (fp32 masters), opt_state, router_bias
    frozen: nnx.State  # the frozen leaves, as passed to every step

    def bytes(self) -> dict[str, int]:
        """Per-device (and total) bytes of what the trainer holds, from the shardings alone."""
        groups = {"trained": self.state["params"], "optimizer": self.state["opt_state"], "frozen": self.frozen,
                  "other": (self.state["step"], self.state["rng"], self.state["router_bias"])}
        found = {}
        for name, tree in groups.items():
            leaves = jax.tree.leaves(tree)
            found[name], found[f"{name}_total"] = shard_bytes(leaves), total_bytes(leaves)
        found["unread"] = shard_bytes([x for key in UNREAD_BY_TEXT_STEP if key in self.frozen
                                       for x in jax.tree.leaves(self.frozen[key])])
        return found


def abstract_trainer(cfg: K3Config, mesh: Mesh, *, experts: str, kernels: Kernels, config: TrainConfig,
                     seed: int = 0) -> AbstractTrainer:
    """The Trainer of `config` on the model of `cfg` (routed experts "mxfp4"-packed or "bf16") on `mesh`."""
    check_train_experts("lora" if config.lora_rank else "full", experts)
    built: dict[str, Trainer] = {}

    def build() -> tuple[dict, nnx.State]:
        model = K3Model.init(cfg, seed=seed, kernels=kernels)
        if experts == "mxfp4":
            model = pack_routed_experts(model)
        built["trainer"] = Trainer(model, config, mesh=mesh, seed=seed)
        return built["trainer"].state(), built["trainer"].frozen_state()

    state, frozen = jax.eval_shape(build)
    trainer = built["trainer"]
    replicated = NamedSharding(mesh, PartitionSpec())
    params_t, bias_t = trainer.trained_templates()
    masters = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding),
                           nnx.to_pure_dict(_placed(params_t, mesh)))
    whole = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)  # noqa: E731
    abstract = {"step": whole(state["step"]), "rng": whole(state["rng"]), "params": masters,
                "opt_state": _like_params(state["opt_state"], masters, replicated),
                "router_bias": nnx.to_pure_dict(_placed(bias_t, mesh))}
    # The trainer's own state still holds the trace's abstract values; the step is only ever lowered
    # on these sharded stand-ins.
    return AbstractTrainer(trainer, abstract, _placed(frozen, mesh))


def train_lowering(planned: AbstractTrainer, mesh: Mesh, *, batch: int, seq_len: int) -> Lowering:
    """A thunk lowering the trainer's step on `batch` rows of `seq_len` tokens of packed documents
    (segment ids on, as `k3jax finetune` packs them), split over the data axes like `Trainer.step`'s batch."""
    sharding = named_sharding(("activation_batch", None), (batch, seq_len), mesh, DEFAULT_RULES)
    ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=sharding)
    rows = Batch(ids, ids, jax.ShapeDtypeStruct((batch, seq_len), jnp.float32, sharding=sharding), ids)
    return lambda: planned.trainer.lower_step(planned.state, planned.frozen, rows, packed=True)

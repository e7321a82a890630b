"""`k3jax plan --train full|lora` against the real trainer, on a 5-layer golden-width K3 and 8 fake CPU devices.

The plan's state bytes must be what `k3jax.training.Trainer` really holds on the same mesh (built for
real here: the model is tiny), the LoRA optimizer state must be the adapters' AdamW moments counted
independently from a LoRA-wrapped model, and one LoRA train step is compiled (the only compile).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from k3jax.memory_plan import plan_memory
from k3jax.memory_plan.plan import DEVICE_KERNELS
from k3jax.memory_plan.train import abstract_trainer, train_config
from k3jax.model import K3Model
from k3jax.nn.moe import pack_routed_experts
from k3jax.training import DEFAULT_LORA_TARGETS, GROUPS, LoRALinear, TrainConfig, Trainer, add_lora
from sharding import make_mesh
from tests.k3jax.training.small_k3 import small_config

MESH = "fsdp=2,expert=2,tensor=2"  # the 8 fake devices of tests/conftest.py
RANK = 4
# Each optimizer group's AdamW (optax.adamw on a schedule) keeps two int32 step counts: scale_by_adam's
# and scale_by_learning_rate's. They are replicated scalars, next to the moments.
COUNT_BYTES = len(GROUPS) * 2 * 4


def _device_bytes(tree) -> int:
    """Bytes one device holds of real arrays (the largest shard of each)."""
    return sum(max(s.data.nbytes for s in x.addressable_shards) for x in jax.tree.leaves(tree))


def _real_trainer(config: TrainConfig, *, packed: bool) -> Trainer:
    model = K3Model.init(small_config("bfloat16"), kernels=DEVICE_KERNELS)
    return Trainer(pack_routed_experts(model) if packed else model, config, mesh=make_mesh(MESH))


@pytest.fixture(scope="module")
def lora_plan():
    return plan_memory(small_config("bfloat16"), MESH, 10**9, batch=2, seq_len=32, train="lora", lora_rank=RANK)


def test_lora_optimizer_is_adamw_on_the_adapters_only(lora_plan):
    wrapped = K3Model.init(small_config("bfloat16"))
    add_lora(wrapped, rank=RANK, alpha=16.0, dropout=0.0, targets=DEFAULT_LORA_TARGETS, seed=0)
    adapters = sum(m.lora_a.size + m.lora_b.size for _, m in nnx.iter_modules(wrapped) if isinstance(m, LoRALinear))
    assert adapters > 0
    state = lora_plan.state
    assert state["trained_total"] == 4 * adapters  # fp32 adapters
    assert state["optimizer_total"] == 2 * 4 * adapters + COUNT_BYTES  # fp32 mu + nu of each adapter
    real = _real_trainer(train_config("lora", lora_rank=RANK, remat="none"), packed=True)
    assert state["optimizer"] == _device_bytes(real.state()["opt_state"])
    assert state["trained"] == _device_bytes(real.state()["params"])
    assert state["frozen"] == _device_bytes(real._frozen)  # the base as loaded: bf16, experts packed


def test_full_state_matches_the_real_trainer():
    config = train_config("full", lora_rank=RANK, remat="none")
    planned = abstract_trainer(small_config("bfloat16"), make_mesh(MESH), experts="bf16", kernels=DEVICE_KERNELS,
                               config=config).bytes()
    real = _real_trainer(config, packed=False)
    masters = real.state()["params"]
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(masters))
    assert planned["trained"] == _device_bytes(masters)
    assert planned["optimizer"] == _device_bytes(real.state()["opt_state"])
    assert planned["optimizer_total"] == 2 * planned["trained_total"] + COUNT_BYTES
    assert planned["frozen"] == _device_bytes(real._frozen)


def test_lora_needs_less_per_device_than_full(lora_plan):
    full = abstract_trainer(small_config("bfloat16"), make_mesh(MESH), experts="bf16", kernels=DEVICE_KERNELS,
                            config=train_config("full", lora_rank=RANK, remat="none")).bytes()
    held = lambda s: s["frozen"] + s["trained"] + s["optimizer"] + s["other"]  # noqa: E731
    assert held(lora_plan.state) < held(full) / 2
    (train,) = lora_plan.programs
    # The compiled step's arguments are exactly what the trainer holds, less the vision tower and projector
    # (not read by the text step, so jit drops them), plus the batch: 4 arrays of 4-byte elements, rows
    # split over fsdp=2.
    state = lora_plan.state
    assert state["unread"] > 0
    assert train.name == "train" and train.temp > 0
    assert train.argument == held(state) - state["unread"] + 4 * 4 * 2 * 32 // 2
    assert lora_plan.peak == train.peak + state["unread"]
    assert lora_plan.fits and lora_plan.train == "lora" and lora_plan.lora_rank == RANK


def test_full_with_packed_experts_is_refused():
    with pytest.raises(ValueError, match="--experts bf16"):
        abstract_trainer(small_config("bfloat16"), make_mesh(MESH), experts="mxfp4", kernels=DEVICE_KERNELS,
                         config=train_config("full", lora_rank=RANK, remat="none"))

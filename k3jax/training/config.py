"""What a fine-tuning run trains and how: one frozen, validated `TrainConfig`, and the `Batch` it eats."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "linear", "constant")

# Every projection a LoRA adapter may wrap (the model calls them as modules; the AttnRes queries,
# lm_head and embeddings are read as raw weights and stay full-trainable or frozen instead).
LORA_TARGETABLE = (
    "q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj",  # KDA (g_proj also MLA)
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # MLA
    "routed_expert_down_proj", "routed_expert_up_proj",  # latent MoE projections
    "gate_proj", "up_proj", "down_proj",  # shared experts and the dense FFN
    "experts",  # the routed experts: per-expert adapters on gate, up and down (not in the default targets)
)
# The `jax.checkpoint_policies` that take no arguments (the others need names chosen per model).
REMAT_POLICIES = (
    "nothing_saveable", "everything_saveable", "dots_saveable", "checkpoint_dots",
    "dots_with_no_batch_dims_saveable", "checkpoint_dots_with_no_batch_dims",
)
DEFAULT_LORA_TARGETS = ("*self_attn.*", "*routed_expert_*_proj", "*shared_experts.*", "*.mlp.*")
EXPERT_LORA_TARGET = "*.experts"  # adds the routed experts' adapters to the targets


class Batch(NamedTuple):
    """One optimizer step's rows. `targets[b, t]` is the token after `input_ids[b, t]`, counted where
    `loss_mask` is nonzero; `segment_ids` numbers the documents packed in a row (1, 2, 3, ...; 0 =
    padding), which are kept apart (KDA state and conv window reset, MLA blocked across them)."""

    input_ids: jax.Array  # int32 [B, T]
    targets: jax.Array  # int32 [B, T]
    loss_mask: jax.Array  # float32 [B, T]
    segment_ids: jax.Array  # int32 [B, T]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    optimizer: str = "adamw"
    learning_rate: float = 1e-5
    warmup_steps: int = 0
    total_steps: int = 1000
    schedule: str = "cosine"
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    grad_clip_norm: float = 1.0  # 0: no clipping
    grad_accum_steps: int = 1  # micro-batches per step: the batch's rows split evenly
    z_loss: float = 0.0  # coefficient of mean(logsumexp^2) over counted tokens
    remat: str = "none"  # a `jax.checkpoint_policies` name, applied to every decoder layer, or "none"
    lora_rank: int = 0  # 0: full fine-tune
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS  # fnmatch patterns over module paths
    freeze: tuple[str, ...] = ()  # fnmatch patterns over parameter paths (e.g. "embed_tokens.*")
    quantile_balancing: bool = False  # update the router bias by Quantile Balancing each step
    vocab_chunk: int = 16384  # lm_head columns per step of the chunked loss

    def __post_init__(self) -> None:
        def fail(field: str, expected: str) -> None:
            raise ValueError(f"TrainConfig.{field}: expected {expected}, got {getattr(self, field)!r}")

        def number(field: str, *, low: float, high: float = math.inf, low_open: bool = False) -> None:
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                fail(field, "a finite number")
            if v < low or (low_open and v == low) or v > high:
                fail(field, f"a number in {'(' if low_open else '['}{low}, {high}]")

        def integer(field: str, low: int) -> None:
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                fail(field, f"an integer >= {low}")

        if self.optimizer not in OPTIMIZERS:
            fail("optimizer", f"one of {OPTIMIZERS}")
        if self.schedule not in SCHEDULES:
            fail("schedule", f"one of {SCHEDULES}")
        number("learning_rate", low=0.0, low_open=True)
        integer("total_steps", 1)
        integer("warmup_steps", 0)
        if self.warmup_steps > self.total_steps:
            fail("warmup_steps", f"at most total_steps={self.total_steps}")
        number("weight_decay", low=0.0)
        number("b1", low=0.0, high=1.0)
        number("b2", low=0.0, high=1.0)
        number("grad_clip_norm", low=0.0)
        integer("grad_accum_steps", 1)
        number("z_loss", low=0.0)
        if self.remat not in ("none", *REMAT_POLICIES):
            fail("remat", f"'none' or one of the jax.checkpoint_policies {REMAT_POLICIES}")
        integer("lora_rank", 0)
        number("lora_alpha", low=0.0, low_open=True)
        number("lora_dropout", low=0.0, high=1.0)
        if self.lora_dropout == 1.0:
            fail("lora_dropout", "a rate below 1")
        for field in ("lora_targets", "freeze"):
            v = getattr(self, field)
            if not isinstance(v, tuple) or not all(isinstance(p, str) and p for p in v):
                fail(field, "a tuple of non-empty name patterns")
        if self.lora_rank and not self.lora_targets:
            fail("lora_targets", "at least one pattern when lora_rank > 0")
        if not isinstance(self.quantile_balancing, bool):
            fail("quantile_balancing", "a bool")
        integer("vocab_chunk", 1)

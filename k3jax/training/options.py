"""The options of a fine-tuning run, checked before anything slow happens, and recorded for `--resume`.

Each field is also a `k3jax finetune` flag (`lora_rank` <-> `--lora-rank`), so an error names the flag
the user typed. A resumed run must keep the options that decide what the next step computes (data
order, shapes, optimizer and its schedule, adapters); it may change how often it saves or evaluates.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from k3jax.training.config import OPTIMIZERS, REMAT_POLICIES, SCHEDULES

DTYPES = ("float32", "bfloat16")
# May differ between a run and its resumption: they change when things happen, not what a step computes.
RESUMABLE_CHANGES = ("save_every", "eval_every", "keep", "progress")


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class FinetuneOptions:
    """Everything a run needs besides the model, the data and the output directory."""

    steps: int = 100  # optimizer steps in all (a resumed run continues up to this many)
    learning_rate: float = 1e-4
    warmup_steps: int = 0
    schedule: str = "cosine"
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    grad_accum_steps: int = 1
    batch_size: int = 8  # rows per optimizer step
    seq_len: int = 512  # tokens per row
    seed: int = 0  # data order and the trainer's RNG
    optimizer: str = "adamw"
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float | None = None  # None: the trainer's default
    lora_experts: bool = False  # LoRA also on the routed experts (per-expert adapters; exported dense bf16)
    remat: str = "none"  # a jax.checkpoint_policies name applied to every decoder layer, or "none"
    dtype: str = "float32"  # parameters and activations of the loaded model
    mesh: str | None = None  # e.g. "data=2,tensor=4"; None: one device
    save_every: int = 50  # checkpoint every this many steps (and at the end, and on Ctrl-C)
    keep: int = 2  # latest checkpoints kept (plus the best by loss)
    eval_data: str | None = None  # JSONL of held-out records: eval loss ranks the checkpoints
    eval_every: int = 50
    progress: bool = True  # a tqdm bar on stderr

    def check(self) -> None:
        """ValueError naming the flag of the first option out of range."""
        ints = {"steps": 1, "warmup_steps": 0, "grad_accum_steps": 1, "batch_size": 1, "seq_len": 2,
                "seed": 0, "lora_rank": 0, "save_every": 1, "keep": 1, "eval_every": 1}
        for field, low in ints.items():
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{flag(field)} {value!r}: expected an integer >= {low}")
        if self.seed >= 2**63:
            raise ValueError(f"--seed {self.seed}: expected an integer in [0, 2**63 - 1]")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps}: expected fewer than --steps {self.steps}")
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"--batch-size {self.batch_size}: expected a multiple of --grad-accum-steps "
                             f"{self.grad_accum_steps} (each micro-batch has batch_size / grad_accum_steps rows)")
        for field, low_open in (("learning_rate", True), ("weight_decay", False), ("grad_clip_norm", False)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                    value <= 0 if low_open else value < 0):
                raise ValueError(f"{flag(field)} {value!r}: expected a finite number {'>' if low_open else '>='} 0")
        if self.lora_alpha is not None and not (isinstance(self.lora_alpha, (int, float)) and self.lora_alpha > 0
                                                and math.isfinite(self.lora_alpha)):
            raise ValueError(f"--lora-alpha {self.lora_alpha!r}: expected a finite number > 0")
        if not isinstance(self.lora_experts, bool):
            raise ValueError(f"--lora-experts {self.lora_experts!r}: expected a bool")
        if self.lora_experts and not self.lora_rank:
            raise ValueError("--lora-experts: needs --lora-rank > 0 "
                             "(full fine-tuning already trains the routed experts)")
        for field, allowed in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("dtype", DTYPES),
                               ("remat", ("none", *REMAT_POLICIES))):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{flag(field)} {getattr(self, field)!r}: expected one of {', '.join(allowed)}")
        if self.eval_data is not None and not Path(self.eval_data).is_file():
            raise ValueError(f"--eval-data {self.eval_data}: no such file")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check_resumable(self, recorded: dict[str, Any], where: Path) -> None:
        """ValueError naming the first option that differs from the run recorded in `where`."""
        for field, value in self.to_json().items():
            if field not in RESUMABLE_CHANGES and field in recorded and recorded[field] != value:
                raise ValueError(f"{flag(field)} {value!r}: the run in {where} used {recorded[field]!r}; a resumed "
                                 f"run keeps it (only {', '.join(map(flag, RESUMABLE_CHANGES))} may change)")


def read_recorded(path: Path) -> dict[str, Any]:
    """The options a run recorded (its run.json)."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read the recorded run options ({err})") from None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("options"), dict):
        raise ValueError(f"{path}: expected an object with 'options'")
    return recorded

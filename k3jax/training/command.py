"""`k3jax finetune`: its flags (one per `FinetuneOptions` field) and its run.

Every flag is checked before the model loads: argparse types for the shapes of values, then
`FinetuneOptions.check`, the output directory, the model's config, the tokenizer and every data record.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.config import ConfigError
from k3jax.training.config import REMAT_POLICIES
from k3jax.training.options import DTYPES, OPTIMIZERS, SCHEDULES, FinetuneOptions
from k3jax.training.run import finetune

_DEFAULTS = FinetuneOptions()


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def add_finetune_command(commands: argparse._SubParsersAction) -> None:
    ft = commands.add_parser("finetune", help="fine-tune on JSONL data (chat, text or token records); "
                                              "checkpoints, --resume, export to OUT/final")
    ft.add_argument("--model", type=Path, required=True, help="HF release or `k3jax convert` directory")
    ft.add_argument("--data", type=Path, required=True,
                    help='JSONL: {"messages": [...]}, {"text": "..."} or {"input_ids": [...], "loss_mask": [...]}')
    ft.add_argument("--out", type=Path, required=True, help="run directory (must not exist unless --resume)")
    ft.add_argument("--resume", action="store_true", help="continue the run in OUT from its latest checkpoint")
    d = _DEFAULTS
    ft.add_argument("--steps", type=_integer, default=d.steps, help=f"optimizer steps in all (default {d.steps})")
    ft.add_argument("--lr", "--learning-rate", dest="learning_rate", type=_number, default=d.learning_rate,
                    help=f"peak learning rate (default {d.learning_rate})")
    ft.add_argument("--warmup-steps", type=_integer, default=d.warmup_steps)
    ft.add_argument("--schedule", choices=SCHEDULES, default=d.schedule, help="learning-rate decay after warmup")
    ft.add_argument("--weight-decay", type=_number, default=d.weight_decay)
    ft.add_argument("--grad-clip-norm", type=_number, default=d.grad_clip_norm, help="0: no clipping")
    ft.add_argument("--grad-accum-steps", type=_integer, default=d.grad_accum_steps,
                    help="micro-batches per optimizer step (divides --batch-size)")
    ft.add_argument("--batch-size", type=_integer, default=d.batch_size, help="rows per optimizer step")
    ft.add_argument("--seq-len", type=_integer, default=d.seq_len, help="tokens per row (documents packed)")
    ft.add_argument("--seed", type=_integer, default=d.seed, help="data order and the trainer's RNG")
    ft.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer)
    ft.add_argument("--lora-rank", type=_integer, default=d.lora_rank, help="0: full fine-tuning")
    ft.add_argument("--lora-alpha", type=_number, default=None, help="LoRA scale: adapters add alpha/rank * B(A(x)) (default: the trainer's)")
    ft.add_argument("--lora-experts", action="store_true",
                    help="with --lora-rank: per-expert adapters on the routed experts too (exported dense bf16)")
    ft.add_argument("--remat", choices=("none", *REMAT_POLICIES), default=d.remat,
                    help="recompute each decoder layer's activations in the backward pass by this policy")
    ft.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="model parameters and activations")
    ft.add_argument("--mesh", metavar="SPEC", default=None, help="e.g. data=2,tensor=4 (default: one device)")
    ft.add_argument("--save-every", type=_integer, default=d.save_every, help="checkpoint every N steps")
    ft.add_argument("--keep", type=_integer, default=d.keep, help="latest checkpoints kept (and the best)")
    ft.add_argument("--eval-data", type=Path, default=None, help="held-out JSONL; its loss picks the best checkpoint")
    ft.add_argument("--eval-every", type=_integer, default=d.eval_every)
    ft.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run_finetune_command(args: argparse.Namespace) -> int:
    """A bad flag, data record or output directory: one line, exit status 2; a bad model: exit status 1.
    Ctrl-C: a checkpoint of the last finished step, exit status 130."""
    fields = {f: getattr(args, f) for f in FinetuneOptions.__dataclass_fields__}
    fields["eval_data"] = None if args.eval_data is None else str(args.eval_data)
    try:
        result = finetune(args.model, args.data, args.out, resume=args.resume, **fields)
    except (CheckpointError, ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if result.interrupted:
        print(f"\ninterrupted after step {result.steps}: checkpoint saved in {result.out / 'checkpoints'}; "
              f"continue with --resume", file=sys.stderr)
        return 130
    first, last = result.metrics[0]["loss"], result.metrics[-1]["loss"]
    print(f"fine-tuned {result.steps} steps on {jax.device_count()} {jax.devices()[0].platform} device(s): loss "
          f"{first:.4f} (step 1) -> {last:.4f} (step {result.steps}); model in {result.final}, "
          f"curve in {result.out / 'loss.png'}, metrics in {result.out / 'metrics.jsonl'}")
    if args.lora_experts:
        print("routed experts: adapters folded in, exported dense bf16 (MXFP4 cannot hold W + (alpha/r) B A)")
    return 0

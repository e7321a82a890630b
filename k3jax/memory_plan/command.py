"""`k3jax plan`: its arguments and its run (a memory plan on fake CPU devices, printed, optionally JSON)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from k3jax.config import ConfigError, K3Config
from k3jax.memory_plan.devices import ensure_cpu_devices
from k3jax.memory_plan.plan import CPU_KERNELS, DEVICE_KERNELS, plan_memory
from k3jax.memory_plan.report import format_memory_plan
from k3jax.memory_plan.train import TRAIN_MODES, check_train_experts
from k3jax.training import REMAT_POLICIES
from k3jax.units import parse_bytes
from sharding import mesh_device_count

# The planner compiles for fake CPU devices, one per mesh device: beyond this many, starting them takes
# long and uses much memory, and no K3 deployment needs more (896 experts fit expert=896).
MAX_PLAN_DEVICES = 1024
# `--lora-rank` when not given: the rank the fine-tuning docs use (TrainConfig's own default, 0, means
# no adapters, i.e. a full fine-tune).
DEFAULT_PLAN_LORA_RANK = 16


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse `type`: an integer >= low, else an error saying what was expected."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


def _byte_size(text: str) -> int:
    """--hbm: a positive size such as 141GB."""
    try:
        value = parse_bytes(text)
    except ValueError:
        value = None
    if not value:
        raise argparse.ArgumentTypeError(f"expected a positive byte size such as 141GB or 95GiB, got {text!r}")
    return value


def _plan_mesh(text: str) -> str:
    """--mesh: explicit axis sizes spanning at most MAX_PLAN_DEVICES devices."""
    try:
        devices = mesh_device_count(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if devices > MAX_PLAN_DEVICES:
        raise argparse.ArgumentTypeError(f"{text!r} spans {devices} devices; the planner fakes at most "
                                         f"{MAX_PLAN_DEVICES} CPU devices")
    return text


def add_plan_command(commands: argparse._SubParsersAction) -> None:
    pl = commands.add_parser("plan", help="per-device memory of prefill/decode (or a fine-tuning step) on a mesh: FITS?")
    pl.add_argument("--config", type=Path, required=True, help="config.json (HF release or configs/kimi_k3.json)")
    pl.add_argument("--mesh", metavar="SPEC", type=_plan_mesh, required=True,
                    help=f"explicit sizes, e.g. expert=64,tensor=8 (at most {MAX_PLAN_DEVICES} devices)")
    pl.add_argument("--hbm", type=_byte_size, default="141GB", help="memory per device: 141GB (H200), 95GB (TPU v5p)")
    pl.add_argument("--batch", type=int_at_least(1), default=1)
    pl.add_argument("--max-len", type=int_at_least(1), default=131072, help="cache capacity in tokens (prefill/decode plans)")
    pl.add_argument("--seq-len", type=int_at_least(1), default=None,
                    help="prefill chunk (tokens per prefill call), or tokens per row with --train (default: the chunk "
                         "k3jax.prefill uses on a device of --hbm, see k3jax.prefill_chunk)")
    pl.add_argument("--train", choices=TRAIN_MODES, default=None,
                    help="plan the fine-tuning step of k3jax.training.Trainer instead of prefill/decode: 'full' "
                         "(fp32 masters + AdamW of every parameter; needs --experts bf16) or 'lora' (fp32 adapters + "
                         "AdamW, the base frozen as loaded); --batch rows of --seq-len tokens")
    pl.add_argument("--lora-rank", type=int_at_least(1), default=None,
                    help=f"adapter rank with --train lora (default {DEFAULT_PLAN_LORA_RANK})")
    pl.add_argument("--remat", choices=("none", *REMAT_POLICIES), default=None, metavar="POLICY",
                    help="with --train: none or a jax.checkpoint_policies name (nothing_saveable, dots_saveable, ...) "
                         "applied to every decoder layer, as k3jax finetune --remat (default none)")
    pl.add_argument("--experts", choices=("mxfp4", "bf16"), default=None,
                    help="routed expert storage (default mxfp4; bf16 with --train full, which trains them)")
    pl.add_argument("--layers", type=int_at_least(2), default=None,
                    help="compile at this reduced depth (>= 2) and one scanned group more, extrapolate to full "
                         "depth (full depth when it is not below the model's)")
    pl.add_argument("--cpu-ragged-dot", action="store_true",
                    help="keep the CPU lowering of the MoE grouped GEMMs (a dense per-expert expansion no GPU/TPU "
                         "has) instead of the device-like stand-in")
    pl.add_argument("--json", type=Path, default=None, help="also write the plan as JSON here")


def run_plan_command(args: argparse.Namespace) -> int:
    """Errors in the arguments exit with status 2 and one line, before any compiling. The fake device
    count is set before anything starts JAX's backend."""
    try:
        cfg = K3Config.from_hf(args.config)
    except (ValueError, ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json is not None and not args.json.parent.is_dir():
        print(f"error: --json {args.json}: the folder {args.json.parent} does not exist", file=sys.stderr)
        return 2
    if args.lora_rank is not None and args.train != "lora":
        print("error: --lora-rank is the rank of LoRA adapters: use it with --train lora", file=sys.stderr)
        return 2
    if args.remat is not None and args.train is None:
        print("error: --remat is the train step's rematerialisation: use it with --train full or --train lora",
              file=sys.stderr)
        return 2
    try:
        check_train_experts(args.train, args.experts)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    hbm, devices = args.hbm, mesh_device_count(args.mesh)
    layers = args.layers if args.layers is not None and args.layers < cfg.num_hidden_layers else None
    experts = args.experts or ("bf16" if args.train == "full" else "mxfp4")
    train = {} if args.train is None else dict(train=args.train, remat=args.remat or "none",
                                               lora_rank=args.lora_rank or DEFAULT_PLAN_LORA_RANK)
    try:
        ensure_cpu_devices(devices)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        result = plan_memory(cfg, args.mesh, hbm, batch=args.batch, max_len=args.max_len, seq_len=args.seq_len,
                             layers=layers, experts=experts, **train,
                             kernels=CPU_KERNELS if args.cpu_ragged_dot else DEVICE_KERNELS)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_memory_plan(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_dict(), indent=1))
    return 0

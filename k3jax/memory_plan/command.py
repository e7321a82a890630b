"""`k3jax plan`: its arguments and its run (a memory plan on fake CPU devices, printed, optionally JSON)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k3jax.config import ConfigError, K3Config
from k3jax.memory_plan.devices import ensure_cpu_devices
from k3jax.memory_plan.plan import CPU_KERNELS, DEVICE_KERNELS, plan_memory
from k3jax.memory_plan.report import format_memory_plan
from k3jax.units import parse_bytes
from sharding import mesh_device_count


def add_plan_command(commands: argparse._SubParsersAction) -> None:
    pl = commands.add_parser("plan", help="per-device memory of prefill/decode (and a train step) on a mesh: FITS?")
    pl.add_argument("--config", type=Path, required=True, help="config.json (HF release or configs/kimi_k3.json)")
    pl.add_argument("--mesh", metavar="SPEC", required=True, help="explicit sizes, e.g. expert=64,tensor=8")
    pl.add_argument("--hbm", default="141GB", help="memory per device: 141GB (H200), 95GB (TPU v5p)")
    pl.add_argument("--batch", type=int, default=1)
    pl.add_argument("--max-len", type=int, default=131072, help="cache capacity in tokens")
    pl.add_argument("--seq-len", type=int, default=4096,
                    help="prefill chunk (tokens per prefill call) and train sequence length")
    pl.add_argument("--train", action="store_true", help="also a train step (cross-entropy + adamw; bf16 experts)")
    pl.add_argument("--experts", choices=("mxfp4", "bf16"), default=None,
                    help="routed expert storage (default mxfp4, bf16 with --train)")
    pl.add_argument("--layers", type=int, default=None,
                    help="compile at this reduced depth and one scanned group more, extrapolate to full depth")
    pl.add_argument("--cpu-ragged-dot", action="store_true",
                    help="keep the CPU lowering of the MoE grouped GEMMs (a dense per-expert expansion no GPU/TPU "
                         "has) instead of the device-like stand-in")
    pl.add_argument("--json", type=Path, default=None, help="also write the plan as JSON here")


def run_plan_command(args: argparse.Namespace) -> int:
    """Errors in the arguments exit with status 2 and one line. The fake device count is set before
    anything starts JAX's backend."""
    try:
        hbm = parse_bytes(args.hbm)
        devices = mesh_device_count(args.mesh)
        cfg = K3Config.from_hf(args.config)
    except (ValueError, ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    layers = args.layers if args.layers is not None and 1 < args.layers < cfg.num_hidden_layers else None
    experts = args.experts or ("bf16" if args.train else "mxfp4")
    try:
        ensure_cpu_devices(devices)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        result = plan_memory(cfg, args.mesh, hbm, batch=args.batch, max_len=args.max_len, seq_len=args.seq_len,
                             train=args.train, layers=layers, experts=experts,
                             kernels=CPU_KERNELS if args.cpu_ragged_dot else DEVICE_KERNELS)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_memory_plan(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_dict(), indent=1))
    return 0

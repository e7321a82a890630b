"""The `k3jax` command line: `demo`, `generate`, `convert` and `plan`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from k3jax import distributed
from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.config import ConfigError
from k3jax.convert import convert, plan_conversion
from k3jax.convert.report import device_bytes, format_device_bytes, format_release_plan
from k3jax.demo import run_demo
from k3jax.generate import generate
from k3jax.memory_plan.command import add_plan_command, run_plan_command
from k3jax.pretrained import from_pretrained
from k3jax.tokenizer import load_tokenizer
from k3jax.units import format_bytes


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids expects comma-separated integers, got {text!r}") from None


def _use_fake_cpu_devices(count: int = 8) -> None:
    """Without accelerators, give the CPU `count` devices so meshes work (before JAX starts its backend),
    and one OpenBLAS thread, since all of them call it at once."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    jax.config.update("jax_num_cpu_devices", count)


def _run_generation(args: argparse.Namespace) -> int:
    """Stream the continuation of a prompt (text through the checkpoint's tokenizer, or --ids)."""
    try:
        tokenizer = load_tokenizer(args.model)
        model = from_pretrained(args.model, dtype=args.dtype, mesh=args.mesh)
    except (CheckpointError, ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    ids = args.ids if args.ids is not None else tokenizer.encode(args.prompt)
    if not ids:
        print("error: the prompt has no tokens", file=sys.stderr)
        return 2
    bad = [i for i in ids if not 0 <= i < model.config.vocab_size]
    if bad:
        print(f"error: token ids {bad} are outside the vocabulary [0, {model.config.vocab_size})", file=sys.stderr)
        return 2

    new_tokens: list[int] = []
    shown = ""
    arrivals: list[float] = []

    def on_token(tokens: np.ndarray) -> None:
        nonlocal shown
        arrivals.append(time.perf_counter())
        new_tokens.append(int(tokens[0]))
        text = tokenizer.decode(new_tokens)
        print(text[len(shown):], end="", flush=True)
        shown = text

    print(args.prompt if args.ids is None else f"{ids} ->", end=" " if args.ids is not None else "", flush=True)
    start = time.perf_counter()
    stop = [model.config.eos_token_id] if model.config.eos_token_id is not None else []
    generate(model, np.asarray([ids], np.int32), max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                   stop_tokens=stop, on_token=on_token)
    print()
    if args.ids is not None:
        print(f"ids: {new_tokens}")
    # Tokens/s from the second new token on: the first waits for the prefill, the second for the
    # decode step's compilation.
    steady = (len(arrivals) - 2) / (arrivals[-1] - arrivals[1]) if len(arrivals) > 2 else float("nan")
    print(f"[{len(new_tokens)} tokens: first after {arrivals[0] - start:.2f} s (prefill and compile), "
          f"then {steady:.1f} tokens/s; {jax.device_count()} {jax.devices()[0].platform} device(s), "
          f"mesh {args.mesh or 'none'}]", file=sys.stderr)
    return 0


def _join_conversion_job() -> None:
    """Before JAX starts: join a multi-process job if the environment describes one, and give a CPU-only
    host 8 devices as `generate --mesh` does (JAX_NUM_CPU_DEVICES, when set, decides)."""
    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        _use_fake_cpu_devices()
    distributed.initialize()


def _run_convert(args: argparse.Namespace) -> int:
    """Plan (or convert); a bad release or output directory is a one-line error and exit status 1."""
    if args.out_dir is None and not args.plan_only:
        print("error: OUT_DIR is required unless --plan-only is given", file=sys.stderr)
        return 2
    if args.mesh is not None and not args.plan_only:
        _join_conversion_job()
    try:
        if args.plan_only:
            planned = plan_conversion(args.hf_dir, dtype=args.dtype, experts=args.experts)
            report = None
            if args.mesh is not None:
                try:
                    report = device_bytes(planned.abstract, args.mesh)
                except ValueError as err:
                    print(f"error: --mesh {args.mesh}: {err}", file=sys.stderr)
                    return 2
            print(format_release_plan(planned.plan))
            if report is not None:
                print(format_device_bytes(report))
            return 0
        result = convert(args.hf_dir, args.out_dir, dtype=args.dtype, experts=args.experts, resume=args.resume,
                         verify=args.verify, progress=not args.quiet, mesh=args.mesh, sync=not args.no_sync)
    except (CheckpointError, ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"converted {args.hf_dir} -> {result.out_dir}: {result.written} item(s) written, "
              f"{result.skipped} already done, {format_bytes(result.nbytes)} in {result.seconds:.1f} s"
              + (", verified" if args.verify else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3jax", description="Kimi K3 in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="write a tiny K3 in the release format, convert it, restore it sharded, generate")
    demo.add_argument("--prompt", default="Kimi K3 in JAX: ")
    demo.add_argument("--max-new-tokens", type=int, default=24)
    demo.add_argument("--mesh", metavar="SPEC", default=None, help="default: data=2,expert=2,tensor=2 on 8 devices")

    gen = commands.add_parser("generate", help="stream the continuation of a prompt")
    gen.add_argument("--model", type=Path, required=True, help="HF release or `k3jax convert` directory")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (the checkpoint's tokenizer; bytes if it has none)")
    source.add_argument("--ids", type=_parse_ids, help="prompt token ids, e.g. 1,2,3")
    gen.add_argument("--mesh", metavar="SPEC", default=None, help="e.g. expert=8,tensor=8 (default: one device)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")

    conv = commands.add_parser("convert", help="convert a Hugging Face release to per-layer Orbax checkpoints")
    conv.add_argument("hf_dir", type=Path, metavar="HF_DIR", help="Hugging Face release directory")
    conv.add_argument("out_dir", type=Path, metavar="OUT_DIR", nargs="?", help="output directory")
    conv.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                      help="storage dtype of the bf16 tensors (fp32 tensors stay fp32)")
    conv.add_argument("--experts", choices=("mxfp4", "bf16"), default=None,
                      help="routed experts: mxfp4 keeps the release's packed codes + scales (4.25 bits/weight, "
                           "decoded on the fly by the model; the default for MXFP4 releases), bf16 decodes them "
                           "to bfloat16 whatever --dtype (exact)")
    conv.add_argument("--mesh", metavar="SPEC", default=None,
                      help="convert on this mesh, each process reading and writing only its devices' slices "
                           "(same output); with --plan-only: report per-device parameter bytes on it, "
                           "e.g. expert=64,tensor=8 (needs no devices)")
    conv.add_argument("--resume", action="store_true", help="continue an interrupted conversion in OUT_DIR")
    conv.add_argument("--verify", action="store_true",
                      help="re-read every leaf and compare it with the source (and logits, when small)")
    conv.add_argument("--plan-only", action="store_true", help="print the plan (leaves, bytes, sources) and stop")
    conv.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    conv.add_argument("--no-sync", action="store_true",
                      help="commit items without waiting for the disk (faster where the disk is the limit; a "
                           "killed run still resumes exactly, a machine crash may need --resume --verify)")

    add_plan_command(commands)

    args = parser.parse_args(argv)
    if args.command == "plan":
        return run_plan_command(args)
    if args.command == "convert":
        return _run_convert(args)
    if args.command == "demo":
        _use_fake_cpu_devices()
        return run_demo(prompt=args.prompt, max_new_tokens=args.max_new_tokens, mesh=args.mesh)
    if args.mesh is not None:
        _use_fake_cpu_devices()
    return _run_generation(args)

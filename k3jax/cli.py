"""The `k3jax` command line: `demo`, `generate`, `convert` and `plan`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids expects comma-separated integers, got {text!r}") from None


def _use_fake_cpu_devices(count: int = 8) -> None:
    """Without accelerators, give the CPU `count` devices so meshes work (before JAX starts its backend),
    and one OpenBLAS thread, since all of them call it at once."""
    import os

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import jax

    jax.config.update("jax_num_cpu_devices", count)


def _run_generation(args: argparse.Namespace) -> int:
    """Stream the continuation of a prompt (text through the checkpoint's tokenizer, or --ids)."""
    import jax

    import k3jax
    from k3jax.checkpoint import CheckpointError
    from k3jax.config import ConfigError
    from k3jax.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(args.model)
        model = k3jax.from_pretrained(args.model, dtype=args.dtype, mesh=args.mesh)
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
    k3jax.generate(model, np.asarray([ids], np.int32), max_new_tokens=args.max_new_tokens,
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
    import os

    from k3jax import distributed

    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        _use_fake_cpu_devices()
    distributed.initialize()


def _run_convert(args: argparse.Namespace) -> int:
    """Plan (or convert); a bad release or output directory is a one-line error and exit status 1."""
    from k3jax.checkpoint import CheckpointError
    from k3jax.config import ConfigError
    from k3jax.convert import convert, plan_conversion
    from k3jax.convert.report import device_bytes, format_device_bytes, format_plan, human_bytes

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
            print(format_plan(planned.plan))
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
              f"{result.skipped} already done, {human_bytes(result.nbytes)} in {result.seconds:.1f} s"
              + (", verified" if args.verify else ""))
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    """Memory plan on fake CPU devices. The device count must be set before JAX starts its backend, so
    this runs before anything touches jax.devices() (see k3jax/plan.py `ensure_cpu_devices`)."""
    import json

    from k3jax import plan
    from k3jax.config import ConfigError, K3Config

    try:
        hbm = plan.parse_bytes(args.hbm)
        devices = plan.mesh_devices(args.mesh)
        cfg = K3Config.from_hf(args.config)
    except (ValueError, ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.layers is not None and not 1 < args.layers < cfg.num_hidden_layers:
        args.layers = None  # nothing to extrapolate: compile the configured depth
    experts = args.experts or ("bf16" if args.train else "mxfp4")
    try:
        plan.ensure_cpu_devices(devices)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        result = plan.plan_memory(cfg, args.mesh, hbm, batch=args.batch, max_len=args.max_len, seq_len=args.seq_len,
                                  train=args.train, layers=args.layers, experts=experts,
                                  device_gemm=not args.cpu_ragged_dot)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(plan.format_plan(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_dict(), indent=1))
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

    args = parser.parse_args(argv)
    if args.command == "plan":
        return _run_plan(args)
    if args.command == "convert":
        return _run_convert(args)
    if args.command == "demo":
        _use_fake_cpu_devices()
        from k3jax.demo import run_demo

        return run_demo(prompt=args.prompt, max_new_tokens=args.max_new_tokens, mesh=args.mesh)
    if args.mesh is not None:
        _use_fake_cpu_devices()
    return _run_generation(args)

"""The `k3jax` command line: `demo`, `generate`, `chat`, `convert`, `plan`, `serve` and `finetune`."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import jax
import numpy as np

from k3jax import __version__, distributed
from k3jax.chat.repl import add_chat_command, run_chat_command
from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.config import ConfigError, K3Config
from k3jax.convert import convert, plan_conversion
from k3jax.convert.report import device_bytes, format_device_bytes, format_release_plan
from k3jax.demo import run_demo
from k3jax.generate import generate
from k3jax.load.paths import checkpoint_path, is_remote, load_config
from k3jax.memory_plan.command import add_plan_command, int_at_least, run_plan_command
from k3jax.pretrained import add_layers_argument, from_pretrained
from k3jax.serving.command import add_serve_command, run_serve_command
from k3jax.tokenizer import ByteFallbackWarning, Tokenizer, check_text, load_tokenizer
from k3jax.training.command import add_finetune_command, run_finetune_command
from k3jax.units import format_bytes
from sharding import parse_mesh_spec

MAX_SEED = 2**63 - 1  # JAX's PRNG key takes a signed 64-bit seed


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the flag and what it expects; see --help), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _number(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse `type`: a finite float in [low, high] (or (low, high])."""
    expected = f"a number {'>' if low_open else '>='} {low}" + (f" and <= {high}" if high != math.inf else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not (math.isfinite(value) and (low < value if low_open else low <= value) and value <= high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


def _seed(text: str) -> int:
    value = int_at_least(0)(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63 - 1], got {text}")
    return value


def _text(text: str) -> str:
    """An argparse `type`: non-empty, valid UTF-8 text (argv bytes that were not UTF-8 are an error)."""
    try:
        check_text(text, "the text")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not text:
        raise argparse.ArgumentTypeError("expected non-empty text")
    return text


_DECIMAL = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")  # "1.5", "-2", "1e3": meant as ids


def _local_dir(text: str) -> Path:
    """An argparse `type`: a local directory (`convert` reads mapped shards and writes with fsync and renames)."""
    if is_remote(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a URL; convert reads and writes local directories "
                                         "(copy the output to remote storage afterwards)")
    return Path(text)


def _stop_ids(values: Sequence[str], tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """--stop values -> token ids: comma-separated ids, a special token's name, or text of exactly one token."""
    ids: list[int] = []
    for value in values:
        try:
            parts = [int(t) for t in value.split(",") if t.strip()]
        except ValueError:
            if all(_DECIMAL.fullmatch(t) for t in value.split(",") if t.strip()) and value.strip(", "):
                raise ValueError(f"--stop {value!r}: expected integer token ids in [0, {vocab_size}) "
                                 "(or text)") from None
            parts = [tokenizer.special_tokens[value]] if value in tokenizer.special_tokens else tokenizer.encode(value)
            if len(parts) != 1:
                raise ValueError(f"--stop {value!r}: the text is {len(parts)} tokens {parts}; a stop is one token "
                                 "(give its id)") from None
        bad = [i for i in parts if not 0 <= i < vocab_size]
        if bad or not parts:
            raise ValueError(f"--stop {value!r}: expected token ids in [0, {vocab_size}) or text, got {bad or value!r}")
        ids.extend(parts)
    return ids


def _use_fake_cpu_devices(count: int = 8) -> None:
    """Without accelerators, give the CPU `count` devices so meshes work (before JAX starts its backend),
    and one OpenBLAS thread, since all of them call it at once. JAX_NUM_CPU_DEVICES, when set, decides."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if "JAX_NUM_CPU_DEVICES" in os.environ:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backend has started (main called in a running program): its devices stand
        pass


def _prompt_ids(args: argparse.Namespace, tokenizer: Tokenizer, config: K3Config) -> list[int]:
    """The prompt as ids: --ids as given, or --prompt encoded as plain text (no control tokens); with the
    bos token first when --bos (the default for --prompt when the tokenizer or config has one)."""
    ids = args.ids if args.ids is not None else tokenizer.encode(args.prompt)
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else config.bos_token_id
    # Default: bos before a text prompt, --ids exactly as given.
    use_bos = args.ids is None and bos is not None if args.bos is None else args.bos
    if use_bos and bos is None:
        raise ValueError("--bos: neither the tokenizer nor config.json has a bos token")
    return [bos, *ids] if use_bos else ids


def _run_generation(args: argparse.Namespace) -> int:
    """Stream the continuation of a prompt (text through the checkpoint's tokenizer, or --ids). Everything
    the command line says is checked before the model loads; stop tokens are not printed."""
    try:
        args.model = checkpoint_path(args.model)  # a local directory made absolute, or a URL (gs://...) as given
        config = load_config(args.model)
        with warnings.catch_warnings(record=True) as caught:  # e.g. the byte-level fallback: one line each
            warnings.simplefilter("always")
            tokenizer = load_tokenizer(args.model)
    except (CheckpointError, ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    try:
        ids = _prompt_ids(args, tokenizer, config)
        stop = [config.eos_token_id] if config.eos_token_id is not None else []
        stop += _stop_ids(args.stop, tokenizer, config.vocab_size)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not ids:
        print("error: the prompt has no tokens", file=sys.stderr)
        return 2
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        print(f"error: token ids {bad} are outside the vocabulary [0, {config.vocab_size})", file=sys.stderr)
        return 2
    if args.top_k is not None and args.top_k > config.vocab_size:
        print(f"error: --top-k {args.top_k}: expected at most the vocabulary size {config.vocab_size}", file=sys.stderr)
        return 2
    try:
        model = from_pretrained(args.model, dtype=args.dtype, mesh=args.mesh, layers=args.layers)
    except (CheckpointError, ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    new_tokens: list[int] = []
    shown_tokens: list[int] = []
    shown = ""
    arrivals: list[float] = []

    def on_token(tokens: np.ndarray) -> None:
        nonlocal shown
        arrivals.append(time.perf_counter())
        new_tokens.append(int(tokens[0]))
        if new_tokens[-1] in stop:
            return
        shown_tokens.append(new_tokens[-1])
        text = tokenizer.decode(shown_tokens)
        print(text[len(shown):], end="", flush=True)
        shown = text

    print(args.prompt if args.ids is None else f"{ids} ->", end=" " if args.ids is not None else "", flush=True)
    start = time.perf_counter()
    try:
        generate(model, np.asarray([ids], np.int32), max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                 stop_tokens=stop, on_token=on_token)
    except ValueError as err:  # e.g. the model produced an id its tokenizer cannot decode
        print(f"\nerror: {err}", file=sys.stderr)
        return 1
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
    if not args.plan_only:
        _join_conversion_job()  # every conversion: several processes must never each write the whole output
        if args.mesh is None and jax.process_count() > 1:
            print(f"error: this is one of {jax.process_count()} processes; a conversion by several processes needs "
                  "--mesh SPEC (each writes its own devices' slices), or run it as one process", file=sys.stderr)
            return 2
        if not _mesh_fits(args.mesh):
            return 2
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
    """Run one command; a user error is one line on stderr and a non-zero exit status, no traceback."""
    parser = _Parser(prog="k3jax", description="Kimi K3 in JAX.")
    parser.add_argument("--version", action="version", version=f"k3jax {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="write a tiny K3 in the release format, convert it, restore it sharded, generate")
    demo.add_argument("--prompt", type=_text, default="Kimi K3 in JAX: ")
    demo.add_argument("--max-new-tokens", type=int_at_least(1), default=24)
    demo.add_argument("--mesh", metavar="SPEC", default=None, help="default: data=2,expert=2,tensor=2 on 8 devices")

    gen = commands.add_parser("generate", help="stream the continuation of a prompt")
    gen.add_argument("--model", required=True,
                     help="HF release or `k3jax convert` directory; a converted one may be a URL (gs://...)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", type=_text,
                        help="prompt text (the checkpoint's tokenizer, bytes if it has none; control-token "
                             "strings in it stay text)")
    source.add_argument("--ids", type=_parse_ids, help="prompt token ids, e.g. 1,2,3")
    gen.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                     help="put the bos token first (default: yes for --prompt when the tokenizer or config has "
                          "one, no for --ids)")
    gen.add_argument("--stop", action="append", default=[], metavar="TOKEN_IDS_OR_TEXT",
                     help="stop at these token ids (e.g. 163586,163587), or at this special token or one-token "
                          "text; repeatable; the config's eos always stops; stop tokens are not printed")
    gen.add_argument("--mesh", metavar="SPEC", default=None, help="e.g. expert=8,tensor=8 (default: one device)")
    gen.add_argument("--max-new-tokens", type=int_at_least(1), default=64)
    gen.add_argument("--temperature", type=_number(0, math.inf), default=0.0, help=">= 0; 0 is greedy")
    gen.add_argument("--top-k", type=int_at_least(1), default=None)
    gen.add_argument("--top-p", type=_number(0, 1, low_open=True), default=None, help="in (0, 1]")
    gen.add_argument("--seed", type=_seed, default=0, help="in [0, 2**63 - 1]")
    gen.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    add_layers_argument(gen)

    add_chat_command(commands)

    conv = commands.add_parser("convert", help="convert a Hugging Face release to per-layer Orbax checkpoints")
    conv.add_argument("hf_dir", type=_local_dir, metavar="HF_DIR", help="Hugging Face release directory")
    conv.add_argument("out_dir", type=_local_dir, metavar="OUT_DIR", nargs="?",
                      help="output directory (it gets the release's config and tokenizer files too)")
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
    add_serve_command(commands)
    add_finetune_command(commands)

    args = parser.parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    """Dispatch a parsed command line."""
    if args.command == "plan":
        return run_plan_command(args)
    if args.command == "convert":
        return _run_convert(args)
    if args.command == "chat":
        return run_chat_command(args)
    if args.command == "finetune":
        if args.mesh is not None:
            _use_fake_cpu_devices()
        distributed.initialize()
        return run_finetune_command(args)
    if args.command == "demo":
        _use_fake_cpu_devices()
        distributed.initialize()  # before JAX lists devices; nothing happens on a single process
        if not _mesh_fits(args.mesh):
            return 2
        with warnings.catch_warnings():  # the demo's random tiny model has no tokenizer by design: bytes it is
            warnings.simplefilter("ignore", ByteFallbackWarning)
            return run_demo(prompt=args.prompt, max_new_tokens=args.max_new_tokens, mesh=args.mesh)
    if args.mesh is not None:
        _use_fake_cpu_devices()
    distributed.initialize()  # generate, serve: join a multi-process job if the environment describes one
    if args.mesh is not None:
        if not _mesh_fits(args.mesh):
            return 2
    return run_serve_command(args) if args.command == "serve" else _run_generation(args)


def _mesh_fits(spec: str | None) -> bool:
    """Whether --mesh `spec` (None: the command's default) fits this process's devices; if not, say why."""
    try:
        if spec is not None:
            parse_mesh_spec(spec, jax.device_count())
    except ValueError as err:
        print(f"error: --mesh: {err}", file=sys.stderr)
        return False
    return True

"""Conversion throughput (GB/s of source read) against the raw read throughput of the same files.

Writes a synthetic multi-GB release in the real layout (MXFP4 routed experts, bf16 / fp32 dense
tensors, 8 shards plus index) under /tmp (never the repo), then alternates, `--repeats` times:

  raw read    every shard file read sequentially in 16 MiB chunks (no parsing)
  convert     `k3jax.convert.convert(SRC, OUT)` for each `--experts` mode (mxfp4: codes and scales
              kept as stored; bf16: MXFP4 decoded to bfloat16, 3.8x the bytes written)

Before every measurement the page cache is put in the same state for all of them: `--cache cold`
drops it (`/proc/sys/vm/drop_caches`, needs root; also drops the previous run's output pages),
`--cache warm` reads every shard once first. Throughput = source bytes / wall seconds (the
conversion's includes planning from headers, checksums, the Orbax writes and the manifest);
medians are printed, with `--profile` a cProfile summary of one conversion per mode.

    PYTHONPATH=. python benchmarks/convert_throughput.py [--gb 2] [--repeats 3] [--cache cold|warm]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from k3jax.config import K3Config
from k3jax.convert import convert
from k3jax.convert.plan import EXPERTS_PREFIX, abstract_items
from k3jax.model import K3Model

GOLDEN_CONFIG = Path(__file__).resolve().parents[1] / "tests/golden/k3-tiny-a/config.json"
CHUNK = 16 << 20


def synthetic_config(gb: float) -> dict:
    """The golden config widened so that MXFP4 experts are ~90% of the bytes, as in the release."""
    config = json.loads(GOLDEN_CONFIG.read_text())
    layers = max(2, round(gb * 4.6))  # ~0.21 GB per MoE layer
    kda = [i for i in range(1, layers + 1) if i % 4 and i != layers]
    config["text_config"].update(
        hidden_size=1024, vocab_size=32768, num_hidden_layers=layers, num_experts=128, num_experts_per_token=8,
        moe_intermediate_size=1024, routed_expert_hidden_size=1024, intermediate_size=2048, q_lora_rank=256,
        kv_lora_rank=128, num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64,
    )
    config["text_config"]["linear_attn_config"].update(
        num_heads=8, head_dim=128, kda_layers=kda, full_attn_layers=[i for i in range(1, layers + 1) if i not in kda])
    return config


def write_synthetic_release(root: Path, config: dict, num_shards: int = 8, seed: int = 0) -> int:
    """Random weights in the release layout; returns the bytes of tensor data written."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    cfg = K3Config.from_hf(config)
    abstract = nnx.eval_shape(lambda: K3Model.init(cfg))
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    weight_map, shard, total = {}, 0, 0
    items = list(abstract_items(abstract).values())
    per_shard = -(-len(items) // num_shards)
    num_files = -(-len(items) // per_shard)

    def flush():
        nonlocal shard, tensors
        name = f"model-{shard + 1:05d}-of-{num_files:06d}.safetensors"
        save_file(tensors, str(root / name))
        weight_map.update({t: name for t in tensors})
        shard, tensors = shard + 1, {}

    for n, slots in enumerate(items):
        for slot, leaf in slots.items():
            name = (f"language_model.model.layers.{slot.layer}.{slot.target}" if slot.layer is not None else
                    "language_model." + (slot.target if slot.target.startswith("lm_head.") else f"model.{slot.target}"))
            shape = tuple(leaf.shape)
            if slot.target.startswith(EXPERTS_PREFIX):
                num_experts, out, cols = shape
                base = name.removesuffix(slot.target) + EXPERTS_PREFIX
                projection = slot.target.removeprefix(EXPERTS_PREFIX)
                for e in range(num_experts):
                    tensors[f"{base}{e}.{projection}.weight_packed"] = rng.integers(0, 256, (out, cols // 2), np.uint8)
                    scale = rng.integers(112, 124, (out, cols // 32), np.uint8)  # factors 2^-15 .. 2^-4
                    tensors[f"{base}{e}.{projection}.weight_scale"] = scale
            elif slot.target == "self_attn.A_log":
                tensors[name] = np.pad(rng.random(shape, np.float32), (0, cfg.kda_head_dim - shape[0]))
            else:
                tensors[name] = (0.02 * rng.standard_normal(shape, np.float32)).astype(np.dtype(leaf.dtype))
        if (n + 1) % per_shard == 0:
            total += sum(t.nbytes for t in tensors.values())
            flush()
    if tensors:
        total += sum(t.nbytes for t in tensors.values())
        flush()
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def shard_files(src: Path) -> list[Path]:
    return sorted(src.glob("*.safetensors"))


def read_all(src: Path) -> int:
    buf = bytearray(CHUNK)
    total = 0
    for path in shard_files(src):
        with path.open("rb", buffering=0) as f:
            while got := f.readinto(buf):
                total += got
    return total


def set_cache(src: Path, mode: str) -> None:
    if mode == "cold":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    else:
        read_all(src)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="approximate size of the synthetic release")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold")
    parser.add_argument("--experts", nargs="+", default=["mxfp4", "bf16"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/k3_convert_bench"))
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    src, out = args.workdir / "release", args.workdir / "out"
    config = synthetic_config(args.gb)
    marker = args.workdir / "release.json"
    if not (marker.is_file() and json.loads(marker.read_text()).get("config") == config):
        shutil.rmtree(args.workdir, ignore_errors=True)
        start = time.perf_counter()
        data = write_synthetic_release(src, config)
        marker.write_text(json.dumps({"config": config, "data_bytes": data}))
        print(f"wrote {data / 1e9:.2f} GB synthetic release in {time.perf_counter() - start:.0f} s")
    file_bytes = sum(p.stat().st_size for p in shard_files(src))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"source {file_bytes / 1e9:.3f} GB in {len(shard_files(src))} shards; cache {args.cache}")

    seconds: dict[str, list[float]] = {"raw read": [], **{f"convert --experts {e}": [] for e in args.experts}}
    written: dict[str, int] = {}
    for _ in range(args.repeats):
        set_cache(src, args.cache)
        seconds["raw read"].append(timed(lambda: read_all(src)))
        for experts in args.experts:
            shutil.rmtree(out, ignore_errors=True)
            set_cache(src, args.cache)
            result = None

            def run():
                nonlocal result
                result = convert(src, out, experts=experts, progress=False)

            seconds[f"convert --experts {experts}"].append(timed(run))
            written[experts] = result.nbytes
    raw = statistics.median(seconds["raw read"])
    print(f"\n| what | median s | GB/s of source | vs raw read | runs (s) |\n|---|---|---|---|---|")
    for what, runs in seconds.items():
        median = statistics.median(runs)
        extra = f" (writes {written[what.split()[-1]] / 1e9:.2f} GB)" if what.startswith("convert") else ""
        print(f"| {what}{extra} | {median:.2f} | {file_bytes / median / 1e9:.2f} | {raw / median:.0%} | "
              f"{', '.join(f'{r:.2f}' for r in runs)} |")

    if args.profile:
        for experts in args.experts:
            shutil.rmtree(out, ignore_errors=True)
            set_cache(src, args.cache)
            profile = cProfile.Profile()
            profile.runcall(convert, src, out, experts=experts, progress=False)
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
            print(f"\nprofile, --experts {experts}:\n" + "\n".join(text.getvalue().splitlines()[4:]))
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()

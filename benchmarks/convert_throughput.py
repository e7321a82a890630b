"""Conversion throughput (GB/s of source read) against the raw read throughput of the same files.

Writes a synthetic multi-GB release in the real layout (MXFP4 routed experts, bf16 / fp32 dense
tensors, 8 shards plus index) under /tmp (never the repo), then alternates, `--repeats` times:

  raw read    every shard file read sequentially in 16 MiB chunks (no parsing)
  convert     `k3jax.convert.convert(SRC, OUT)` for each `--experts` mode (mxfp4: codes and scales
              kept as stored; bf16: MXFP4 decoded to bfloat16, 3.8x the bytes written), with each
              item fsynced before it is committed (the default) and with `sync=False`

Before every measurement the page cache is put in the same state for all of them: `--cache cold`
drops it (`/proc/sys/vm/drop_caches`, needs root; also drops the previous run's output pages),
`--cache warm` reads every shard once first. Throughput = source bytes / wall seconds (the
conversion's includes planning from headers, checksums, the Orbax writes and the manifest);
medians are printed with the CPU seconds (user + system, all threads) of each, and the load
average before and after, since other processes on the machine slow the CPU-bound conversion
more than the raw read. With `--profile` a cProfile summary of one conversion per mode; with
`--stages` one conversion run stage by stage (no overlap), each timed, then one `sync=False`
conversion each with the checksum, the writes, or both replaced by nothing (a what-if: those
outputs are unusable), against the median raw read.

    PYTHONPATH=. python benchmarks/convert_throughput.py [--gb 2] [--repeats 3] [--cache cold|warm]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import resource
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from k3jax.checkpoint.names import EXPERTS_PREFIX, abstract_items, release_name
from k3jax.checkpoint.store import ItemStore, leaf_record, write_manifest
from k3jax.checkpoint.transform import item_buffer_bytes, materialize_item
from k3jax.config import K3Config
from k3jax.convert import convert, converter
from k3jax.convert.output import open_output
from k3jax.convert.planned import plan_conversion
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
            name = release_name(slot)
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


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    cpu, start = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - start, cpu_seconds() - cpu


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def stages(src: Path, out: Path, experts: str, cache: str) -> None:
    """One conversion done stage after stage (what each costs alone), with `convert`'s own pieces."""
    spent: dict[str, list[float]] = {}

    def stage(name, fn, *args, **kwargs):
        cpu, start = cpu_seconds(), time.perf_counter()
        result = fn(*args, **kwargs)
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        spent.setdefault(name, [0.0, 0.0])
        spent[name][0] += wall
        spent[name][1] += cpu
        return result

    shutil.rmtree(out, ignore_errors=True)
    set_cache(src, cache)
    planned = stage("plan (config, headers, abstract model)", plan_conversion, src, experts=experts)
    manifest = open_output(out, planned, resume=False)
    store = ItemStore(out)
    buffer = np.empty(max(item_buffer_bytes(item) for item in planned.plan.items), np.uint8)
    for item in planned.plan.items:
        leaves = stage("read + transform (into a reused buffer)", materialize_item, item, planned.index, buffer)
        records = stage("crc32 of every leaf (all cores)", lambda: {k: leaf_record(v) for k, v in leaves.items()})
        stage("Orbax/TensorStore write (page cache)", store.write, item.name, leaves)
        stage("fsync + rename", store.commit, item.name)
        manifest["items"][item.name] = records
        stage("manifest commit", write_manifest, out, manifest)
    nbytes = planned.plan.nbytes
    print(f"\nstages, --experts {experts}, one after another ({cache} cache, load {load_average()}):\n"
          "| stage | wall s | CPU s | GB/s of wall |\n|---|---|---|---|")
    for name, (wall, cpu) in spent.items():
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {nbytes / wall / 1e9:.2f} |")
    print(f"| sum | {sum(w for w, _ in spent.values()):.2f} | {sum(c for _, c in spent.values()):.2f} | |")


@contextlib.contextmanager
def without(*removed: str):
    """`convert` with pipeline stages ("checksum", "write") replaced by nothing: a what-if measurement,
    whose output is unusable."""
    saved = converter._leaf_records, ItemStore.write, ItemStore.commit
    if "checksum" in removed:
        converter._leaf_records = lambda leaves: {name: {} for name in leaves}
    if "write" in removed:
        ItemStore.write = lambda self, item, leaves: None
        ItemStore.commit = lambda self, item, sync=True: None
    try:
        yield
    finally:
        converter._leaf_records, ItemStore.write, ItemStore.commit = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="approximate size of the synthetic release")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold")
    parser.add_argument("--experts", nargs="+", default=["mxfp4", "bf16"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/k3_convert_bench"))
    parser.add_argument("--sync", choices=("both", "yes", "no"), default="both",
                        help="measure conversions that fsync each item (the default), ones that do not, or both")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--stages", action="store_true")
    args = parser.parse_args()
    syncs = {"both": (True, False), "yes": (True,), "no": (False,)}[args.sync]

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
          f"source {file_bytes / 1e9:.3f} GB in {len(shard_files(src))} shards; cache {args.cache}; "
          f"load average {load_average()} (1/5/15 min)")

    runs: dict[tuple, list[tuple[float, float]]] = {("raw read",): []}
    runs.update({(experts, sync): [] for experts in args.experts for sync in syncs})
    written: dict[str, int] = {}
    for _ in range(args.repeats):
        set_cache(src, args.cache)
        runs[("raw read",)].append(timed(lambda: read_all(src)))
        for experts, sync in list(runs)[1:]:
            shutil.rmtree(out, ignore_errors=True)
            set_cache(src, args.cache)
            result = None

            def run():
                nonlocal result
                result = convert(src, out, experts=experts, progress=False, sync=sync)

            runs[(experts, sync)].append(timed(run))
            written[experts] = result.nbytes
    raw = statistics.median(wall for wall, _ in runs[("raw read",)])
    print(f"load average after: {load_average()}")
    print("\n| what | median s | median CPU s | GB/s of source | vs raw read | runs (s) |\n|---|---|---|---|---|---|")
    for key, timings in runs.items():
        what = "raw read" if key == ("raw read",) else (
            f"convert --experts {key[0]}{'' if key[1] else ', sync=False'} (writes {written[key[0]] / 1e9:.2f} GB)")
        median = statistics.median(wall for wall, _ in timings)
        cpu = statistics.median(c for _, c in timings)
        print(f"| {what} | {median:.2f} | {cpu:.2f} | {file_bytes / median / 1e9:.2f} | {raw / median:.0%} | "
              f"{', '.join(f'{wall:.2f}' for wall, _ in timings)} |")

    if args.stages:
        for experts in args.experts:
            stages(src, out, experts, args.cache)
        print(f"\npipeline with a stage removed, --experts {args.experts[0]}, sync=False "
              f"(load {load_average()}):\n| removed | s | CPU s | vs raw read |\n|---|---|---|---|")
        for removed in (("checksum",), ("write",), ("checksum", "write")):
            shutil.rmtree(out, ignore_errors=True)
            set_cache(src, args.cache)
            with without(*removed):
                wall, cpu = timed(lambda: convert(src, out, experts=args.experts[0], progress=False, sync=False))
            print(f"| {' and '.join(removed)} | {wall:.2f} | {cpu:.2f} | {raw / wall:.0%} |")

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

"""Long prompts on one device: a 4-layer K3 at full width (3 KDA + 1 MLA layers, 8 experts) generates
from 4K / 32K / 64K / 128K-token prompts with chunked prefill; prefill tokens/s and peak memory per
length, and chunked vs whole-prompt logits on a short prompt.

The chunk is `k3jax.prefill_chunk.default_chunk_size` for the device (or --chunk). Each length runs
once to compile (its cache capacity is its own shape), then is timed; peak memory is the device's
peak since the process started, so lengths run shortest first and each figure covers that length.

    PYTHONPATH=. python benchmarks/long_prompt.py --out long_prompt.json              # one GPU
    PYTHONPATH=. python benchmarks/long_prompt.py --smoke --out /tmp/long_prompt.json  # CPU, tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp

from benchmarks.e2e_reduced_k3 import reduced_config
from k3jax.assets import tiny_checkpoint
from k3jax.generate import generate, prefill
from k3jax.kernels import Kernels
from k3jax.model import K3Model
from k3jax.prefill_chunk import default_chunk_size, device_memory_bytes


def peak_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return stats.get("peak_bytes_in_use") if stats else None


def rel_rms(a: jax.Array, b: jax.Array) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b**2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/kimi_k3.json")
    parser.add_argument("--lengths", default="4096,32768,65536,131072")
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the device's default)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--mla", default=None,
                        help="MLA prefill implementation to name (pallas_kernels/mla/dispatch.py); default: the policy's")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, short prompts, on CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if args.smoke:
        cfg = reduced_config(str(tiny_checkpoint()), 4, 8)
        cfg = dataclasses.replace(cfg, dtype="float32")
        lengths, check_len = [64, 96], 48
    else:
        cfg = reduced_config(args.config, 4, 8)
        lengths, check_len = [int(x) for x in args.lengths.split(",")], 2048
    assert cfg.mixer_kinds == ("kda", "kda", "kda", "mla"), cfg.mixer_kinds
    model = K3Model.init(cfg, seed=0, kernels=Kernels(mla=args.mla))
    memory = device_memory_bytes()
    chunk = args.chunk or default_chunk_size(cfg, 1, memory) or (32 if args.smoke else None)
    results = {"device": str(jax.devices()[0]), "memory_bytes": memory, "chunk": chunk,
               "mla": args.mla or "policy", "layers": cfg.num_hidden_layers, "experts": cfg.num_experts, "hidden": cfg.hidden_size, "runs": []}
    print(json.dumps(results), flush=True)

    key = jax.random.key(0)
    check = jax.random.randint(key, (1, check_len), 0, cfg.vocab_size, jnp.int32)
    whole = prefill(model, check)[0]
    chunked = prefill(model, check, chunk_size=max(check_len // 4, 1))[0]
    results["chunked_vs_whole_last_logits_rel_rms"] = rel_rms(chunked, whole)
    print(f"chunked vs whole prefill, {check_len} tokens: rel-RMS {results['chunked_vs_whole_last_logits_rel_rms']:.2e}")

    for length in lengths:
        ids = jax.random.randint(jax.random.fold_in(key, length), (1, length), 0, cfg.vocab_size, jnp.int32)
        capacity = length + args.new_tokens
        run = {"prompt": length}
        try:
            jax.block_until_ready(prefill(model, ids, capacity=capacity, chunk_size=chunk))  # compiles
            begin = time.perf_counter()
            jax.block_until_ready(prefill(model, ids, capacity=capacity, chunk_size=chunk))
            seconds = time.perf_counter() - begin
            tokens = generate(model, ids, max_new_tokens=args.new_tokens, capacity=capacity,
                              prefill_chunk_size=chunk)
            run.update(prefill_s=seconds, prefill_tokens_per_s=length / seconds, peak_bytes=peak_bytes(),
                       generated=[int(t) for t in tokens[0]])
        except Exception as err:  # noqa: BLE001 - out of memory at one length is a result, not a crash
            run["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        results["runs"].append(run)
        print(json.dumps(run), flush=True)

    print("\n| prompt tokens | prefill s | prefill tokens/s | peak memory GB |")
    print("|---|---|---|---|")
    for run in results["runs"]:
        if "error" in run:
            print(f"| {run['prompt']} | {run['error'][:60]} | | |")
            continue
        peak = "-" if run["peak_bytes"] is None else f"{run['peak_bytes'] / 1e9:.1f}"
        print(f"| {run['prompt']} | {run['prefill_s']:.2f} | {run['prefill_tokens_per_s']:.0f} | {peak} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""Decode at the bandwidth limit: one decode step of an 8-layer K3 at full width (32 experts) with a
1024-token context, at batch 1 / 16 / 64, against the bytes the step must read and the device's copy
bandwidth measured in the same job; plus a profiler trace of the steps summarised into the top ops.

Bytes a step must read: every non-routed parameter (of the token embedding only the batch's rows); of
the routed experts, the fraction the step's router actually picks (distinct experts per MoE layer,
read from the step's router ids, over all layers); the KDA states (fp32) and conv windows; the MLA
latent cache up to the context length. Its floor is bytes / bandwidth, where bandwidth = 2 x size /
time of a plain device copy of 1 GiB (read + write). "% of limit" = floor / measured step time.

The trace (`jax.profiler.trace`, Perfetto JSON) is summed by event name over the timed steps; the
top ops by total time go to the printed table and to --out.

    PYTHONPATH=. python benchmarks/decode_bandwidth.py --out decode_bandwidth.json   # one GPU
    PYTHONPATH=. python benchmarks/decode_bandwidth.py --smoke --out /tmp/db.json      # CPU, tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.e2e_reduced_k3 import reduced_config
from benchmarks.timing import median_ms
from benchmarks.trace import traced_ops
from k3jax.assets import tiny_checkpoint
from k3jax.generate import _decode_step, prefill
from k3jax.model import K3Model, run_model
from k3jax.nn.kda import KDACache
from k3jax.nn.mla import MLACache

ROUTED = ("w1", "w2", "w3")  # the routed experts' stacked weights, leading axis = expert (after any layer axis)


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def split_param_bytes(model: K3Model) -> tuple[int, int, int]:
    """(non-routed parameter bytes but the token embedding, routed expert bytes, bytes of one embedding
    row): a step reads only its tokens' rows of the embedding table."""
    routed = other = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        size = leaf.size * leaf.dtype.itemsize
        if "embed_tokens" in names:
            row = size // leaf.shape[0]
        elif names & set(ROUTED):
            routed += size
        else:
            other += size
    return other, routed, row


def touched_expert_fraction(model: K3Model, cache, tokens: jax.Array) -> float:
    """Distinct routed experts the step picks, over all MoE layers, / (layers x experts)."""
    out, _ = run_model(model, tokens[:, None], jax.tree.map(jnp.copy, cache), collect_taps=True)
    picked = [np.unique(np.asarray(t.router_ids)).size for t in out.taps if t.router_ids is not None]
    return sum(picked) / (len(picked) * model.config.num_experts) if picked else 0.0


def cache_read_bytes(cache, context: int) -> int:
    """KDA state + conv (whole) and the MLA latents up to `context` positions."""
    total = 0
    for node in jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, (KDACache, MLACache))):
        if isinstance(node, KDACache):
            total += nbytes(node)
        elif isinstance(node, MLACache):
            lat = node.latent
            total += lat.size // lat.shape[-2] * context * lat.dtype.itemsize
    return total


def copy_bandwidth(size: int) -> float:
    """Bytes/s of a plain on-device copy (read + write) of `size` bytes."""
    x = jnp.ones((size // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 0.0)  # not elided by XLA: a real read and write of every element
    ms = median_ms(copy, x, reps=7, inner=5)
    return 2 * x.size * 4 / (ms / 1e3)


def time_decode(model: K3Model, cfg, batch: int, context: int, steps: int, other: int, routed: int,
                embedding_row: int, bandwidth: float) -> tuple[dict, Callable[[], jax.Array]]:
    """(median decode step after a `context`-token prefill with its bytes to read and floor, the timed
    closure for the trace)."""
    ids = jax.random.randint(jax.random.key(batch), (batch, context), 0, cfg.vocab_size, jnp.int32)
    _, cache = prefill(model, ids, capacity=context + 4 * steps + 8)
    tokens = ids[:, -1]
    fraction = touched_expert_fraction(model, cache, tokens)
    read = other + batch * embedding_row + int(routed * fraction) + cache_read_bytes(cache, context)

    def run_steps():
        nonlocal cache
        for _ in range(steps):
            logits, cache = _decode_step(model, cache, tokens)
        return logits

    step_ms = median_ms(run_steps, reps=3) / steps
    floor_ms = read / bandwidth * 1e3
    return {"batch": batch, "step_ms": step_ms, "bytes_read": read, "experts_touched": fraction,
            "floor_ms": floor_ms, "percent_of_limit": 100 * floor_ms / step_ms}, run_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/kimi_k3.json")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--layouts", default="scan,unrolled",
                        help="layers scanned over stacked weights and/or unrolled (K3Model.unroll_layers)")
    parser.add_argument("--smoke", action="store_true", help="the tiny model on CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        cfg = dataclasses.replace(reduced_config(str(tiny_checkpoint()), 4, 8), dtype="float32")
        batches, context, copy_size = [1, 4], 32, 1 << 24
    else:
        cfg = reduced_config(args.config, 8, 32)
        batches, context, copy_size = [int(b) for b in args.batches.split(",")], args.context, 1 << 30
    model = K3Model.init(cfg, seed=0)
    other, routed, embedding_row = split_param_bytes(model)
    bandwidth = copy_bandwidth(copy_size)
    results = {"device": str(jax.devices()[0]), "layers": cfg.num_hidden_layers, "experts": cfg.num_experts,
               "context": context, "copy_bandwidth_bytes_per_s": bandwidth, "non_routed_param_bytes": other,
               "routed_param_bytes": routed, "runs": []}
    print(json.dumps(results), flush=True)
    layouts = args.layouts.split(",")
    if layouts not in (["scan"], ["unrolled"], ["scan", "unrolled"]):  # unrolling is one-way: scan first
        parser.error(f"--layouts: expected scan, unrolled or scan,unrolled; got {args.layouts!r}")
    results["top_ops"] = {}
    for layout in layouts:
        if layout == "unrolled":
            model.unroll_layers()
        for batch in batches:
            run, steps = time_decode(model, cfg, batch, context, args.steps, other, routed, embedding_row, bandwidth)
            run["layout"] = layout
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
            if batch == batches[-1]:
                results["top_ops"][layout] = traced_ops(steps)[: args.top]
    print("\n| layers | batch | step ms | bytes read (MB) | experts touched | floor ms | % of limit |")
    print("|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['layout']} | {r['batch']} | {r['step_ms']:.3f} | {r['bytes_read'] / 1e6:.1f} | "
              f"{100 * r['experts_touched']:.0f}% | {r['floor_ms']:.3f} | {r['percent_of_limit']:.0f}% |")
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s")
    for layout, ops in results["top_ops"].items():
        print(f"\ntop ops, layers {layout}, batch {batches[-1]}:\n| op | total us | calls | share |\n|---|---|---|---|")
        for op in ops:
            print(f"| {op['op'][:70]} | {op['total_us']:.0f} | {op['calls']} | {100 * op['share']:.1f}% |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

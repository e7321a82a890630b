"""Compile time of the forward pass vs depth: scanned layer groups (the default) against fully unrolled.

Uses configs/k3_narrow_93.json (the full K3 layer pattern and depth, narrow widths) at 45 and 93
layers. The model is abstract (`nnx.eval_shape`), so nothing is allocated; each measurement is a
fresh `jax.jit(k3jax.forward).lower(model, ids).compile()` after `jax.clear_caches()`.

    PYTHONPATH=. python benchmarks/compile_time.py [--repeats 3] [--seq 128] [--no-unrolled]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
from flax import nnx

import k3jax
import k3jax.model
from k3jax.layer_plan import LayerPlan

CONFIG = Path(__file__).resolve().parents[1] / "configs/k3_narrow_93.json"


def k3_mixers(n: int) -> tuple[str, ...]:
    """MLA at 1-based multiples of 4 and at the last layer, KDA elsewhere (the K3 rule)."""
    return tuple("mla" if (i + 1) % 4 == 0 or i == n - 1 else "kda" for i in range(n))


def unrolled_plan(kinds) -> LayerPlan:
    return LayerPlan(len(kinds), start=len(kinds), period=1, num_groups=0)  # every layer in the head


def compile_seconds(cfg: k3jax.K3Config, ids: jax.ShapeDtypeStruct, unrolled: bool) -> tuple[float, float, int]:
    """(lower seconds, compile seconds, scanned groups) for one fresh compile."""
    jax.clear_caches()
    patch = mock.patch.object(k3jax.model, "plan_layers", unrolled_plan) if unrolled else contextlib.nullcontext()
    with patch:
        model = nnx.eval_shape(lambda: k3jax.K3Model.init(cfg))
        start = time.perf_counter()
        lowered = jax.jit(k3jax.forward).lower(model, ids)
        lowered_at = time.perf_counter()
        lowered.compile()
        done = time.perf_counter()
    return lowered_at - start, done - lowered_at, model.plan.num_groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--no-unrolled", action="store_true", help="skip the unrolled contrast")
    args = parser.parse_args()

    base = k3jax.K3Config.from_hf(CONFIG)
    ids = jax.ShapeDtypeStruct((1, args.seq), jnp.int32)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {CONFIG.name}, ids [1, {args.seq}], "
          f"median of {args.repeats} fresh compiles")
    compile_seconds(base, ids, unrolled=False)  # warm-up (one-time backend and tracing costs), not counted
    print("| layers | layout | scanned groups | lower s | compile s | total s |")
    print("|---|---|---|---|---|---|")
    for layers in (45, 93):
        cfg = dataclasses.replace(base, num_hidden_layers=layers, mixer_kinds=k3_mixers(layers))
        for unrolled in (False, True) if not args.no_unrolled else (False,):
            runs = [compile_seconds(cfg, ids, unrolled) for _ in range(args.repeats)]
            lower = statistics.median(r[0] for r in runs)
            comp = statistics.median(r[1] for r in runs)
            total = statistics.median(r[0] + r[1] for r in runs)
            layout = "unrolled" if unrolled else "scanned"
            print(f"| {layers} | {layout} | {runs[0][2]} | {lower:.1f} | {comp:.1f} | {total:.1f} |", flush=True)


if __name__ == "__main__":
    main()

"""MXFP4 gate+up in Mosaic GPU (weights decoded in registers) against the bf16 kernel, on the H200.

First checks the kernel against the bf16 Mosaic GPU kernel on the same weights decoded by the
release decoder (``pallas_kernels.mxfp4.decode_mxfp4_jax``), at small shapes with empty experts,
rows that are not a multiple of 8 and rows past the last expert; then times, in turns in one
process (medians of ``--rounds`` rounds, rotating order), at K3's widths (3584 -> 2 x 3072,
16384 rows, uniform groups):

  bf16          ``gate_up_situ_mgpu`` on bf16 weights (the kernel MXFP4 is measured against)
  mxfp4         ``gate_up_situ_mxfp4_mgpu`` on the packed codes and scale bytes (scale conversion
                included; x's columns already in ``x_column_order``, as the sorting gather leaves them)
  decode_first  the layer decoded to bf16 in XLA, then the bf16 kernel (the previous large-batch path)
  permute       x[:, x_column_order(K)] alone, for reference (in the model it rides the gather)

and the whole routed layer (``routed_experts``, 2048 tokens x top-8 over 28 experts, down weights
3072 -> 3584 packed too): packed weights (gate+up in this kernel, down decoded first) against the
layer decoded first and against bf16 weights, after checking it against the bf16 weights' output.

    PYTHONPATH=. python3 benchmarks/moe_mxfp4_mgpu.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_ms
from pallas_kernels.moe import pallas_gpu, routed_experts
from pallas_kernels.moe.mosaic_gpu import gate_up_situ_mgpu, gate_up_situ_mxfp4_mgpu, x_column_order
from pallas_kernels.mxfp4 import MXFP4Experts, decode_experts, decode_mxfp4_jax


def random_mxfp4(e: int, n: int, k: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """Uniform random codes and scale bytes 2^-9 .. 2^-4 (trained weights' range)."""
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.integers(0, 256, (e, n, k // 2), dtype=np.uint8)),
            jnp.asarray(r.integers(118, 124, (e, n, k // 32), dtype=np.uint8)))


def case(e: int, n: int, k: int, sizes: list[int], extra_rows: int, seed: int = 0) -> dict:
    p1, s1 = random_mxfp4(e, n, k, seed)
    p3, s3 = random_mxfp4(e, n, k, seed + 1)
    real = sum(sizes)
    x = jax.random.normal(jax.random.key(seed), (real + extra_rows, k), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    w1, w3 = decode_mxfp4_jax(p1, s1, jnp.bfloat16), decode_mxfp4_jax(p3, s3, jnp.bfloat16)
    order = jnp.asarray(x_column_order(k))
    x_ordered = x[:, order]
    return dict(p1=p1, s1=s1, p3=p3, s3=s3, x=x, x_ordered=x_ordered, gs=gs, w1=w1, w3=w3,
                order=order, real=real)


def check(c: dict) -> dict:
    """Max |mxfp4 - bf16 kernel| over the real rows, relative to max |bf16|; rows past the last
    expert must be zeros."""
    ref = gate_up_situ_mgpu(c["x"], c["w1"], c["w3"], c["gs"]).astype(jnp.float32)
    out = gate_up_situ_mxfp4_mgpu(c["x_ordered"], c["p1"], c["s1"], c["p3"], c["s3"],
                                  c["gs"]).astype(jnp.float32)
    real = c["real"]
    diff = float(jnp.max(jnp.abs(out[:real] - ref[:real])))
    return dict(max_abs=diff, rel=diff / float(jnp.max(jnp.abs(ref[:real]))),
                spare_rows_max=float(jnp.max(jnp.abs(out[real:]))) if out.shape[0] > real else 0.0,
                finite=bool(jnp.all(jnp.isfinite(out))))


def main(rounds: int) -> None:
    small = [(4, 256, 256, [100, 0, 237, 50], 5), (3, 256, 512, [128, 300, 1], 3),
             (2, 384, 384, [0, 77], 0)]
    for e, n, k, sizes, extra in small:
        res = check(case(e, n, k, sizes, extra))
        print(json.dumps(dict(check=(e, n, k, sizes, extra), **res)), flush=True)
        assert res["finite"] and res["rel"] < 1e-2 and res["spare_rows_max"] == 0.0, res

    e, n, k, m = 28, 3072, 3584, 16384
    sizes = [m // e + (i < m % e) for i in range(e)]
    c = case(e, n, k, sizes, 0)
    res = check(c)
    print(json.dumps(dict(check=(e, n, k, "uniform", m), **res)), flush=True)
    assert res["finite"] and res["rel"] < 1e-2, res

    decode_first = jax.jit(lambda x, p1, s1, p3, s3, gs: gate_up_situ_mgpu(
        x, decode_mxfp4_jax(p1, s1, jnp.bfloat16), decode_mxfp4_jax(p3, s3, jnp.bfloat16), gs))
    permute = jax.jit(lambda x, order: x[:, order])
    contenders = {
        "bf16": lambda: gate_up_situ_mgpu(c["x"], c["w1"], c["w3"], c["gs"]),
        "mxfp4": lambda: gate_up_situ_mxfp4_mgpu(c["x_ordered"], c["p1"], c["s1"], c["p3"],
                                                 c["s3"], c["gs"]),
        "decode_first": lambda: decode_first(c["x"], c["p1"], c["s1"], c["p3"], c["s3"], c["gs"]),
        "permute": lambda: permute(c["x"], c["order"]),
    }
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(median_ms(contenders[name], reps=3, inner=5))
    flops = 2 * 2 * m * n * k
    med = {name: statistics.median(t) for name, t in times.items()}
    summary = {name: dict(ms=round(med[name], 4), tflops=round(flops / med[name] / 1e9, 1))
               for name in names}
    summary["mxfp4_vs_bf16"] = round(med["bf16"] / med["mxfp4"], 3)
    summary["decode_first_vs_bf16"] = round(med["bf16"] / med["decode_first"], 3)
    print(json.dumps(dict(device=jax.devices()[0].device_kind, shape=(e, n, k, m), rounds=rounds,
                          **summary)), flush=True)


def routed(rounds: int) -> None:
    e, d, f, tokens, top_k = 28, 3584, 3072, 2048, 8
    w1, w3 = (MXFP4Experts(*random_mxfp4(e, f, d, s)) for s in (10, 11))
    w2 = MXFP4Experts(*random_mxfp4(e, d, f, 12))
    x = jax.random.normal(jax.random.key(1), (tokens, d), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(2), (tokens, top_k), 0, e)
    gates = jax.nn.softmax(jax.random.normal(jax.random.key(3), (tokens, top_k)), axis=-1)
    plan = pallas_gpu.plan_kernels(dtype=x.dtype, weight_dtype=None, packed=True, num_rows=ids.size, num_experts=e,
                                   d_in=d, hidden=f, d_out=d, interpret=False)
    assert plan.gate_up == "mosaic_gpu_mxfp4", plan
    layer = functools.partial(routed_experts, beta=4.0, linear_beta=25.0, implementation="pallas_gpu")
    packed = jax.jit(lambda x, w1, w2, w3: layer(x, w1, w2, w3, gates, ids))
    decoded_first = jax.jit(lambda x, w1, w2, w3: layer(
        x, *(decode_experts(w, jnp.bfloat16) for w in (w1, w2, w3)), gates, ids))
    dense = [decode_experts(w, jnp.bfloat16) for w in (w1, w2, w3)]
    ref = decoded_first(x, w1, w2, w3).astype(jnp.float32)
    out = packed(x, w1, w2, w3).astype(jnp.float32)
    rel = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
    print(json.dumps(dict(check="routed_experts packed vs decoded first", rel=rel)), flush=True)
    assert rel < 1e-2, rel
    contenders = {"packed": lambda: packed(x, w1, w2, w3),
                  "decoded_first": lambda: decoded_first(x, w1, w2, w3),
                  "bf16_weights": lambda: packed(x, *dense)}
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(median_ms(contenders[name], reps=3, inner=5))
    print(json.dumps(dict(routed=(tokens, top_k, e, d, f), **{
        name: round(statistics.median(t), 4) for name, t in times.items()})), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    main(args.rounds)
    routed(args.rounds)

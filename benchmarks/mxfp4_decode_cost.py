"""What a cheaper MXFP4 decode would buy the Mosaic GPU gate+up kernel: cost-only variants, on the GPU.

The MXFP4 kernel (``pallas_kernels/moe/mosaic_gpu/gate_up_mxfp4.py``) turns each 32-bit register of 8 E2M1
codes into four bf16x2 registers with 17 PTX instructions. This script measures what fewer
instructions would be worth by swapping the decode's PTX for cheaper text of the same shape (same
inputs and outputs, wrong values: cost only) and timing each variant in turns with the bf16 kernel
and the shipped kernel:

  shipped     the kernel as it is (checked against the bf16 kernel first)
  bit_order   the instruction mix of the best load-time bit order of the codes (no tiling of a
              thread's 128 code bits by a pair's bit pattern exists; 12 of 16 pairs fit whole): per
              register one pair and + multiply, two pairs funnel shift + and + multiply, one pair
              assembled from two shifts, and + lop3 + multiply (13 instructions per 8 codes)
  floor       and + multiply for every pair (8 per 8 codes): no bit order can do better
  zero        no decode at all, a zero left operand: what the kernel's structure costs

K3's widths, 28 experts x 16384 rows (uniform groups), 3584 -> 2 x 3072; medians of ``--rounds``
rounds (rotating order, each a median of 3 samples of 5 calls). JSON lines on stdout.

    PYTHONPATH=. python3 benchmarks/mxfp4_decode_cost.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp

from benchmarks.moe_mxfp4_mgpu import case, check
from benchmarks.timing import median_ms
from pallas_kernels.moe.mosaic_gpu import gate_up_mxfp4 as mx
from pallas_kernels.moe.mosaic_gpu import gate_up_situ_mgpu

_MASK = 0x81C081C0  # a pair's magnitude and sign bits


def _bit_order_ptx() -> str:
    """The instruction mix of the load-time order: 2 + 3 + 3 + 5 instructions for the four pairs."""
    lines = ["{", ".reg .b32 m, s, t;",
             f"and.b32 t, $4, {_MASK:#x};", "mul.rn.bf16x2 $0, t, $5;"]
    for j, rot in ((1, 3), (2, 6)):
        lines += [f"shf.r.wrap.b32 t, $4, $4, {rot};", f"and.b32 t, t, {_MASK:#x};",
                  f"mul.rn.bf16x2 ${j}, t, $5;"]
    lines += ["shf.r.wrap.b32 m, $4, $4, 9;", "shf.r.wrap.b32 s, $4, $4, 13;",
              "and.b32 m, m, 0x01C001C0;", "lop3.b32 t, m, s, 0x80008000, 0xF8;",
              "mul.rn.bf16x2 $3, t, $5;", "}"]
    return "\n".join(lines)


def _floor_ptx() -> str:
    """and + multiply per pair; the masks differ in a low mantissa bit so that nothing is merged."""
    lines = ["{", ".reg .b32 t;"]
    for j in range(4):
        lines += [f"and.b32 t, $4, {_MASK | j:#x};", f"mul.rn.bf16x2 ${j}, t, $5;"]
    lines.append("}")
    return "\n".join(lines)


def _zero_ptx() -> str:
    """Four zero registers: the products without any decode."""
    return "\n".join(["{"] + [f"mov.b32 ${j}, 0;" for j in range(4)] + ["}"])


def compiled(ptx, c: dict):
    """The MXFP4 kernel compiled with ``ptx`` as its pair decode (None: the shipped one)."""
    shipped = mx._pair_ptx
    if ptx is not None:
        mx._pair_ptx = ptx
    mx._decoder.cache_clear()
    jax.clear_caches()  # else the traced kernel, and with it the old PTX, is reused
    try:
        fn = jax.jit(mx.gate_up_situ_mxfp4_mgpu.__wrapped__)
        return fn.lower(c["x_ordered"], c["p1"], c["s1"], c["p3"], c["s3"], c["gs"]).compile()
    finally:
        mx._pair_ptx = shipped
        mx._decoder.cache_clear()


def main(rounds: int) -> None:
    e, n, k, m = 28, 3072, 3584, 16384
    c = case(e, n, k, [m // e + (i < m % e) for i in range(e)], 0)
    res = check(c)
    print(json.dumps(dict(check="shipped vs bf16 kernel", **res)), flush=True)
    assert res["finite"] and res["rel"] < 1e-2, res
    args = (c["x_ordered"], c["p1"], c["s1"], c["p3"], c["s3"], c["gs"])
    variants = {name: compiled(ptx, c) for name, ptx in
                (("shipped", None), ("bit_order", _bit_order_ptx), ("floor", _floor_ptx),
                 ("zero", _zero_ptx))}
    shipped = variants["shipped"](*args).astype(jnp.float32)
    for name, f in variants.items():  # the cost-only variants must compute something else
        diff = float(jnp.max(jnp.abs(f(*args).astype(jnp.float32) - shipped)))
        print(json.dumps(dict(variant=name, max_abs_diff_from_shipped=diff)), flush=True)
    contenders = {"bf16": lambda: gate_up_situ_mgpu(c["x"], c["w1"], c["w3"], c["gs"])}
    contenders.update({name: (lambda f=f: f(*args)) for name, f in variants.items()})
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(median_ms(contenders[name], reps=3, inner=5))
    med = {name: statistics.median(t) for name, t in times.items()}
    flops = 2 * 2 * m * n * k
    print(json.dumps(dict(
        device=jax.devices()[0].device_kind, shape=(e, n, k, m), rounds=rounds,
        **{name: dict(ms=round(med[name], 4), tflops=round(flops / med[name] / 1e9, 1),
                      vs_bf16=round(med["bf16"] / med[name], 3)) for name in names})), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    main(parser.parse_args().rounds)

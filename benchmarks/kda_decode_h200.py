"""H200: the Triton KDA decode step (``pallas_kernels/kda/triton/decode.py``) vs the XLA reference.

One token per sequence, N sequences, H=96 heads, K=V=128, fp32 state [N, H, K, V], bf16 q/k/v.
The step is memory bound, so the figure of merit is the state read+write bandwidth
``2 * N*H*K*V*4 bytes / time``. Run on the GPU machine:

    PYTHONPATH=. python3 benchmarks/kda_decode_h200.py jax      # ours + XLA reference
    python3 -m pip install -q --no-deps --target /tmp/site fla_core-0.6.0-py3-none-any.whl
    PYTHONPATH=/tmp/site:. python3 benchmarks/kda_decode_h200.py torch   # fla peer (optional)

Timings (jax): "loop" = a jitted ``lax.fori_loop`` of 50 steps carrying the state (kernel time,
no host dispatch), median of 20 runs / 50; "call" = median of 30 individually synced calls of the
donated-state jit (includes ~host dispatch). Results go to $OUT/kda_decode_*.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

OUT = os.environ.get("OUT", ".")
NS = (1, 64, 256)
H, K, V = 96, 128, 128
CONFIGS = [(64, 4), (64, 8), (64, 2), (32, 2), (128, 4)]  # (block_v, num_warps); the default first
LOOP = 50


def np_inputs(N, seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: r.standard_normal(s).astype(np.float32)
    q, k = f(N, H, K), f(N, H, K)
    return dict(
        q=q / np.linalg.norm(q, axis=-1, keepdims=True),
        k=k / np.linalg.norm(k, axis=-1, keepdims=True),
        v=f(N, H, V), g=(-5.0 / (1.0 + np.exp(-2.0 * f(N, H, K)))).astype(np.float32),
        beta=(1.0 / (1.0 + np.exp(-f(N, H)))).astype(np.float32), s=f(N, H, K, V),
    )


def state_bytes(N):
    return 2 * N * H * K * V * 4


def run_jax():
    import jax
    import jax.numpy as jnp
    from jax import lax

    from pallas_kernels.kda import kda_decode
    from pallas_kernels.kda.triton.decode import triton_kda_decode
    from pallas_kernels.kda.reference import recurrent_kda_step

    res = {"env": {"jax": jax.__version__, "device": str(jax.devices()[0])}, "check": {}, "time": {}}

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    # Numerics: fp32 and bf16 q/k/v, 8 sequences, every config, vs the fp32 reference.
    x = np_inputs(8, seed=1)
    for dt in ("float32", "bfloat16"):
        a = [jnp.asarray(x[n], dt) for n in ("q", "k", "v")] + [
            jnp.asarray(x[n]) for n in ("g", "beta", "s")]
        ro, rs = recurrent_kda_step(*a)
        for bv, nw in CONFIGS:
            try:
                o, s = triton_kda_decode(*a, block_v=bv, num_warps=nw)
                res["check"][f"{dt}_bv{bv}_w{nw}"] = {"o": rel(o, ro), "state": rel(s, rs)}
            except Exception as e:  # noqa: BLE001
                res["check"][f"{dt}_bv{bv}_w{nw}"] = {"error": repr(e)[:600]}
                print(res["check"][f"{dt}_bv{bv}_w{nw}"], flush=True)
        o, s = kda_decode(*a)  # the policy: "pallas_gpu" on GPU
        res["check"][f"{dt}_api_auto"] = {"o": rel(o, ro), "state": rel(s, rs)}
        # 20 aliased steps vs 20 reference steps
        s_p, s_r = jnp.array(a[5]), a[5]
        for t in range(20):
            o, s_p = triton_kda_decode(*a[:5], s_p, donate_state=True)
            ro, s_r = recurrent_kda_step(*a[:5], s_r)
        res["check"][f"{dt}_20steps"] = {"o": rel(o, ro), "state": rel(s_p, s_r)}
    print(json.dumps(res["check"], indent=1), flush=True)

    def make_loop(step):
        def body(_, c):
            s, acc = c
            o, s = step(s)
            return s, acc + o[0, 0, 0].astype(jnp.float32)
        return jax.jit(lambda *a: lax.fori_loop(0, LOOP, lambda i, c: body(i, c), a),
                       donate_argnums=(0,))

    def timed(fn, s):
        out = fn(s, jnp.float32(0))
        jax.block_until_ready(out)
        s = out[0]
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            out = fn(s, jnp.float32(0))
            jax.block_until_ready(out)
            ts.append(time.perf_counter() - t0)
            s = out[0]
        return float(np.median(ts)) / LOOP * 1e3, s

    for N in NS:
        x = np_inputs(N, seed=N)
        q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
        g, beta = jnp.asarray(x["g"]), jnp.asarray(x["beta"])
        s = jnp.asarray(x["s"])
        row = {}
        impls = {f"pallas_bv{bv}_w{nw}": (lambda st, bv=bv, nw=nw: triton_kda_decode(
            q, k, v, g, beta, st, block_v=bv, num_warps=nw)) for bv, nw in CONFIGS}
        impls["xla_reference"] = lambda st: recurrent_kda_step(q, k, v, g, beta, st)
        for name, step in impls.items():
            try:
                ms, s = timed(make_loop(step), s)
                row[name] = {"loop_ms": ms, "loop_TBps": state_bytes(N) / ms / 1e9}
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": repr(e)[:300]}
            print(N, name, row[name], flush=True)
        # per-call (dispatch included), default config, donated state
        call = jax.jit(lambda st: triton_kda_decode(q, k, v, g, beta, st), donate_argnums=(0,))
        o, s = call(s)
        jax.block_until_ready(s)
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            o, s = call(s)
            jax.block_until_ready((o, s))
            ts.append(time.perf_counter() - t0)
        ms = float(np.median(ts)) * 1e3
        row["pallas_default_call"] = {"call_ms": ms, "call_TBps": state_bytes(N) / ms / 1e9}
        print(N, "call", row["pallas_default_call"], flush=True)
        res["time"][N] = row
    with open(os.path.join(OUT, "kda_decode_jax.json"), "w") as f:
        json.dump(res, f, indent=1)


def run_torch():
    import torch
    import triton
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    res = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}, "time": {}}
    for N in NS:
        x = np_inputs(N, seed=N)
        t = {n: torch.tensor(a, device="cuda") for n, a in x.items()}
        q, k, v = (t[n][:, None].bfloat16().contiguous() for n in ("q", "k", "v"))
        g, beta = t["g"][:, None].contiguous(), t["beta"][:, None].contiguous()
        h0 = t["s"].contiguous()
        fn = lambda: fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=h0,
                                             output_final_state=True, inplace_final_state=True)
        with torch.inference_mode():
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
        res["time"][N] = {"ms": ms[0], "TBps": state_bytes(N) / ms[0] / 1e9}
        print(N, res["time"][N], flush=True)
    with open(os.path.join(OUT, "kda_decode_torch.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    {"jax": run_jax, "torch": run_torch}[sys.argv[1]]()

"""H200 check of packed variable-length sequences (``cu_seqlens``) in the GPU KDA forward.

Run on the GPU machine (about 2-3 minutes; results in $OUT/kda_varlen.json, rewritten after every
case, each case in its own try/except so one failure does not hide the rest):

    PYTHONPATH=. python3 benchmarks/kda_varlen_h200.py

1. Numerics, H=4, D=128, several length mixes (lengths 1, 63, 64, 65, 130, long and short
   together), fp32 and bf16 inputs: varlen Pallas vs the exact fp32 reference with the same
   ``cu_seqlens``, and (fp32) vs running each sequence alone through the batched Pallas path
   (must agree to rounding: no state crosses a boundary). Also K3's fused-activation call with
   ``cu_seqlens`` and ``chunk_kda(..., implementation=None)``, whose policy should pick the kernel
   ("pallas_gpu") on GPU.
2. Timing, H=96, D=128, bf16: 16 sequences of mixed lengths (not multiples of 64) packed into
   32768 tokens, vs the same sequences as a padded [16, max_len] batch, vs a uniform [16, 2048]
   batch (the same token count with no raggedness: the floor for the packed run), and the cost of
   the layout gathers alone.
"""

from __future__ import annotations

import json
import os
import time
import traceback

import numpy as np

OUT = os.environ.get("OUT", ".")
LB = -5.0
D = 128
H_CHECK = 4
MIXES = [(1, 63, 64, 65, 130), (1000, 1, 2047, 64, 333, 4), (4096,), (17,) * 8]
N_SEQ, TOTAL, H_TIME = 16, 32768, 96
# no new numerics case after this (each new shape is a Triton compile); KDA_VARLEN_NUMERICS_S=0
# goes straight to the timing (the numerics are recorded in benchmarks/RESULTS.md)
NUMERICS_BUDGET_S = float(os.environ.get("KDA_VARLEN_NUMERICS_S", "90"))
BUDGET_S = 170.0  # no new case at all after this


def mixed_lengths(n: int, total: int, seed: int = 0) -> list[int]:
    """n lengths summing to total, spread over ~30x, none a multiple of 64."""
    r = np.random.default_rng(seed)
    w = np.exp(r.uniform(0, np.log(30.0), n))
    lens = np.maximum(1, np.floor(w / w.sum() * total)).astype(int)
    lens[lens % 64 == 0] += 1
    lens[int(np.argmax(lens))] += total - lens.sum()
    if lens.max() % 64 == 0:
        lens[int(np.argmax(lens))] -= 1
        lens[int(np.argmin(lens))] += 1
    return [int(x) for x in lens]


def main() -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import median_ms
    from pallas_kernels.kda import chunk_kda
    from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda
    from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda_fused
    from pallas_kernels.kda.reference import chunked_kda
    from pallas_kernels.kda.varlen_layout import chunk_layout, from_aligned, to_aligned

    t_start = time.time()
    res: dict = {"env": {"jax": jax.__version__, "device": str(jax.devices()[0])},
                 "numerics": {}, "timing": {}}

    def save() -> None:
        with open(os.path.join(OUT, "kda_varlen.json"), "w") as f:
            json.dump(res, f, indent=1)

    def out_of_time(where: dict, name: str, budget: float = BUDGET_S) -> bool:
        if time.time() - t_start > budget:
            where[name] = "skipped: time budget"
            save()
            return True
        return False

    def f32(a):
        return a.astype(jnp.float32)

    def l2(a):  # fla's q/k L2 norm, fp32
        return f32(a) * jax.lax.rsqrt(jnp.sum(f32(a) ** 2, -1, keepdims=True) + 1e-6)

    def rel(a, b) -> float:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    def inputs(T: int, N: int, H: int, seed: int) -> dict:
        r = np.random.default_rng(seed)
        f = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731
        q, k = f(1, T, H, D), f(1, T, H, D)
        return dict(
            q=q / np.linalg.norm(q, axis=-1, keepdims=True),
            k=k / np.linalg.norm(k, axis=-1, keepdims=True), v=f(1, T, H, D),
            g=(LB / (1.0 + np.exp(-2.0 * f(1, T, H, D)))).astype(np.float32),
            beta=(1.0 / (1.0 + np.exp(-f(1, T, H)))).astype(np.float32), s0=0.1 * f(N, H, D, D),
        )

    # ---- 1. numerics ---------------------------------------------------------------------
    for mix in MIXES:
        for dtype in ("float32", "bfloat16"):
            name = f"{dtype}_lens{'-'.join(map(str, mix[:6]))}"
            if out_of_time(res["numerics"], name, NUMERICS_BUDGET_S):
                continue
            try:
                cu = np.concatenate([[0], np.cumsum(mix)])
                x = inputs(int(cu[-1]), len(mix), H_CHECK, seed=len(res["numerics"]))
                dt = jnp.dtype(dtype)
                q, k, v = (jnp.asarray(x[n]).astype(dt) for n in ("q", "k", "v"))
                g, beta, s0 = (jnp.asarray(x[n]) for n in ("g", "beta", "s0"))
                ref_o, ref_s = chunked_kda(f32(q), f32(k), f32(v), g, beta, scale=D**-0.5,
                                           initial_state=s0, cu_seqlens=cu)
                t = time.time()
                o, s = gpu_chunk_kda(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
                o.block_until_ready()
                r = {"first_call_s": round(time.time() - t, 1), "o_vs_ref": rel(o, ref_o),
                     "state_vs_ref": rel(s, ref_s), "nan": bool(jnp.isnan(f32(o)).any())}
                dev_o = dev_s = 0.0  # fp32 only: one compile per distinct chunk count
                for i in range(len(mix) if dtype == "float32" else 0):
                    a, b = int(cu[i]), int(cu[i + 1])
                    if a == b:
                        continue
                    o_i, s_i = gpu_chunk_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b],
                                                beta[:, a:b], initial_state=s0[i:i + 1])
                    dev_o = max(dev_o, float(jnp.abs(f32(o[:, a:b]) - f32(o_i)).max()))
                    dev_s = max(dev_s, float(jnp.abs(s[i] - s_i[0]).max()))
                if dtype == "float32":
                    r["max_abs_vs_separate_runs_o"] = dev_o
                    r["max_abs_vs_separate_runs_state"] = dev_s
                tol = 1e-4 if dtype == "float32" else 2e-2
                r["ok"] = bool(r["o_vs_ref"] <= tol and r["state_vs_ref"] <= tol and not r["nan"]
                               and dev_s <= 1e-4)
                res["numerics"][name] = r
            except Exception:
                res["numerics"][name] = {"error": traceback.format_exc()[-3000:]}
            print(name, res["numerics"][name], flush=True)
            save()

    if not out_of_time(res["numerics"], "fused_gate_and_auto", NUMERICS_BUDGET_S):
        try:  # K3's production call (in-kernel activations) and the "auto" dispatch, varlen
            mix = MIXES[1]
            cu = np.concatenate([[0], np.cumsum(mix)])
            T, N = int(cu[-1]), len(mix)
            x = inputs(T, N, H_CHECK, seed=99)
            r_ = np.random.default_rng(1)
            q, k, v, g_raw = (jnp.asarray(r_.standard_normal((1, T, H_CHECK, D)), jnp.bfloat16)
                              for _ in range(4))
            b_logit = jnp.asarray(r_.standard_normal((1, T, H_CHECK)), jnp.bfloat16)
            A_log = jnp.asarray(r_.uniform(-1, 1, H_CHECK), jnp.float32)
            dt_bias = jnp.asarray(0.5 * r_.standard_normal(H_CHECK * D), jnp.float32)
            s0 = jnp.asarray(x["s0"])
            o, s = gpu_chunk_kda_fused(q, k, v, g_raw, b_logit, A_log, dt_bias,
                                       lower_bound=LB, initial_state=s0, cu_seqlens=cu)
            gate_in = f32(g_raw) + dt_bias.reshape(H_CHECK, D)
            ga = LB * jax.nn.sigmoid(jnp.exp(A_log)[:, None] * gate_in)
            ba = jax.nn.sigmoid(f32(b_logit))
            ref_o, ref_s = chunked_kda(l2(q), l2(k), f32(v), ga, ba, scale=D**-0.5,
                                       initial_state=s0, cu_seqlens=cu)
            r = {"fused_bf16_o_vs_ref": rel(o, ref_o), "fused_bf16_state_vs_ref": rel(s, ref_s)}
            qa, ka = l2(q).astype(jnp.bfloat16), l2(k).astype(jnp.bfloat16)
            auto_o, auto_s = chunk_kda(qa, ka, v, ga, ba, initial_state=s0, cu_seqlens=cu,
                                       output_final_state=True, lower_bound=LB)
            pal_o, pal_s = gpu_chunk_kda(qa, ka, v, ga, ba, initial_state=s0, cu_seqlens=cu)
            r["auto_equals_pallas"] = bool(jnp.array_equal(auto_o, pal_o)
                                           and jnp.array_equal(auto_s, pal_s))
            r["ok"] = bool(r["fused_bf16_o_vs_ref"] <= 2e-2 and r["auto_equals_pallas"])
            res["numerics"]["fused_gate_and_auto"] = r
        except Exception:
            res["numerics"]["fused_gate_and_auto"] = {"error": traceback.format_exc()[-3000:]}
        print("fused_gate_and_auto", res["numerics"]["fused_gate_and_auto"], flush=True)
        save()

    # ---- 2. timing ------------------------------------------------------------------------
    def bench(f, args, n_rep=5, n_inner=10) -> float:
        return round(median_ms(f, *args, reps=n_rep, inner=n_inner), 4)

    lens = mixed_lengths(N_SEQ, TOTAL)
    cu = np.concatenate([[0], np.cumsum(lens)])
    t_max = max(lens)
    layout = chunk_layout(cu, 64)
    tim = res["timing"]
    tim["lengths"] = lens
    tim["tokens_packed"] = TOTAL
    tim["tokens_chunk_aligned"] = int(layout.src.size)
    tim["tokens_padded_batch"] = N_SEQ * t_max
    save()
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    bf = jnp.bfloat16

    def make(B, T):
        mk = lambda kk, *s: jax.random.normal(kk, s, bf)  # noqa: E731
        q, k = (mk(keys[i], B, T, H_TIME, D) for i in range(2))
        g = LB * jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, H_TIME, D), jnp.float32))
        beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H_TIME), jnp.float32))
        return l2(q).astype(bf), l2(k).astype(bf), mk(keys[2], B, T, H_TIME, D), g, beta

    cases = {
        "packed_varlen": (1, TOTAL, lambda *a: gpu_chunk_kda(*a, cu_seqlens=cu)),
        "padded_batch": (N_SEQ, t_max, lambda *a: gpu_chunk_kda(*a)),
        "uniform_batch": (N_SEQ, TOTAL // N_SEQ, lambda *a: gpu_chunk_kda(*a)),
    }
    for name, (B, T, fn) in cases.items():
        if out_of_time(tim, name):
            continue
        try:
            args = make(B, T)
            t = time.time()
            ms = bench(jax.jit(fn), args)
            tim[name] = {"shape": [B, T, H_TIME, D], "ms": ms,
                         "first_and_bench_s": round(time.time() - t, 1)}
            del args
        except Exception:
            tim[name] = {"error": traceback.format_exc()[-3000:]}
        print(name, tim[name], flush=True)
        save()

    if not out_of_time(tim, "layout_gathers_only"):
        try:  # the varlen wrapper's own cost: 5 input gathers + 1 output gather
            def gathers(q, k, v, g, beta):
                moved = [to_aligned(a, layout) for a in (q, k, v, g, beta)]
                return from_aligned(moved[2], layout)

            tim["layout_gathers_only"] = {"ms": bench(jax.jit(gathers), make(1, TOTAL))}
        except Exception:
            tim["layout_gathers_only"] = {"error": traceback.format_exc()[-3000:]}
        print("layout_gathers_only", tim["layout_gathers_only"], flush=True)
    res["wall_s"] = round(time.time() - t_start, 1)
    save()


if __name__ == "__main__":
    main()

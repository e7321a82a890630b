"""H200 side-by-side: Pallas safe-gate chunk KDA vs fla-core ``chunk_kda`` vs the XLA reference.

Run on the GPU machine (see benchmarks/RESULTS.md for the recorded numbers):

    python3 -m pip install -q --no-deps --target /tmp/site fla_core-0.6.0-py3-none-any.whl
    PYTHONPATH=/tmp/site:. python3 benchmarks/kda_pallas_h200.py torch   # fla: numerics + timing
    # (fla autotunes on its first big-shape calls, 180-264 s; its results for these shapes come
    #  from the repository by default, see FLA_AUTOTUNE below)
    PYTHONPATH=. python3 benchmarks/kda_pallas_h200.py jax                 # ours + XLA reference
    PYTHONPATH=. python3 benchmarks/kda_pallas_h200.py stages              # the intra kernels alone

Both halves use K3's production call: raw q/k (L2 norm in kernel), raw gate with A_log [H] and
dt_bias [H*K] (``g = -5 * sigmoid(exp(A_log) (g_raw + dt_bias))``), beta logits (sigmoid in
kernel), bf16 q/k/v/g/beta, fp32 state. So every timed path does the same work: fla's fused
gate/beta/l2norm, our fused intra stage, and the XLA reference with its activations in the jit.
The torch half writes a small case's inputs and fla outputs to /tmp so the jax half can compare
ours, fla and the fp32 reference on identical data. Results go to $OUT/*.json.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import numpy as np

from benchmarks.torch_peer import TUNED_ARCHIVE

OUT = os.environ.get("OUT", ".")
# (B, T, H), D = 128: the two targets' shapes, then K3's batch-1 prefill (96 sequence-heads,
# between the other two and above `default_inter`'s threshold)
SHAPES = [(4, 8192, 96), (1, 32768, 16), (1, 8192, 96)]
if os.environ.get("KDA_SHAPES"):  # "B,T,H;..." replaces the list for one run
    SHAPES = [tuple(int(x) for x in item.split(",")) for item in os.environ["KDA_SHAPES"].split(";")]
CHECK = (1, 2048, 8)  # numerics case shared by both halves
LB = -5.0
D = 128
CMP = "/tmp/kda_cmp.npz"
# (block_v, num_warps, num_stages, inter stage `gpu_config.INTER_STAGES`) of
# `gpu_config.GpuChunkConfig`; warps are the Triton inter kernels' (the pair and W/U kernels keep
# `gpu_config.INTRA_WARPS`), stages apply to every Triton kernel. `default_inter`'s Triton choices
# for many / few sequence-heads first, then their nearest neighbours, then the segmented stage.
# Every shape also times the call with all defaults ("ours_default_ms").
# KDA_CONFIGS="bv,warps,stages[,inter];..." replaces the list for one run.
CONFIGS = [(64, 4, 2, "fused"), (16, 4, 2, "two_pass"), (128, 8, 2, "fused"),
           (64, 8, 2, "fused"), (16, 4, 1, "two_pass"), (32, 4, 2, "two_pass"),
           (64, 4, 1, "segments")]
if os.environ.get("KDA_CONFIGS"):
    CONFIGS = [(*map(int, f[:3]), f[3] if len(f) > 3 else "fused")
               for f in (item.split(",") for item in os.environ["KDA_CONFIGS"].split(";"))]
# the segmented inter stage's numerics: a gentle gate (dt_bias -6: g about -0.01 per step), so
# the state crosses many chunks and a wrong segment start state shows
SEGMENTS_CHECK = (1, 16384, 16)
# the intra stage's pair kernels timed in each config (`gpu_config.STAGE_KERNELS`);
# KDA_PAIRS="triton" for one
PAIRS = os.environ.get("KDA_PAIRS", "triton,mosaic_gpu").split(",")
# the fused inter stage's kernel ("mosaic_gpu" is skipped for the two-pass stage);
# KDA_INTER_KERNELS="mosaic_gpu" for one
INTER_KERNELS = os.environ.get("KDA_INTER_KERNELS", "triton,mosaic_gpu").split(",")
# fla's autotune results: a folder or .tar.gz (torch_peer.keep_autotuning), by default the
# repository's (torch_peer.TUNED_ARCHIVE; FLA_AUTOTUNE= for none); those in use come back as
# $OUT/fla_autotune.tar.gz.
FLA_AUTOTUNE = os.environ.get("FLA_AUTOTUNE", str(TUNED_ARCHIVE))
# KDA_SKIP_XLA=1 skips the slow unfused / XLA-reference columns (already recorded).
SKIP_XLA = os.environ.get("KDA_SKIP_XLA") == "1"


def kda_flops(B, T, H, C=64):
    return B * T * H * (2 * C * (3 * D + 2 * D) + 6 * D * D)


def np_inputs(B, T, H, seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: r.standard_normal(s, dtype=np.float32)
    return dict(
        q=f(B, T, H, D), k=f(B, T, H, D), v=f(B, T, H, D), g=f(B, T, H, D), beta=f(B, T, H),
        A_log=(r.random(H, dtype=np.float32) * 2 - 1), dt_bias=np.zeros(H * D, np.float32),
        h0=0.1 * f(B, H, D, D),
    )


def timing_inputs(B, T, H):
    """The jax halves' timed call's arguments: raw bf16 q, k, v, gate and beta logits, A_log [H]
    and dt_bias [H * D] (K3's production call)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.split(jax.random.PRNGKey(0), 6)
    mk = lambda kk, *s: jax.random.normal(kk, s, jnp.bfloat16)  # noqa: E731
    q, k, v, g = (mk(key[i], B, T, H, D) for i in range(4))
    beta = mk(key[4], B, T, H)
    A_log = jax.random.uniform(key[5], (H,), jnp.float32, -1, 1)
    dt_bias = jnp.zeros((H * D,), jnp.float32)
    return q, k, v, g, beta, A_log, dt_bias


def run_torch():
    from benchmarks.torch_peer import export_autotuning, keep_autotuning

    tuning = keep_autotuning(FLA_AUTOTUNE)
    import torch
    import triton
    from fla.ops.kda import chunk_kda

    res = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}}
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB)
    x = np_inputs(*CHECK)
    t = {n: torch.tensor(a, device="cuda") for n, a in x.items()}
    bf = {n: t[n].bfloat16() for n in ("q", "k", "v", "g", "beta")}
    with torch.inference_mode():
        o, ht = chunk_kda(bf["q"], bf["k"], bf["v"], bf["g"], bf["beta"], A_log=t["A_log"],
                          dt_bias=t["dt_bias"], initial_state=t["h0"], output_final_state=True,
                          **kw)
    np.savez(CMP, **x, fla_o=o.float().cpu().numpy(), fla_ht=ht.float().cpu().numpy())
    json.dump(res, open(os.path.join(OUT, "torch_kda.json"), "w"), indent=1)
    export_autotuning(tuning, os.path.join(OUT, "fla_autotune.tar.gz"))
    for B, T, H in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, v, gate, beta = mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, D), \
            mk(B, T, H)
        A_log = torch.rand(H, device="cuda", generator=g) * 2 - 1
        dt_bias = torch.zeros(H * D, device="cuda")
        with torch.inference_mode():
            fn = lambda: chunk_kda(q, k, v, gate, beta, A_log=A_log, dt_bias=dt_bias,
                                   output_final_state=True, **kw)
            fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
        res[f"fla_B{B}_T{T}_H{H}"] = {"ms_med_p20_p80": [round(m, 4) for m in ms],
                                      "model_TFLOPS": round(kda_flops(B, T, H) / ms[0] / 1e9, 1)}
        print(res[f"fla_B{B}_T{T}_H{H}"], flush=True)
        json.dump(res, open(os.path.join(OUT, "torch_kda.json"), "w"), indent=1)
        export_autotuning(tuning, os.path.join(OUT, "fla_autotune.tar.gz"))
        del q, k, v, gate, beta
        torch.cuda.empty_cache()


def run_jax():
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import median_ms
    from pallas_kernels.kda.gpu_config import chunk_config, segments_for
    from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda, gpu_chunk_kda_fused
    from pallas_kernels.kda.reference import chunked_kda

    res = {"env": {"jax": jax.__version__, "device": str(jax.devices()[0])}}

    def save():
        json.dump(res, open(os.path.join(OUT, "jax_kda.json"), "w"), indent=1)

    def activate(q, k, g, beta, A_log, dt_bias):
        H = q.shape[2]
        l2 = lambda x: (x.astype(jnp.float32) * jax.lax.rsqrt(
            jnp.sum(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6))
        a = jnp.exp(A_log[:H].astype(jnp.float32))[:, None]
        gg = LB * jax.nn.sigmoid(a * (g.astype(jnp.float32) + dt_bias.reshape(H, D)))
        return l2(q), l2(k), gg, jax.nn.sigmoid(beta.astype(jnp.float32))

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    def segments_numerics():
        """The segmented inter stage (the default at these few sequence-heads) against the
        fused Mosaic GPU one and the fp32 reference, and the segment count it took."""
        B, T, H = SEGMENTS_CHECK
        q, k, v, g, beta, A_log, _ = timing_inputs(B, T, H)
        dt_bias = jnp.full((H * D,), -6.0, jnp.float32)
        h0 = 0.1 * jax.random.normal(jax.random.PRNGKey(1), (B, H, D, D), jnp.float32)
        qa, ka, ga, ba = activate(q, k, g, beta, A_log, dt_bias)
        ref_o, ref_h = chunked_kda(qa, ka, v.astype(jnp.float32), ga, ba, scale=D**-0.5,
                                   initial_state=h0)
        run = lambda inter: gpu_chunk_kda_fused(  # noqa: E731
            q, k, v, g, beta, A_log, dt_bias, lower_bound=LB, initial_state=h0,
            config=chunk_config(q, k, v, g, inter=inter))
        (os_, hs), (of, hf) = run("segments"), run("fused")
        return {"shape": [B, T, H], "segments": segments_for(B * H, -(-T // 64)),
                "segments_vs_ref_o": rel(os_, ref_o), "segments_vs_ref_ht": rel(hs, ref_h),
                "fused_vs_ref_o": rel(of, ref_o), "fused_vs_ref_ht": rel(hf, ref_h),
                "segments_vs_fused_o": rel(os_, of), "segments_vs_fused_ht": rel(hs, hf)}

    # ---- numerics on the shared case (fla inputs) --------------------------------------
    try:
        x = dict(np.load(CMP)) if os.path.exists(CMP) else np_inputs(*CHECK)
        j = {n: jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")}
        bf = {n: j[n].astype(jnp.bfloat16) for n in ("q", "k", "v", "g", "beta")}
        qa, ka, ga, ba = activate(bf["q"], bf["k"], bf["g"], bf["beta"], j["A_log"], j["dt_bias"])
        ref_o, ref_h = chunked_kda(qa, ka, bf["v"].astype(jnp.float32), ga, ba, scale=D**-0.5,
                                   initial_state=j["h0"])
        t = time.time()
        raw = (bf["q"], bf["k"], bf["v"], bf["g"], bf["beta"], j["A_log"], j["dt_bias"])
        o, h = gpu_chunk_kda_fused(*raw, lower_bound=LB, initial_state=j["h0"])
        o.block_until_ready()
        num = {"first_call_s": round(time.time() - t, 1),
               "ours_bf16_vs_ref_o": rel(o, ref_o), "ours_bf16_vs_ref_ht": rel(h, ref_h)}
        for pairs in PAIRS:
            op, hp = gpu_chunk_kda_fused(*raw, lower_bound=LB, initial_state=j["h0"],
                                         config=chunk_config(*raw[:4], pairs=pairs))
            num[f"ours_bf16_{pairs}_pairs_vs_ref_o"] = rel(op, ref_o)
            num[f"ours_bf16_{pairs}_pairs_vs_ref_ht"] = rel(hp, ref_h)
        if "mosaic_gpu" in INTER_KERNELS:
            (om, hm), (ot, ht_) = (
                gpu_chunk_kda_fused(*raw, lower_bound=LB, initial_state=j["h0"],
                                    config=chunk_config(*raw[:4], inter="fused", inter_kernel=ik))
                for ik in ("mosaic_gpu", "triton"))
            num["ours_bf16_mosaic_gpu_inter_vs_ref_o"] = rel(om, ref_o)
            num["ours_bf16_mosaic_gpu_inter_vs_ref_ht"] = rel(hm, ref_h)
            num["mosaic_gpu_inter_vs_triton_inter_o"] = rel(om, ot)
            num["mosaic_gpu_inter_vs_triton_inter_ht"] = rel(hm, ht_)
        o32, h32 = gpu_chunk_kda(qa, ka, bf["v"].astype(jnp.float32), ga, ba,
                                 initial_state=j["h0"])
        num["ours_fp32_vs_ref_o"] = rel(o32, ref_o)
        num["ours_fp32_vs_ref_ht"] = rel(h32, ref_h)
        num["ours_fp32_nan"] = bool(jnp.isnan(o32).any())
        if "fla_o" in x:
            num["fla_vs_ref_o"] = rel(x["fla_o"], ref_o)
            num["fla_vs_ref_ht"] = rel(x["fla_ht"], ref_h)
            num["ours_bf16_vs_fla_o"] = rel(o.astype(jnp.float32), x["fla_o"])
        res["numerics_B1_T2048_H8"] = num
        res["numerics_segments"] = segments_numerics()
    except Exception:  # keep going to timing
        import traceback
        res["numerics_error"] = traceback.format_exc()[-3000:]
    print(json.dumps(res, indent=1), flush=True)
    save()

    def bench(f, args, n_rep=5, n_inner=10):
        return median_ms(f, *args, reps=n_rep, inner=n_inner)

    for B, T, H in SHAPES:
        args = timing_inputs(B, T, H)
        name = f"B{B}_T{T}_H{H}"
        default = jax.jit(lambda *a: gpu_chunk_kda_fused(*a, lower_bound=LB))
        r = {"ours_default_ms": round(bench(default, args), 4)}
        for (bv, nw, ns, inter), pairs, ik in itertools.product(CONFIGS, PAIRS, INTER_KERNELS):
            mosaic_fits = inter in ("fused", "segments")
            if (ik == "mosaic_gpu" and not mosaic_fits) or (ik == "triton" and inter == "segments"):
                continue  # the Mosaic GPU inter kernels where they fit; segments only on them
            tag = (f"ours_fused_bv{bv}_w{nw}_s{ns}" + ("" if inter == "fused" else f"_{inter}")
                   + f"_{pairs}_pairs" + ("_mosaic_gpu_inter" if ik == "mosaic_gpu" else ""))
            try:
                config = chunk_config(*args[:4], block_v=bv, num_warps=nw, num_stages=ns,
                                      inter=inter, pairs=pairs, inter_kernel=ik)
                f = jax.jit(lambda *a, config=config: gpu_chunk_kda_fused(
                    *a, lower_bound=LB, config=config))
                ms = bench(f, args)
                r[f"{tag}_ms"] = round(ms, 4)
            except Exception as e:
                r[f"{tag}_error"] = repr(e)[-800:]
            print(name, r, flush=True)
            save()
        if SKIP_XLA:
            res[name] = r
            save()
            continue
        try:  # pre-activated kernel + the activations as XLA ops (unfused)
            def unfused(q, k, v, g, b, a, d):
                qa, ka, ga, ba = activate(q, k, g, b, a, d)
                return gpu_chunk_kda(qa.astype(q.dtype), ka.astype(q.dtype), v, ga, ba)
            ms = bench(jax.jit(unfused), args)
            r["ours_unfused_xla_activations_ms"] = round(ms, 4)
        except Exception as e:
            r["ours_unfused_error"] = repr(e)[-800:]
        try:
            def xla_ref(q, k, v, g, b, a, d):
                qa, ka, ga, ba = activate(q, k, g, b, a, d)
                return chunked_kda(qa, ka, v, ga, ba, scale=D**-0.5, initial_state=None)
            ms = bench(jax.jit(xla_ref), args, n_rep=3, n_inner=2)
            r["xla_reference_ms"] = round(ms, 2)
        except Exception as e:
            r["xla_reference_error"] = repr(e)[-800:]
        best = min((v_ for k_, v_ in r.items() if k_.startswith("ours_fused") and
                    k_.endswith("_ms")), default=None)
        if best:
            r["ours_best_model_TFLOPS"] = round(kda_flops(B, T, H) / best / 1e9, 1)
        res[name] = r
        print(name, r, flush=True)
        save()
        del args


def run_stages():
    """Each kernel of the intra stage timed alone (fused activations, bf16), and the whole call,
    so the inter kernel's share is the difference."""
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import median_ms
    from pallas_kernels.kda.gpu_pipeline import gate_params, gpu_chunk_kda_fused
    from pallas_kernels.kda.mosaic_gpu.pairs import intra_pairs_mgpu
    from pallas_kernels.kda.triton.intra import chunk_inverses, intra_pairs, intra_wu
    from pallas_kernels.kda.triton.intra_blocks import compiler_params

    res = {"env": {"jax": jax.__version__, "device": str(jax.devices()[0])}}
    for B, T, H in SHAPES:
        q, k, v, g, beta, A_log, dt_bias = timing_inputs(B, T, H)
        ins = (q, k, v, g, beta, *gate_params(A_log, dt_bias, H, D))
        r = {}
        for warps in (4, 8):
            pairs = jax.jit(lambda *a, w=warps: intra_pairs(
                a, scale=D**-0.5, fused=True, lower_bound=LB, interpret=False,
                params=compiler_params(False, w, 1)))
            r[f"pairs_w{warps}_ms"] = round(median_ms(pairs, *ins, reps=5, inner=10), 4)
        L, bk, qg, kd, aqk, gl = outs = pairs(*ins)
        mgpu = jax.jit(lambda *a: intra_pairs_mgpu(a, scale=D**-0.5, fused=True, lower_bound=LB,
                                                   interpret=False))
        r["pairs_mosaic_gpu_ms"] = round(median_ms(mgpu, *ins, reps=5, inner=10), 4)
        for name, a, b in zip(("L", "bk", "qg", "kd", "aqk", "gl"), mgpu(*ins), outs):
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
            r[f"pairs_mosaic_gpu_vs_triton_{name}"] = float(
                jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))
        for warps, products in ((2, jnp.float32), (1, None), (2, None), (4, None)):
            inv = jax.jit(lambda L, w=warps, p=products: chunk_inverses(
                L, jnp.bfloat16, interpret=False, params=compiler_params(False, w, 1),
                mm_dtype=p))
            tag = "_ieee" if products == jnp.float32 else ""
            r[f"inverse_w{warps}{tag}_ms"] = round(median_ms(inv, L, reps=5, inner=10), 4)
        x = inv(L)
        for warps in (4, 8):
            wu = jax.jit(lambda x, bk, v, b, w=warps: intra_wu(
                x, bk, v, b, fused=True, interpret=False, params=compiler_params(False, w, 1)))
            r[f"wu_w{warps}_ms"] = round(median_ms(wu, x, bk, v, beta, reps=5, inner=10), 4)
        f = jax.jit(lambda *a: gpu_chunk_kda_fused(*a, lower_bound=LB))
        r["whole_ms"] = round(
            median_ms(f, q, k, v, g, beta, A_log, dt_bias, reps=5, inner=10), 4)
        res[f"B{B}_T{T}_H{H}"] = r
        print(B, T, H, r, flush=True)
        json.dump(res, open(os.path.join(OUT, "jax_kda_stages.json"), "w"), indent=1)
        del q, k, v, g, beta, L, bk, qg, kd, aqk, gl, x


if __name__ == "__main__":
    {"torch": run_torch, "jax": run_jax, "stages": run_stages}[sys.argv[1]]()

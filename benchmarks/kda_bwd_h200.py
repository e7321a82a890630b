"""H200: the analytic GPU KDA backward vs fla-core ``chunk_kda``; numerics vs the reference VJP.

Run on the GPU machine, torch half first (it writes the shared numerics case to /tmp):

    python3 -m pip install -q --no-deps --target /tmp/site fla_core-0.6.0-py3-none-any.whl
    PYTHONPATH=/tmp/site:. timeout 400 python3 benchmarks/kda_bwd_h200.py torch
    PYTHONPATH=. timeout 280 python3 benchmarks/kda_bwd_h200.py jax

(fla autotunes every kernel on its first call per head count: the torch half's first call took
264 s on an H200. By default its results for these shapes come from the repository
(``torch_peer.TUNED_ARCHIVE``, fla-core 0.6.0 and triton 3.6 on an H200), so fla compiles only
its chosen configs; FLA_AUTOTUNE=path names another folder or archive, FLA_AUTOTUNE= none. The
results in use come back as $OUT/fla_autotune.tar.gz. Without them, give the search a whole job:
the timings are skipped once KDA_BWD_FLA_BUDGET_S, default 200, have passed.)

Both halves use the pre-activated call (the layer computes l2norm, gate and beta outside): unit
q/k, ``g = -5 * sigmoid(x)`` log-decay, ``beta = sigmoid(x)``, all bf16, fp32 state, the
safe gate (fla: ``safe_gate=True, lower_bound=-5``; ours: ``chunk_kda(implementation=
"pallas_gpu", lower_bound=-5)``). fwd+bwd = forward with the final state, then the VJP with cotangents for
o and the final state. Numerics come before timing; every case is in try/except and the JSON in
$OUT is rewritten after each, so a timeout still leaves results.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

from benchmarks.torch_peer import TUNED_ARCHIVE

OUT = os.environ.get("OUT", ".")
SHAPES = [(4, 8192, 96), (1, 32768, 16)]  # (B, T, H), D = 128
# Numerics case shared by both halves; H = 96 like the big shape, so that fla's Triton autotuning
# (keyed on H, K, V) done on it carries over to the timed call.
CHECK = (1, 512, 96)
LB = -5.0
D = 128
CMP = "/tmp/kda_bwd_cmp.npz"
NAMES = ("q", "k", "v", "g", "beta", "h0")
T0 = time.time()
# seconds into the torch half after which fla timings are skipped; fla's first fwd+bwd at H96 (the
# numerics case, autotuning every kernel) took 264 s on an H200, so give it a whole job's slot
FLA_BUDGET_S = float(os.environ.get("KDA_BWD_FLA_BUDGET_S", "200"))
# fla's autotune results: a folder or .tar.gz (torch_peer.keep_autotuning), the repository's by default
FLA_AUTOTUNE = os.environ.get("FLA_AUTOTUNE", str(TUNED_ARCHIVE))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _round_bf16(a):
    """fp32 -> nearest bf16 value (round half to even), still as fp32."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def np_case(B, T, H, seed=0):
    """Pre-activated inputs, rounded to bf16 precision so both halves see identical values."""
    r = np.random.default_rng(seed)
    f = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k = f(B, T, H, D), f(B, T, H, D)
    x = dict(
        q=q / np.linalg.norm(q, axis=-1, keepdims=True),
        k=k / np.linalg.norm(k, axis=-1, keepdims=True),
        v=f(B, T, H, D), g=LB * _sigmoid(2 * f(B, T, H, D)), beta=_sigmoid(f(B, T, H)),
        do=f(B, T, H, D),
    )
    x = {n: _round_bf16(a) for n, a in x.items()}
    x["h0"] = 0.1 * f(B, H, D, D)
    x["dht"] = f(B, H, D, D)
    return x


def save(res, name):
    res["elapsed_s"] = round(time.time() - T0, 1)
    json.dump(res, open(os.path.join(OUT, name), "w"), indent=1)
    print(json.dumps(res, indent=1)[-3000:], flush=True)


def run_torch():
    from benchmarks.torch_peer import export_autotuning, keep_autotuning

    tuning = keep_autotuning(FLA_AUTOTUNE)
    import torch
    from fla.ops.kda import chunk_kda

    res = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}}
    out = "torch_kda_bwd.json"
    kw = dict(safe_gate=True, lower_bound=LB, output_final_state=True)
    try:
        x = np_case(*CHECK)
        t = {n: torch.tensor(a, device="cuda") for n, a in x.items()}
        leaves = {n: (t[n] if n == "h0" else t[n].bfloat16()).requires_grad_() for n in NAMES}
        o, ht = chunk_kda(*(leaves[n] for n in NAMES[:5]), initial_state=leaves["h0"], **kw)
        torch.autograd.backward([o, ht], [t["do"].bfloat16(), t["dht"]])
        fla = {f"fla_d{n}": leaves[n].grad.float().cpu().numpy() for n in NAMES}
        np.savez(CMP, **x, **fla, fla_o=o.float().detach().cpu().numpy())
        res["numerics_saved"] = CMP
    except Exception:
        res["numerics_error"] = traceback.format_exc()[-3000:]
    save(res, out)
    export_autotuning(tuning, os.path.join(OUT, "fla_autotune.tar.gz"))

    for B, T, H in SHAPES:
        name = f"fla_B{B}_T{T}_H{H}"
        if time.time() - T0 > FLA_BUDGET_S:
            res[name] = "skipped: time budget"
            save(res, out)
            break
        try:
            res[name] = _fla_timing(chunk_kda, B, T, H, kw)
        except Exception:
            res[name] = {"error": traceback.format_exc()[-2000:]}
        torch.cuda.empty_cache()
        save(res, out)
        export_autotuning(tuning, os.path.join(OUT, "fla_autotune.tar.gz"))


def _fla_timing(chunk_kda, B, T, H, kw):
    import torch
    import triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q = torch.nn.functional.normalize(mk(B, T, H, D), dim=-1).bfloat16().requires_grad_()
    k = torch.nn.functional.normalize(mk(B, T, H, D), dim=-1).bfloat16().requires_grad_()
    v = mk(B, T, H, D).bfloat16().requires_grad_()
    g = (LB * torch.sigmoid(2 * mk(B, T, H, D))).bfloat16().requires_grad_()
    beta = torch.sigmoid(mk(B, T, H)).bfloat16().requires_grad_()
    do, dht = mk(B, T, H, D).bfloat16(), mk(B, H, D, D)

    def fwd():
        return chunk_kda(q, k, v, g, beta, **kw)

    def fwd_bwd():
        o, ht = fwd()
        torch.autograd.backward([o, ht], [do, dht])

    t = time.time()
    fwd_bwd()  # Triton autotuning of every kernel happens here
    torch.cuda.synchronize()
    r = {"first_fwd_bwd_s": round(time.time() - t, 1)}
    ms = triton.testing.do_bench(fwd_bwd, warmup=10, rep=100, grad_to_none=[q, k, v, g, beta],
                                 quantiles=[0.5, 0.2, 0.8])
    r["fwd_bwd_ms_med_p20_p80"] = [round(m, 3) for m in ms]
    with torch.no_grad():
        ms = triton.testing.do_bench(fwd, warmup=10, rep=100, quantiles=[0.5, 0.2, 0.8])
    r["fwd_ms_med_p20_p80"] = [round(m, 3) for m in ms]
    return r


def run_jax():
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import median_ms
    from pallas_kernels.kda import chunk_kda
    from pallas_kernels.kda import gpu_backward as pb
    from pallas_kernels.kda.gpu_backward import gpu_chunk_kda_bwd
    from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda
    from pallas_kernels.kda.reference import chunked_kda
    from pallas_kernels.kda.triton import backward as tb
    from tests.pallas_kernels.kda.chunk_backward import chunk_kda_bwd

    res = {"env": {"jax": jax.__version__, "device": str(jax.devices()[0])}}
    out = "jax_kda_bwd.json"
    scale = D**-0.5

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    def api_vjp(impl):
        def f(q, k, v, g, beta, h0, do, dht):
            fn = lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True,  # noqa: E731
                                      implementation=impl, lower_bound=LB)
            (o, s), vjp = jax.vjp(fn, q, k, v, g, beta, h0)
            return o, s, vjp((do, dht))
        return jax.jit(f)

    # ---- numerics: ours (fp32 and bf16) and fla vs autodiff of the fp32 reference -----------
    # `... jax stages`: only the per-stage timing; `... jax essentials`: only the whole-call timing
    stages_only = sys.argv[2:] == ["stages"]
    essentials_only = sys.argv[2:] == ["essentials"]
    if not (stages_only or essentials_only):
        try:
            x = dict(np.load(CMP)) if os.path.exists(CMP) else np_case(*CHECK)
            j32 = {n: jnp.asarray(x[n]) for n in NAMES + ("do", "dht")}
            args32 = tuple(j32[n] for n in NAMES + ("do", "dht"))
            ref = jax.jit(lambda q, k, v, g, b, h0, do, dht: jax.vjp(
                lambda *a: chunked_kda(*a[:5], scale=scale, initial_state=a[5]),
                q, k, v, g, b, h0)[1]((do, dht)))(*args32)
            num = {}
            t = time.time()
            got32 = gpu_chunk_kda_bwd(*args32, scale=scale)
            jax.block_until_ready(got32)
            num["first_call_fp32_bwd_s"] = round(time.time() - t, 1)
            num["ours_fp32_vs_ref"] = {n: rel(a, b) for n, a, b in zip(NAMES, got32, ref)}
            xla32 = chunk_kda_bwd(*args32, scale=scale)
            num["pure_jax_fp32_vs_ref"] = {n: rel(a, b) for n, a, b in zip(NAMES, xla32, ref)}
            bf = tuple(a if n in ("h0", "dht") else a.astype(jnp.bfloat16)
                       for n, a in zip(NAMES + ("do", "dht"), args32))
            t = time.time()
            _, _, got16 = api_vjp("pallas_gpu")(*bf)
            jax.block_until_ready(got16)
            num["first_call_bf16_fwd_bwd_s"] = round(time.time() - t, 1)
            num["ours_bf16_vs_ref"] = {n: rel(a, b) for n, a, b in zip(NAMES, got16, ref)}
            num["ours_bf16_nan"] = bool(any(jnp.isnan(a.astype(jnp.float32)).any() for a in got16))
            # chunk_kda's gradient (the forward's X and Aqk kept) against the recomputing backward
            rec16 = gpu_chunk_kda_bwd(*bf, scale=scale)
            num["kept_intra_vs_recompute_bf16"] = {n: rel(a, b) for n, a, b in zip(NAMES, got16, rec16)}
            if "fla_dq" in x:
                num["fla_bf16_vs_ref"] = {n: rel(x[f"fla_d{n}"], b) for n, b in zip(NAMES, ref)}
                num["ours_bf16_vs_fla"] = {n: rel(a, x[f"fla_d{n}"]) for n, a in zip(NAMES, got16)}
            res["numerics_B{}_T{}_H{}".format(*CHECK)] = num
        except Exception:
            res["numerics_error"] = traceback.format_exc()[-3000:]
    save(res, out)

    def bench(f, args, n_rep=5, n_inner=5):
        return round(median_ms(f, *args, reps=n_rep, inner=n_inner), 3)

    def attempt(r, key, fn, budget=270):
        if time.time() - T0 > budget:
            r[key] = "skipped: time budget"
            return
        t = time.time()
        try:
            r[key] = fn()
        except Exception as e:
            r[key + "_error"] = repr(e)[-1500:]
        r[key + "_wall_s"] = round(time.time() - t, 1)

    def inputs(B, T, H):
        key = jax.random.split(jax.random.PRNGKey(0), 7)
        unit = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
        rn = lambda i, *s: jax.random.normal(key[i], s, jnp.float32)  # noqa: E731
        return (
            unit(rn(0, B, T, H, D)).astype(jnp.bfloat16),
            unit(rn(1, B, T, H, D)).astype(jnp.bfloat16),
            rn(2, B, T, H, D).astype(jnp.bfloat16),
            (LB * jax.nn.sigmoid(2 * rn(3, B, T, H, D))).astype(jnp.bfloat16),
            jax.nn.sigmoid(rn(4, B, T, H)).astype(jnp.bfloat16),
            jnp.zeros((B, H, D, D), jnp.float32),
            rn(5, B, T, H, D).astype(jnp.bfloat16),
            rn(6, B, H, D, D),
        )

    # ---- timing: ours fwd+bwd (the chunk_kda "pallas_gpu" path), fwd alone, bwd alone --------
    def essentials(B, T, H):
        args = inputs(B, T, H)
        r = res[f"B{B}_T{T}_H{H}"] = {}
        attempt(r, "ours_fwd_bwd_ms", lambda: bench(api_vjp("pallas_gpu"), args))
        save(res, out)
        attempt(r, "ours_fwd_ms", lambda: bench(jax.jit(
            lambda *a: gpu_chunk_kda(*a[:5], scale=scale, initial_state=a[5])), args[:6]))
        attempt(r, "ours_bwd_ms", lambda: bench(
            jax.jit(lambda *a: gpu_chunk_kda_bwd(*a, scale=scale)), args))
        # the backward as chunk_kda's gradient runs it: with the forward's X and Aqk
        intra = jax.jit(lambda *a: gpu_chunk_kda(
            *a[:5], scale=scale, initial_state=a[5], return_intra=True)[2])(*args[:6])
        attempt(r, "ours_bwd_kept_intra_ms", lambda: bench(
            jax.jit(lambda *a: gpu_chunk_kda_bwd(*a[:8], scale=scale, intra=a[8])),
            args + (intra,)))
        del intra
        save(res, out)

    if not stages_only:  # the defaults; configurations are compared per stage below
        essentials(*SHAPES[0])
        essentials(*SHAPES[1])
    for shape in SHAPES:
        res.setdefault("B{}_T{}_H{}".format(*shape), {})

    # ---- where the backward's time goes: per stage, a few configs ---------------------------
    tun = lambda nw, ns: dict(interpret=False, num_warps=nw, num_stages=ns)  # noqa: E731

    def stages(shape, grads_cfgs, parts_cfgs, state_cfgs):
        q, k, v, g, beta, h0, do, dht = inputs(*shape)
        r = res["B{}_T{}_H{}".format(*shape)]
        A, W, U, aqk, qg, kd, gl = pb.stage_parts(q, k, v, g, beta, scale=scale, **tun(4, 1))
        hs, vn = tb.stage_states(W, U, kd, gl, h0, block_v=32, **tun(4, 1))
        dhs, dvn, _ = tb.stage_dstates(qg, W, aqk, kd, gl, do, dht, block_v=32, **tun(4, 1))
        for nw, ns in parts_cfgs:
            attempt(r, f"stage_parts_w{nw}_s{ns}_ms", lambda nw=nw, ns=ns: bench(
                lambda *a: pb.stage_parts(*a, scale=scale, **tun(nw, ns)), (q, k, v, g, beta)))
            attempt(r, f"stage_parts_saved_w{nw}_s{ns}_ms", lambda nw=nw, ns=ns: bench(
                lambda *a: pb.stage_parts_saved(*a, scale=scale, **tun(nw, ns)),
                (A, aqk, q, k, v, g, beta)))
        for bv, nw, ns in state_cfgs:
            attempt(r, f"stage_states_bv{bv}_w{nw}_s{ns}_ms", lambda bv=bv, nw=nw, ns=ns: bench(
                lambda *a: tb.stage_states(*a, block_v=bv, **tun(nw, ns)), (W, U, kd, gl, h0)))
            attempt(r, f"stage_dstates_bv{bv}_w{nw}_s{ns}_ms", lambda bv=bv, nw=nw, ns=ns: bench(
                lambda *a: tb.stage_dstates(*a, block_v=bv, **tun(nw, ns)),
                (qg, W, aqk, kd, gl, do, dht)))
            save(res, out)

        for gbk, nw, ns in grads_cfgs:
            tag = f"stage_grads_bk{gbk}_w{nw}_s{ns}_ms"
            attempt(r, tag, lambda gbk=gbk, nw=nw, ns=ns: bench(
                lambda *a: tb.stage_grads(*a, scale=scale, block_k=gbk, **tun(nw, ns)),
                (q, k, v, g, beta, A, hs, dhs, do, dvn, vn)))
            save(res, out)

    # (shape, grads (block_k, warps, stages), parts (warps, stages), states (block_v, warps,
    # stages)): the defaults. 16 / 64 key channels and 2 / 8 warps for the gradient pass were
    # slower with either grid order (benchmarks/RESULTS.md, seventh run).
    grads = ((32, 4, 2),)
    sweeps = [
        (SHAPES[0], grads, ((8, 2),), ((128, 8, 2),)),
        (SHAPES[1], grads, ((8, 2),), ((16, 4, 2),)),
    ]
    for shape, *cfgs in [] if essentials_only else sweeps:
        try:
            stages(shape, *cfgs)
        except Exception:
            res["B{}_T{}_H{}".format(*shape)]["stages_error"] = traceback.format_exc()[-2000:]
        save(res, out)


if __name__ == "__main__":
    {"torch": run_torch, "jax": run_jax}[sys.argv[1]]()

"""MoE grouped GEMM on one GPU: the Pallas kernels vs `jax.lax.ragged_dot` (XLA) vs `torch._grouped_mm`.

Usage on the GPU machine (one job; the torch part runs in its own process so the two frameworks do not
share the allocator):

    PYTHONPATH=. python3 benchmarks/moe_grouped_gemm.py            # all parts, table at the end
    PYTHONPATH=. python3 benchmarks/moe_grouped_gemm.py --part jax|torch|report

Results land in $OUT (or .) as moe_jax.json / moe_torch.json. Every JAX case is checked against the XLA
reference before it is timed (relative Frobenius error on fp32 outputs, fresh random data, output rows
beyond what was written would show as garbage). TFLOP/s count useful FLOPs only, 2*M*K*N (gate+up: N = 2F).

Cases (K3 per-GPU slices): 28 experts x 16384 rows (EP=32) gate+up 3584 -> 2x3072 with SiTU, down
3072 -> 3584; 112 experts x 16384 rows (EP=8) gate+up and down. Group sizes uniform (M // E, remainder spread);
one extra uneven case (weights U(0.5, 1.5) rounded to 16 rows, as in /work/shared/bench) for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT", ".")
M, H, F = 16384, 3584, 3072
CASES = [  # label, experts, kind (gate_up | down), distribution
    ("gate_up_E28", 28, "gate_up", "uniform"),
    ("down_E28", 28, "down", "uniform"),
    ("gate_up_E112", 112, "gate_up", "uniform"),
    ("down_E112", 112, "down", "uniform"),
    ("gate_up_E28_uneven", 28, "gate_up", "uneven"),
]
if os.environ.get("MOE_CASES"):  # "label,label" keeps those cases only
    CASES = [c for c in CASES if c[0] in os.environ["MOE_CASES"].split(",")]
# MOE_DEFAULTS_ONLY=1: time each case's default Pallas-Triton config only (not its neighbours)
DEFAULTS_ONLY = os.environ.get("MOE_DEFAULTS_ONLY") == "1"
# the Mosaic GPU kernels' pipeline depths timed beside the Triton configs
MOSAIC_STAGES = (4, 3)


def sizes_for(num_experts: int, dist: str, m: int = M) -> list[int]:
    if dist == "uniform":
        base, rem = divmod(m, num_experts)
        return [base + (i < rem) for i in range(num_experts)]
    import numpy as np

    w = np.random.default_rng(1).uniform(0.5, 1.5, num_experts)
    s = (np.floor(w / w.sum() * m / 16) * 16).astype(int)
    s[-1] += m - s.sum()
    return [int(v) for v in s]


def dims(kind: str) -> tuple[int, int]:
    return (H, 2 * F) if kind == "gate_up" else (F, H)  # (K, N) with N counting gate and up


# ---------------------------------------------------------------------------------------------- JAX


def part_jax(budget_s: float, tune: bool = False) -> None:
    import dataclasses
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks.timing import samples_ms
    from pallas_kernels.moe import triton as pg
    from pallas_kernels.moe.mosaic_gpu import gate_up_situ_mgpu, grouped_matmul_mgpu
    from pallas_kernels.moe.reference import RAGGED_DIMS, situ

    t0 = time.time()
    res: dict = {"env": {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}}
    path = os.path.join(OUT, "moe_jax_tune.json" if tune else "moe_jax.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    def bench(fn, *args, reps=15, inner=3):
        times = samples_ms(fn, *args, reps=reps, inner=inner, warmups=2)
        return times[len(times) // 2], times[len(times) // 5], times[(4 * len(times)) // 5]

    def rel(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    def ragged(x, w, gs):
        return jax.lax.ragged_dot_general(x, w, gs, RAGGED_DIMS, preferred_element_type=jnp.float32)

    @functools.partial(jax.jit, static_argnames=("fused",))
    def xla_ref(x, w1, w3, gs, fused):  # fp32 out, the checking reference
        if fused:
            return situ(ragged(x, w1, gs), ragged(x, w3, gs), 4.0, 25.0)
        return ragged(x, w1, gs)

    @jax.jit
    def xla_gate_up_situ(x, w1, w3, gs):  # the production XLA path (reference.experts_ragged_dot)
        g = ragged(x, w1, gs).astype(x.dtype)
        u = ragged(x, w3, gs).astype(x.dtype)
        return situ(g, u, 4.0, 25.0)

    @jax.jit
    def xla_one(x, w, gs):
        return ragged(x, w, gs).astype(x.dtype)

    # Small edge cases on the GPU first (compiled path, not interpret): empty experts, one expert, tail.
    key = jax.random.key(7)
    edge = {}
    small_cfg = pg.TileConfig(64, 64, 32, 4, 3)
    merged_cfg = pg.TileConfig(64, 64, 32, 4, 3, weights_lhs=True, tail_m=16, merge_tail=True)
    for name, gs in [("uneven", [50, 0, 131, 7, 68]), ("one_expert", [0, 0, 256, 0, 0]),
                     ("tail_rows", [10, 20, 0, 30, 100]), ("last_only", [0, 0, 0, 0, 256])]:
        k1, k2, k3, key = jax.random.split(key, 4)
        x = jax.random.normal(k1, (256, 128), jnp.bfloat16)
        w1 = (jax.random.normal(k2, (5, 128, 128)) * 0.2).astype(jnp.bfloat16)
        w3 = (jax.random.normal(k3, (5, 128, 128)) * 0.2).astype(jnp.bfloat16)
        g = jnp.asarray(gs, jnp.int32)
        ref_f = xla_ref(x, w1, w3, g, True)
        o = pg.grouped_gate_up_situ(x, w1, w3, g, cfg=small_cfg, out_dtype=jnp.float32)
        o2 = pg.grouped_matmul(x, w1, g, cfg=small_cfg, out_dtype=jnp.float32)
        om = pg.grouped_gate_up_situ(x, w1, w3, g, cfg=merged_cfg, out_dtype=jnp.float32)
        om2 = pg.grouped_matmul(x, w1, g, cfg=merged_cfg, out_dtype=jnp.float32)
        ref_plain = xla_ref(x, w1, w3, g, False)
        omg = gate_up_situ_mgpu(x, w1, w3, g)
        edge[name] = [rel(o, ref_f), rel(o2, ref_plain), rel(om, ref_f), rel(om2, ref_plain), rel(omg, ref_f)]
    # the Mosaic GPU kernel where TMA is strict: a row count no multiple of 8 and rows of no expert
    # (NaN here: never multiplied, stored as exact zeros)
    for name, gs in [("mgpu_301_rows", [1, 170, 100]), ("mgpu_40_rows", [7, 33, 0])]:
        k1, k2, k3, key = jax.random.split(key, 4)
        m, used = 301 if name == "mgpu_301_rows" else 40, sum(gs)
        x = jax.random.normal(k1, (m, 256), jnp.bfloat16).at[used:].set(jnp.nan)
        w1, w3 = ((jax.random.normal(k, (3, 256, 256)) * 0.1).astype(jnp.bfloat16) for k in (k2, k3))
        g = jnp.asarray(gs, jnp.int32)
        out, out2 = gate_up_situ_mgpu(x, w1, w3, g), grouped_matmul_mgpu(x, w1, g)
        edge[name] = [rel(out[:used], xla_ref(x[:used], w1, w3, g, True)), bool(jnp.all(out[used:] == 0)),
                      rel(out2[:used], xla_ref(x[:used], w1, w3, g, False)), bool(jnp.all(out2[used:] == 0))]
    res["edge_rel_err"] = edge
    print("edge cases rel err (gate_up, plain; merged tails: gate_up, plain; Mosaic GPU"
          " gate_up, bf16 out; mgpu_*: the Mosaic GPU gate_up err, spare rows zero, plain err, spare rows zero):", edge,
          flush=True)
    save()

    T = pg.TileConfig
    separate_tail = lambda cfg: dataclasses.replace(cfg, merge_tail=False)  # noqa: E731 (its own program)
    if tune:  # candidates around the 28-expert gate+up default: deeper k tiles and pipelines
        plan = {"gate_up_E28": [(pg.GATE_UP_DEFAULT, True), (T(128, 128, 128, 8, 2), True),
                                (T(128, 128, 128, 8, 2, weights_lhs=True), True), (T(128, 128, 32, 8, 6), True),
                                (T(128, 128, 32, 8, 8), True), (T(128, 128, 64, 8, 3), True)]}
    else:  # final pass: the defaults (first entry of each list) and their nearest neighbours
        lhs = functools.partial(dataclasses.replace, weights_lhs=True)
        merged = lambda cfg, tail: lhs(cfg, tail_m=tail, merge_tail=True)  # noqa: E731
        plan = {"gate_up_E28": [(pg.GATE_UP_DEFAULT, True), (lhs(pg.GATE_UP_DEFAULT), True),
                                (merged(pg.GATE_UP_DEFAULT, 32), True)],
                "gate_up_E112": [(pg.GATE_UP_SMALL_GROUPS, True), (separate_tail(pg.GATE_UP_SMALL_GROUPS), True)],
                "down_E28": [(pg.DOWN_DEFAULT, False), (merged(pg.DOWN_DEFAULT, 32), False)],
                "down_E112": [(pg.DOWN_SMALL_GROUPS, False), (separate_tail(pg.DOWN_SMALL_GROUPS), False)]}
    best_cfg: dict[str, pg.TileConfig] = {}
    for label, num_experts, kind, dist in CASES:
        if tune and label not in plan:
            continue
        if time.time() - t0 > budget_s:
            res[label] = {"skipped": "time budget"}
            save()
            continue
        k_dim, n_dim = dims(kind)
        flops = 2 * M * k_dim * n_dim
        kx, k1, k3 = jax.random.split(jax.random.key(num_experts + len(label)), 3)
        x = jax.random.normal(kx, (M, k_dim), jnp.bfloat16)
        n_w = F if kind == "gate_up" else H
        scale = k_dim ** -0.5 * 2.0
        w1 = (jax.random.normal(k1, (num_experts, n_w, k_dim), jnp.float32) * scale).astype(jnp.bfloat16)
        w3 = (jax.random.normal(k3, (num_experts, n_w, k_dim), jnp.float32) * scale).astype(jnp.bfloat16)
        gs = jnp.asarray(sizes_for(num_experts, dist), jnp.int32)
        fused = kind == "gate_up"
        ref = xla_ref(x, w1, w3, gs, fused)
        r = {"experts": num_experts, "M": M, "K": k_dim, "N": n_dim, "dist": dist, "GFLOP": flops / 1e9,
             "ours": {}}
        cfgs = plan.get(label, [])[:1 if DEFAULTS_ONLY else None]
        if dist != "uniform" and kind in best_cfg:
            cfgs = [best_cfg[kind]]  # the best (cfg, approx) of the uniform case
        if not tune:
            cfgs = cfgs + [("mosaic_gpu", stages) for stages in MOSAIC_STAGES]
        for cfg, approx in cfgs:
            tag = f"mosaic_gpu_s{approx}" if cfg == "mosaic_gpu" else cfg.label() + ("_approx" if approx else "")
            try:
                if cfg == "mosaic_gpu":  # (a Mosaic GPU kernel, its stages)
                    f = functools.partial(gate_up_situ_mgpu if fused else grouped_matmul_mgpu, stages=approx)
                elif fused:
                    f = functools.partial(pg.grouped_gate_up_situ, cfg=cfg)  # the epilogue's approximations on
                else:
                    f = functools.partial(pg.grouped_matmul, cfg=cfg)
                f, args = jax.jit(f), ((x, w1, w3, gs) if fused else (x, w1, gs))
                err = rel(f(*args), ref)
                ms = bench(f, *args)
                ok = err < 1e-2
                r["ours"][tag] = {"rel_err": err, "ok": ok, "ms_med_p20_p80": ms, "TFLOPs": flops / ms[0] / 1e9}
            except Exception as e:  # keep going: report the failure
                r["ours"][tag] = {"error": repr(e)[:800]}
            print(label, tag, r["ours"][tag], flush=True)
            save()
        good = {t: v for t, v in r["ours"].items() if v.get("ok")}
        if good:
            best_tag = max(good, key=lambda t: good[t]["TFLOPs"])
            r["ours_best"] = {"cfg": best_tag, **good[best_tag]}
            triton = [t for t in good if not t.startswith("mosaic_gpu")]
            if dist == "uniform" and kind not in best_cfg and triton:  # for the uneven case
                best_triton = max(triton, key=lambda t: good[t]["TFLOPs"])
                best_cfg[kind] = cfgs[list(r["ours"]).index(best_triton)]
        if tune:
            if num_experts == 28 and fused:  # cost of the tile table (plain XLA ops) alone
                sched = jax.jit(lambda g: pg.schedule(g, M, 128, n_dim // 2 // 128))
                r["schedule_only_ms"] = bench(sched, gs)
            res[label] = r
            save()
            continue
        # XLA peers: the production path (two ragged_dots + SiTU) and one ragged_dot of the same FLOPs.
        try:
            if fused:
                ms = bench(xla_gate_up_situ, x, w1, w3, gs, reps=5, inner=1)
                r["xla_gate_up_situ"] = {"ms_med_p20_p80": ms, "TFLOPs": flops / ms[0] / 1e9,
                                         "rel_err": rel(xla_gate_up_situ(x, w1, w3, gs), ref)}
            else:
                ms = bench(xla_one, x, w1, gs, reps=5, inner=1)
                r["xla_ragged_dot"] = {"ms_med_p20_p80": ms, "TFLOPs": flops / ms[0] / 1e9}
        except Exception as e:
            r["xla_error"] = repr(e)[:500]
        # In-JAX anchor: JAX's bundled Mosaic-GPU ragged_dot (plain GEMM, N = 2F for gate+up, no SiTU).
        if dist == "uniform" and num_experts == 28 and time.time() - t0 < budget_s * 0.8:
            try:
                from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd

                w_kn = jnp.swapaxes(jnp.concatenate([w1, w3], axis=1) if fused else w1, 1, 2)  # [E, K, N]
                best = None
                for bm, bn, bk, mcs, gbn in [(128, 128, 64, 4, 1), (128, 256, 64, 3, 1)]:
                    f = jax.jit(functools.partial(rd.ragged_dot, block_m=bm, block_n=bn, block_k=bk,
                                                  max_concurrent_steps=mcs, grid_block_n=gbn))
                    ms = bench(lambda a, b_, g_: f(a, b_, group_sizes=g_), x, w_kn, gs)
                    if best is None or ms[0] < best[1][0]:
                        best = ((bm, bn, bk, mcs, gbn), ms)
                r["mgpu_ragged_dot"] = {"cfg": best[0], "ms_med_p20_p80": best[1], "TFLOPs": flops / best[1][0] / 1e9}
                del w_kn
            except Exception as e:
                r["mgpu_error"] = repr(e)[:500]
        res[label] = r
        print(label, {k: v for k, v in r.items() if k != "ours"}, flush=True)
        save()
        del x, w1, w3, ref
    res["wall_s"] = time.time() - t0
    save()


# -------------------------------------------------------------------------------------------- torch


def part_torch() -> None:
    import torch

    from benchmarks.torch_peer import do_bench_ms, torch_situ

    dev, bf16 = "cuda", torch.bfloat16
    res: dict = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}}

    n = 8192
    a, b = torch.randn(n, n, device=dev, dtype=bf16), torch.randn(n, n, device=dev, dtype=bf16)
    res["matmul_8192_TFLOPs"] = 2 * n**3 / do_bench_ms(lambda: a @ b)[0] / 1e9
    del a, b
    for label, num_experts, kind, dist in CASES:
        k_dim, n_dim = dims(kind)
        flops = 2 * M * k_dim * n_dim
        sizes = torch.tensor(sizes_for(num_experts, dist))
        offs = torch.cumsum(sizes, 0).to(torch.int32).to(dev)
        x = torch.randn(M, k_dim, device=dev, dtype=bf16)
        # Release layout [E, N, K]; grouped_mm wants (E, K, N): a transposed view, no copy (as in anchors_torch).
        w = (torch.randn(num_experts, n_dim, k_dim, device=dev, dtype=bf16) * k_dim**-0.5).transpose(-2, -1)
        r = {"GFLOP": flops / 1e9}
        try:
            out = torch._grouped_mm(x, w, offs=offs)
            # spot check against a per-group matmul
            s0, s1 = 0, int(sizes[0])
            err = ((out[s0:s1].float() - (x[s0:s1].float() @ w[0].float())).norm() / out[s0:s1].float().norm()).item()
            ms = do_bench_ms(lambda: torch._grouped_mm(x, w, offs=offs))
            r["grouped_mm"] = {"ms_med_p20_p80": ms, "TFLOPs": flops / ms[0] / 1e9, "rel_err_group0": err}
            if kind == "gate_up":  # + an unfused SiTU epilogue in torch (what ours fuses)
                def gm_situ():
                    y = torch._grouped_mm(x, w, offs=offs)
                    return torch_situ(y[:, : n_dim // 2], y[:, n_dim // 2:])
                ms = do_bench_ms(gm_situ)
                r["grouped_mm_plus_situ"] = {"ms_med_p20_p80": ms, "TFLOPs": flops / ms[0] / 1e9}
        except Exception as e:
            r["error"] = repr(e)[:500]
        bd = torch.randn(k_dim, n_dim, device=dev, dtype=bf16)
        r["dense_same_flops_TFLOPs"] = flops / do_bench_ms(lambda: x @ bd)[0] / 1e9
        res[label] = r
        print(label, r, flush=True)
        del x, w, bd
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "moe_torch.json"), "w") as f:
        json.dump(res, f, indent=1)


# ------------------------------------------------------------------------------------------- report


def part_report() -> None:
    def load(name):
        try:
            with open(os.path.join(OUT, name)) as f:
                return json.load(f)
        except OSError:
            return {}

    jr, tr = load("moe_jax.json"), load("moe_torch.json")
    print(f"device: {jr.get('env')} / {tr.get('env')}; torch matmul 8192^3: {tr.get('matmul_8192_TFLOPs', 0):.0f} TFLOP/s")
    print(f"{'case':22s} {'ours':>7s} {'cfg':50s} {'err':>8s} {'xla':>7s} {'torch':>7s} {'t+situ':>7s} "
          f"{'dense':>7s} {'mgpu':>7s}")
    for label, *_ in CASES:
        j, t = jr.get(label, {}), tr.get(label, {})
        best = j.get("ours_best", {})
        xla = j.get("xla_gate_up_situ", j.get("xla_ragged_dot", {}))
        print(f"{label:22s} {best.get('TFLOPs', 0):7.1f} {best.get('cfg', '-'):50s} "
              f"{best.get('rel_err', float('nan')):8.1e} "
              f"{xla.get('TFLOPs', 0):7.1f} {t.get('grouped_mm', {}).get('TFLOPs', 0):7.1f} "
              f"{t.get('grouped_mm_plus_situ', {}).get('TFLOPs', 0):7.1f} {t.get('dense_same_flops_TFLOPs', 0):7.1f} "
              f"{j.get('mgpu_ragged_dot', {}).get('TFLOPs', 0):7.1f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", choices=["all", "jax", "torch", "report", "tune"])
    ap.add_argument("--budget-s", type=float, default=200.0)
    args = ap.parse_args()
    if args.part == "jax":
        part_jax(args.budget_s)
    elif args.part == "tune":
        part_jax(args.budget_s, tune=True)
    elif args.part == "torch":
        part_torch()
    elif args.part == "report":
        part_report()
    else:
        env = dict(os.environ)
        for part in ("jax", "torch"):
            subprocess.run([sys.executable, __file__, "--part", part, "--budget-s", str(args.budget_s)], env=env,
                           check=False)
        part_report()

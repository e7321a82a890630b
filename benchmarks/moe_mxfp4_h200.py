"""MoE grouped GEMMs on one H200: MXFP4 weights decoded in the kernel, row tiling at 112 experts, and the backward.

Usage on the GPU machine (one job, about 3-4 minutes; torch runs in its own process afterwards):

    PYTHONPATH=. python3 benchmarks/moe_mxfp4_h200.py              # jax part, torch part, then the table
    PYTHONPATH=. python3 benchmarks/moe_mxfp4_h200.py --part jax|torch|report
    PYTHONPATH=. python3 benchmarks/moe_mxfp4_h200.py --part jax --cases gate_up_E112 down_E112   # a subset
    PYTHONPATH=. python3 benchmarks/moe_mxfp4_h200.py --part jax --repeat 3 --cases gate_up_E28_decode  # 3x

Results land in $OUT (or .) as moe_mxfp4_jax.json / moe_mxfp4_torch.json. Every case is checked before it is
timed; a case that fails (compile error, wrong numbers) is recorded and the others still run.

Cases (K3 per-GPU slices, M = 16384 rows sorted by expert, group sizes uniform):
  * decode-sized batches (DECODE_ROWS = 256 rows over 28 experts), where weight bytes, not MMAs, set the
    time: the whole routed path (`routed_experts`, which keeps MXFP4 weights packed into the kernels at
    this size) vs decoding the layer in XLA first vs bf16 weights; and each GEMM's tile candidates;
  * gate+up 3584 -> 2x3072 (SiTU fused) and down 3072 -> 3584 at E=28: the bf16 kernel on bf16 weights, the
    same kernels reading MXFP4 weights and decoding tiles in registers (default: weights as the MMA's left
    operand; also the plain orientation), and XLA decode of the whole layer followed by the bf16 kernel;
  * gate+up and down at E=112 (146-147 rows per expert): 128-row tiles with a 32-row tail merged into the
    same program (the small-group default) vs the tail in a program of its own; mma_rows_* = rows of MMA
    work per column block (useful: 16384);
  * only when named in --cases: gate_up_E28_tiles (one-warpgroup tile candidates at E=28, bf16 and MXFP4),
    tn_E28_tiles (the weight-gradient GEMM alone, tile candidates) and decode_layer_E28 (one layer's gate and
    up experts decoded to bf16 in XLA: the table decode routed_experts uses at 16384 rows vs the kernels'
    integer bit assembly over the whole layer);
  * expert MLP forward+backward at E=28 and E=112 (pallas_gpu.grouped_mlp: its default kernels and tiles) vs jax autodiff of
    the lax.ragged_dot MLP, and (torch part) torch._grouped_mm forward + autograd backward of the same MLP;
    torch._grouped_mm alone for each forward GEMM.
Numerics before timing: bf16 outputs vs an fp32 lax.ragged_dot reference (rel <= 1e-2; the bf16 output
rounding alone is ~2e-3); MXFP4 vs the bf16 kernel on the decoded weights, bf16 out (rel <= 5e-3: only
flipped roundings, a wrong nibble, sign or scale gives O(0.1)) and, for the default config, fp32 out
(same bf16 operands, summation order only: expect ~1e-7); small edge cases (empty experts, rows past the
groups, K = 96 through the routed path) compiled, fp32 out. Backward: Pallas vs XLA gradients, both bf16
(rel <= 3e-2). TFLOP/s count useful FLOPs: 2*M*K*N per GEMM (gate+up N = 2F); fwd+bwd = 3x the forward's.
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
DECODE_ROWS = 256  # routed rows per GPU in a decode step (e.g. 512 sequences x 16 experts over 32 expert shards)
ONLY: set[str] = set()  # --cases: run only these case labels (the edge cases always run)
REPEAT = 1  # --repeat: time each forward GEMM config and routed path this many times, interleaved (*_rep<i>)
INTERPRET = False  # --smoke: tiny shapes in Pallas interpret mode on CPU, to check the script itself
BETA, LINEAR_BETA = 4.0, 25.0


def uniform_sizes(num_experts: int, m: int = M) -> list[int]:
    base, rem = divmod(m, num_experts)
    return [base + (i < rem) for i in range(num_experts)]


# ---------------------------------------------------------------------------------------------- JAX


def part_jax(budget_s: float) -> None:
    import dataclasses
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks.timing import samples_ms
    from pallas_kernels.moe import pallas_gpu, routed_experts
    from pallas_kernels.moe import triton as pg
    from pallas_kernels.moe.reference import RAGGED_DIMS, experts_ragged_dot, situ
    from pallas_kernels.mxfp4 import MXFP4Experts, decode_tile

    t0 = time.time()
    T = pg.TileConfig
    res: dict = {"env": {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}}
    path = os.path.join(OUT, "moe_mxfp4_jax.json")

    def save() -> None:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    def bench(fn, *args, reps=15, inner=3):
        if INTERPRET:
            reps, inner = 1, 1
        times = samples_ms(fn, *args, reps=reps, inner=inner, warmups=2)
        return times[len(times) // 2], times[len(times) // 5], times[(4 * len(times)) // 5]

    def rel(a, b) -> float:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    def ragged(x, w, gs):
        return jax.lax.ragged_dot_general(x, w, gs, RAGGED_DIMS, preferred_element_type=jnp.float32)

    contract_rows = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])

    def ragged_rows_outer(a, b, gs):  # per group e: a_e^T b_e, the weight-gradient GEMM's oracle
        return jax.lax.ragged_dot_general(a, b, gs, contract_rows, preferred_element_type=jnp.float32)

    def random_mxfp4(key, e, n, k) -> MXFP4Experts:
        """Random codes; scale bytes 119/120 give a weight RMS of ~0.01 (about K^-1/2)."""
        k1, k2 = jax.random.split(key)
        scale = 119 + jax.random.bits(k2, (e, n, k // 32), jnp.uint8) % 2
        return MXFP4Experts(jax.random.bits(k1, (e, n, k // 2), jnp.uint8), scale.astype(jnp.uint8))

    def run_case(record: dict, name: str, fn, args, check) -> None:
        """Compile, check numerics (check(out) -> (rel_err, ok)), then time; failures are recorded."""
        try:
            err, ok = check(fn(*args))
            entry = {"rel_err": err, "ok": ok}
            if ok:
                ms = bench(fn, *args)
                entry.update(ms_med_p20_p80=ms, TFLOPs=record["GFLOP"] / ms[0])
        except Exception as e:  # keep going: report the failure
            entry = {"error": repr(e)[:800]}
        record[name] = entry
        print(record.get("label"), name, entry, flush=True)
        save()

    # -- 1. small edge cases, compiled (not interpret): empty experts, one expert, rows past the groups --
    key = jax.random.key(7)
    edge: dict = {}
    for name, sizes in [("uneven_one_empty", [50, 0, 131, 7, 68]), ("tail_rows_two_empty", [10, 0, 0, 30, 100])]:
        k1, k2, k3, key = jax.random.split(key, 4)
        x = jax.random.normal(k1, (256, 128), jnp.bfloat16)
        q1, q3 = random_mxfp4(k2, 5, 128, 128), random_mxfp4(k3, 5, 128, 128)
        d1, d3 = (q.decode(jnp.bfloat16) for q in (q1, q3))
        gs = jnp.asarray(sizes, jnp.int32)
        ref = situ(ragged(x, d1, gs), ragged(x, d3, gs), BETA, LINEAR_BETA)
        try:
            out = {}
            for lhs in (False, True):
                c = T(64, 64, 32, 4, 3, weights_lhs=lhs, tail_m=16 if lhs else None)
                out[f"gate_up_lhs{int(lhs)}"] = rel(pg.grouped_gate_up_situ(
                    x, q1, q3, gs, cfg=c, out_dtype=jnp.float32, interpret=INTERPRET), ref)
                out[f"matmul_lhs{int(lhs)}"] = rel(pg.grouped_matmul(
                    x, q1, gs, cfg=c, out_dtype=jnp.float32, interpret=INTERPRET), ragged(x, d1, gs))
            edge[name] = out
        except Exception as e:
            edge[name] = {"error": repr(e)[:800]}
    try:  # whole routed path, in = 96 (block_k fitted to 32), out = 40 (padded)
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        x = jax.random.normal(k1, (300, 96), jnp.bfloat16)
        ws = [random_mxfp4(k, 8, n, kk) for k, n, kk in ((k2, 64, 96), (k3, 40, 64), (k4, 64, 96))]
        ids = jax.random.randint(k5, (300, 4), 0, 8)
        wts = jnp.full((300, 4), 0.25, jnp.float32)
        got = jax.jit(functools.partial(routed_experts, beta=BETA, linear_beta=LINEAR_BETA,
                                        implementation="pallas_gpu"))(x, *ws, wts, ids)
        want = experts_ragged_dot(x, *(w.decode(jnp.bfloat16) for w in ws), wts, ids, beta=BETA,
                                  linear_beta=LINEAR_BETA)
        edge["routed_k96"] = rel(got, want)  # both bf16 paths; XLA rounds gate/up to bf16 first (~3e-3)
    except Exception as e:
        edge["routed_k96"] = {"error": repr(e)[:800]}
    res["edge_rel_err"] = edge
    print("edge cases (fp32 out, rel err):", edge, flush=True)
    save()

    def forward_case(rec, num_experts, fused, k_dim, n_w, bf16_cfgs, mxfp4_cfgs, m) -> None:
        """bf16 kernel, MXFP4 in-kernel decode and XLA decode + bf16 kernel on one GEMM shape (m rows), into rec."""
        kx, k1, k3 = jax.random.split(jax.random.key(num_experts + fused), 3)
        x = jax.random.normal(kx, (m, k_dim), jnp.bfloat16)
        q1 = random_mxfp4(k1, num_experts, n_w, k_dim)
        q3 = random_mxfp4(k3, num_experts, n_w, k_dim) if fused else None
        d1 = q1.decode(jnp.bfloat16)
        d3 = q3.decode(jnp.bfloat16) if fused else None
        gs = jnp.asarray(uniform_sizes(num_experts, m), jnp.int32)
        if fused:
            call = lambda cfg, **kw: jax.jit(functools.partial(  # noqa: E731
                pg.grouped_gate_up_situ, cfg=cfg, interpret=INTERPRET, **kw))
            ref32 = jax.jit(lambda x_, a, b, g: situ(ragged(x_, a, g), ragged(x_, b, g), BETA, LINEAR_BETA))(
                x, d1, d3, gs)
            same_ops = call(bf16_cfgs[0], out_dtype=jnp.float32)(x, d1, d3, gs)
            dense_args, packed_args = (x, d1, d3, gs), (x, q1, q3, gs)
        else:
            call = lambda cfg, **kw: jax.jit(functools.partial(  # noqa: E731
                pg.grouped_matmul, cfg=cfg, interpret=INTERPRET, **kw))
            ref32 = jax.jit(ragged)(x, d1, gs)
            same_ops = call(bf16_cfgs[0], out_dtype=jnp.float32)(x, d1, gs)
            dense_args, packed_args = (x, d1, gs), (x, q1, gs)
        bf16_check = lambda out: (lambda e: (e, e <= 1e-2))(rel(out, ref32))  # noqa: E731
        same_bf16 = call(bf16_cfgs[0])(*dense_args)
        for cfg in bf16_cfgs:
            rec["mma_rows_" + cfg.label()] = int(pg.mma_rows(gs, m, cfg))  # useful rows: m
        for rep in range(REPEAT):
            tag = f"_rep{rep}" if REPEAT > 1 else ""
            for cfg in bf16_cfgs:
                run_case(rec, "bf16_" + cfg.label() + tag, call(cfg), dense_args, bf16_check)
            mxfp4_configs(rec, mxfp4_cfgs, call, packed_args, same_ops, same_bf16, ref32, tag)
        if num_experts != 28 or m != M or rec["label"].endswith("_tiles"):
            return
        decode_first(rec, fused, bf16_cfgs[0], packed_args, bf16_check)

    def mxfp4_configs(rec, mxfp4_cfgs, call, packed_args, same_ops, same_bf16, ref32, tag) -> None:
        for i, cfg in enumerate(mxfp4_cfgs):
            if i == 0 and tag in ("", "_rep0"):
                # fp32 out: same bf16 operands as the bf16 kernel, so only the summation order differs
                try:
                    rec["mxfp4_default_fp32out_vs_bf16_kernel"] = rel(call(cfg, out_dtype=jnp.float32)(*packed_args),
                                                                      same_ops)
                except Exception as e:
                    rec["mxfp4_default_fp32out_vs_bf16_kernel"] = repr(e)[:800]

            def check(out):  # bf16 out: a few flipped bf16 roundings vs the bf16 kernel; a bad decode is O(0.1)
                same, err = rel(out, same_bf16), rel(out, ref32)
                rec["mxfp4_vs_bf16_kernel_" + cfg.label()] = same
                return err, same <= 5e-3 and err <= 1e-2

            run_case(rec, "mxfp4_" + cfg.label() + tag, call(cfg), packed_args, check)

    def decode_first(rec, fused, bf16_cfg, packed_args, bf16_check) -> None:
        """XLA decoding the layer before the bf16 kernel."""
        if fused:
            xla_decode = jax.jit(lambda x_, a, b, g: pg.grouped_gate_up_situ(
                x_, a.decode(jnp.bfloat16), b.decode(jnp.bfloat16), g, cfg=bf16_cfg, interpret=INTERPRET))
        else:
            xla_decode = jax.jit(lambda x_, a, g: pg.grouped_matmul(
                x_, a.decode(jnp.bfloat16), g, cfg=bf16_cfg, interpret=INTERPRET))
        run_case(rec, "xla_decode_then_bf16_kernel", xla_decode, packed_args, bf16_check)

    # -- 1b. the routed path at decode size: packed weights into the kernels vs decoding the layer first ----
    def routed_decode_case(label: str) -> dict:
        rec = {"label": label, "rows": DECODE_ROWS, "GFLOP": 2 * DECODE_ROWS * 3 * H * F / 1e9}
        try:
            kx, k1, k2, k3, ki = jax.random.split(jax.random.key(11), 5)
            x = jax.random.normal(kx, (DECODE_ROWS, H), jnp.bfloat16)
            packed = [random_mxfp4(k, 28, n, kk) for k, n, kk in ((k1, F, H), (k2, H, F), (k3, F, H))]
            ids = jax.random.randint(ki, (DECODE_ROWS, 1), 0, 28)
            wts = jnp.ones((DECODE_ROWS, 1), jnp.float32)
            kw = dict(beta=BETA, linear_beta=LINEAR_BETA)
            routed = jax.jit(functools.partial(routed_experts, implementation="pallas_gpu", **kw))
            decode_first = jax.jit(lambda x_, a, b, c, w_, i_: routed_experts(
                x_, *(q.decode(jnp.bfloat16) for q in (a, b, c)), w_, i_, implementation="pallas_gpu", **kw))
            dense = [q.decode(jnp.bfloat16) for q in packed]
            want = decode_first(x, *packed, wts, ids)
            same = lambda out: (lambda e: (e, e <= 5e-3))(rel(out, want))  # noqa: E731 (only bf16 roundings differ)
            for rep in range(REPEAT):
                tag = f"_rep{rep}" if REPEAT > 1 else ""
                run_case(rec, "mxfp4_packed_into_kernels" + tag, routed, (x, *packed, wts, ids), same)
                run_case(rec, "mxfp4_decode_layer_then_kernels" + tag, decode_first, (x, *packed, wts, ids), same)
                run_case(rec, "bf16_weights" + tag, routed, (x, *dense, wts, ids), same)
        except Exception as e:
            rec["error"] = repr(e)[:800]
        return rec

    label = "routed_decode_E28"
    res[label] = {"skipped": "not in --cases"} if ONLY and label not in ONLY else routed_decode_case(label)
    save()

    # -- 2. forward GEMMs ------------------------------------------------------------------------------
    # First entry of each list: the default config for those weights (the reference for the others). MXFP4:
    # the default (weights as the MMA's left operand) and the plain orientation.
    mx = functools.partial(pg.for_weights, mxfp4=True)
    separate_tail = lambda cfg: dataclasses.replace(cfg, merge_tail=False)  # noqa: E731
    # decode-sized batches first (DECODE_ROWS rows over 28 experts, ~9 per expert): weight-bandwidth bound, where
    # reading 4.25 bits per weight instead of 16 should pay for the in-kernel decode. Defaults: DECODE_TILES
    # (32-row tiles at 4 warps, one warpgroup, so each decodes its own 64 weight rows) for bf16 weights,
    # DECODE_TILES_MXFP4 (the same with a 16-row tail) for MXFP4; each also runs the other's tiles
    small = [pg.DECODE_TILES_MXFP4]
    small_mxfp4 = [pg.DECODE_TILES]
    one_warpgroup = [T(128, 64, 64, 4, 3), T(128, 64, 64, 4, 2), T(64, 128, 64, 4, 3)]
    cases = [
        ("gate_up_E28_decode", 28, True, [pg.gate_up_config(DECODE_ROWS, 28), *small],
         [pg.gate_up_config(DECODE_ROWS, 28, mxfp4=True), *small_mxfp4], DECODE_ROWS),
        ("down_E28_decode", 28, False, [pg.down_config(DECODE_ROWS, 28), *small],
         [pg.down_config(DECODE_ROWS, 28, mxfp4=True), *small_mxfp4], DECODE_ROWS),
        ("gate_up_E28", 28, True, [pg.GATE_UP_DEFAULT],
         [pg.gate_up_config(M, 28, mxfp4=True), mx(pg.GATE_UP_DEFAULT), pg.GATE_UP_DEFAULT], M),
        ("down_E28", 28, False, [pg.DOWN_DEFAULT],
         [mx(pg.DOWN_DEFAULT)], M),
        # tile candidates at E=28 (only with --cases): one warpgroup per program, so that two or more programs
        # share an SM and one's epilogue / tile decode overlaps another's MMAs
        ("gate_up_E28_tiles", 28, True, [pg.GATE_UP_DEFAULT, *one_warpgroup, T(256, 64, 64, 8, 3)],
         [mx(pg.GATE_UP_DEFAULT), *(mx(c) for c in one_warpgroup), mx(T(64, 64, 64, 4, 3))], M),
        # small-group tiles: 128 rows + a 32-row tail merged into the same program (default) vs a program of
        # its own; MXFP4 decodes each weight tile once for both when merged
        ("gate_up_E112", 112, True, [pg.GATE_UP_SMALL_GROUPS, separate_tail(pg.GATE_UP_SMALL_GROUPS)],
         [mx(pg.GATE_UP_SMALL_GROUPS), mx(separate_tail(pg.GATE_UP_SMALL_GROUPS))], M),
        ("down_E112", 112, False, [pg.DOWN_SMALL_GROUPS, separate_tail(pg.DOWN_SMALL_GROUPS)],
         [mx(pg.DOWN_SMALL_GROUPS), mx(separate_tail(pg.DOWN_SMALL_GROUPS))], M),
    ]
    for label, num_experts, fused, bf16_cfgs, mxfp4_cfgs, m in cases:
        if (ONLY and label not in ONLY) or (not ONLY and label.endswith("_tiles")):
            continue
        if time.time() - t0 > budget_s * 0.6:
            res[label] = {"skipped": "time budget"}
            save()
            continue
        k_dim, n_w = (H, F) if fused else (F, H)
        rec: dict = {"label": label, "experts": num_experts, "K": k_dim, "N": n_w * (2 if fused else 1),
                     "rows": m, "GFLOP": 2 * m * k_dim * n_w * (2 if fused else 1) / 1e9,
                     "weight_GB_bf16": num_experts * k_dim * n_w * (2 if fused else 1) * 2 / 1e9}
        try:
            forward_case(rec, num_experts, fused, k_dim, n_w, bf16_cfgs, mxfp4_cfgs, m)
        except Exception as e:  # setup or reference failed: record it, run the next case
            rec["error"] = repr(e)[:800]
        res[label] = rec
        save()

    # -- 2b. the weight-gradient GEMM alone (only with --cases): dW1_e = dg_e^T x_e at E=28, tile candidates --
    label = "tn_E28_tiles"
    if label in ONLY:
        kd, kx = jax.random.split(jax.random.key(5))
        dg = jax.random.normal(kd, (M, F), jnp.bfloat16)
        x = jax.random.normal(kx, (M, H), jnp.bfloat16)
        gs = jnp.asarray(uniform_sizes(28), jnp.int32)
        rec = {"label": label, "GFLOP": 2 * M * F * H / 1e9}
        want = jax.jit(lambda a, b: ragged_rows_outer(a, b, gs))(dg, x)
        tn_check = lambda out: (lambda e: (e, e <= 1e-2))(rel(out, want))  # noqa: E731
        # block_m: P tile, block_n: Q tile, block_k: rows per step (128 rows per step exceeds shared memory)
        for cfg in (T(128, 256, 64, 8, 4), T(128, 256, 32, 8, 6), T(128, 128, 64, 8, 4), T(256, 128, 64, 8, 3)):
            fn = jax.jit(functools.partial(pg.grouped_matmul_tn, group_sizes=gs, cfg=cfg, out_dtype=jnp.bfloat16,
                                           interpret=INTERPRET))
            run_case(rec, "tn_" + cfg.label(), fn, (dg, x), tn_check)
        res[label] = rec
        save()

    # -- 2c. decoding one layer's gate and up experts to bf16 (only with --cases): what routed_experts does
    # before the bf16 kernels at 16384 rows. The release decode (`MXFP4Experts.decode`: a 16-entry table
    # gather, an fp32 scale product) against the kernels' bit assembly (`mxfp4.decode_tile`: integer
    # ops only) applied to the whole layer by XLA; both exact, so they must agree bit for bit.
    label = "decode_layer_E28"
    if label in ONLY:
        def decode_bits(q: MXFP4Experts) -> jax.Array:
            e, n, half = q.packed.shape
            flat = decode_tile(q.packed.reshape(e * n, half), q.scale.reshape(e * n, -1))
            return flat.reshape(e, n, 2 * half)

        k1, k3 = jax.random.split(jax.random.key(11))
        pair = (random_mxfp4(k1, 28, F, H), random_mxfp4(k3, 28, F, H))
        gb = sum(q.packed.size + q.scale.size + 2 * q.shape[0] * q.shape[1] * q.shape[2] for q in pair) / 1e9
        rec = {"label": label, "GB_moved": gb, "GFLOP": 0.0}
        table = jax.jit(lambda a, b: (a.decode(jnp.bfloat16), b.decode(jnp.bfloat16)))
        bits = jax.jit(lambda a, b: (decode_bits(a), decode_bits(b)))
        want = table(*pair)
        for name, fn in (("table_decode", table), ("bit_assembly_decode", bits)):
            try:
                got = fn(*pair)
                same = all(bool(jnp.array_equal(g, w)) for g, w in zip(got, want))
                entry = {"bit_equal": same}
                if same:
                    ms = bench(fn, *pair)
                    entry.update(ms_med_p20_p80=ms, GB_per_s=gb / ms[0] * 1e3)
            except Exception as e:  # keep going: report the failure
                entry = {"error": repr(e)[:800]}
            rec[name] = entry
            print(label, name, entry, flush=True)
        res[label] = rec
        save()

    # -- 3. expert MLP forward + backward at E=28 and E=112, default tiles ---------------------------------
    def mlp_case(label: str, num_experts: int) -> dict:
        rec = {"label": label, "GFLOP": 3 * 2 * M * (H * 2 * F + F * H) / 1e9}
        ks = jax.random.split(jax.random.key(3), 5)
        rows = jax.random.normal(ks[0], (M, H), jnp.bfloat16)
        w1 = (jax.random.normal(ks[1], (num_experts, F, H), jnp.float32) * 2 * H**-0.5).astype(jnp.bfloat16)
        w3 = (jax.random.normal(ks[2], (num_experts, F, H), jnp.float32) * H**-0.5).astype(jnp.bfloat16)
        w2 = (jax.random.normal(ks[3], (num_experts, H, F), jnp.float32) * F**-0.5).astype(jnp.bfloat16)
        cot = jax.random.normal(ks[4], (M, H), jnp.bfloat16)
        gs = jnp.asarray(uniform_sizes(num_experts), jnp.int32)

        def xla_mlp(r, a, b, c):
            g, u = ragged(r, a, gs).astype(r.dtype), ragged(r, c, gs).astype(r.dtype)
            return ragged(situ(g, u, BETA, LINEAR_BETA), b, gs).astype(r.dtype)

        def pallas_mlp(r, a, b, c):  # the default tiles and kernels (`pallas_gpu.plan_kernels`)
            return pallas_gpu.grouped_mlp(r, gs, a, b, c, beta=BETA, linear_beta=LINEAR_BETA)

        def grads(mlp):
            loss = lambda r, a, b, c: jnp.sum(mlp(r, a, b, c).astype(jnp.float32) * cot)  # noqa: E731
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

        xla_grads = grads(xla_mlp)
        args = (rows, w1, w2, w3)
        try:
            want = xla_grads(*args)
            jax.block_until_ready(want)

            def check(got):
                errs = [rel(g, w) for g, w in zip(got, want)]
                rec["grad_rel_err_x_w1_w2_w3"] = errs
                return max(errs), max(errs) <= 3e-2

            run_case(rec, "pallas_custom_vjp", grads(pallas_mlp), args, check)
            ms = bench(xla_grads, *args, reps=3, inner=1)
            rec["xla_ragged_dot_autodiff"] = {"ms_med_p20_p80": ms, "TFLOPs": rec["GFLOP"] / ms[0]}
        except Exception as e:
            rec["error"] = repr(e)[:800]
        return rec

    for label, num_experts in (("mlp_fwd_bwd_E28", 28), ("mlp_fwd_bwd_E112", 112)):
        if ONLY and label not in ONLY:
            res[label] = {"skipped": "not in --cases"}
        elif time.time() - t0 > budget_s * 0.8:
            res[label] = {"skipped": "time budget"}
        else:
            res[label] = mlp_case(label, num_experts)
        save()
    res["wall_s"] = time.time() - t0
    save()


# -------------------------------------------------------------------------------------------- torch


def part_torch() -> None:
    import torch

    from benchmarks.torch_peer import do_bench_ms, torch_situ

    dev, bf16 = "cuda", torch.bfloat16
    res: dict = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}}

    def weights(e, n, k, requires_grad=False):
        # release layout [E, N, K]; grouped_mm wants (E, K, N): a transposed view, no copy
        w = (torch.randn(e, n, k, device=dev, dtype=bf16) * k**-0.5).requires_grad_(requires_grad)
        return w, w.transpose(-2, -1)

    for label, num_experts, (k_dim, n_dim) in [("gate_up_E28", 28, (H, 2 * F)), ("down_E28", 28, (F, H)),
                                               ("gate_up_E112", 112, (H, 2 * F)), ("down_E112", 112, (F, H))]:
        offs = torch.cumsum(torch.tensor(uniform_sizes(num_experts)), 0).to(torch.int32).to(dev)
        x = torch.randn(M, k_dim, device=dev, dtype=bf16)
        _, w = weights(num_experts, n_dim, k_dim)
        gflop = 2 * M * k_dim * n_dim / 1e9
        try:
            ms = do_bench_ms(lambda: torch._grouped_mm(x, w, offs=offs))
            res[label] = {"grouped_mm": {"ms_med_p20_p80": ms, "TFLOPs": gflop / ms[0]}}
        except Exception as err:
            res[label] = {"error": repr(err)[:500]}
        print(label, res[label], flush=True)
        torch.cuda.empty_cache()

    # expert MLP fwd + autograd bwd (gate and up as one grouped GEMM with N = 2F, SiTU in torch ops)
    gflop = 3 * 2 * M * (H * 2 * F + F * H) / 1e9
    for label, num_experts in (("mlp_fwd_bwd_E28", 28), ("mlp_fwd_bwd_E112", 112)):
        offs = torch.cumsum(torch.tensor(uniform_sizes(num_experts)), 0).to(torch.int32).to(dev)
        x = torch.randn(M, H, device=dev, dtype=bf16, requires_grad=True)
        w13, w13_t = weights(num_experts, 2 * F, H, requires_grad=True)
        w2, w2_t = weights(num_experts, H, F, requires_grad=True)
        cot = torch.randn(M, H, device=dev, dtype=bf16)

        def fwd_bwd():
            gu = torch._grouped_mm(x, w13_t, offs=offs)
            y = torch._grouped_mm(torch_situ(gu[:, :F], gu[:, F:]), w2_t, offs=offs)
            return torch.autograd.grad(y, (x, w13, w2), cot)  # returned, not accumulated into .grad

        try:
            fwd_bwd()
            ms = do_bench_ms(fwd_bwd)
            res[label] = {"grouped_mm_autograd": {"ms_med_p20_p80": ms, "TFLOPs": gflop / ms[0]}}
        except Exception as err:
            res[label] = {"error": repr(err)[:500]}
        print(label, res[label], flush=True)
    with open(os.path.join(OUT, "moe_mxfp4_torch.json"), "w") as f:
        json.dump(res, f, indent=1)


# ------------------------------------------------------------------------------------------- report


def part_report() -> None:
    def load(name):
        try:
            with open(os.path.join(OUT, name)) as f:
                return json.load(f)
        except OSError:
            return {}

    jr, tr = load("moe_mxfp4_jax.json"), load("moe_mxfp4_torch.json")
    print(f"device: {jr.get('env')} / {tr.get('env')}")
    print("edge cases:", jr.get("edge_rel_err"))
    for label in ("routed_decode_E28", "gate_up_E28_decode", "down_E28_decode", "gate_up_E28", "down_E28",
                  "gate_up_E112", "down_E112", "mlp_fwd_bwd_E28", "mlp_fwd_bwd_E112"):
        j, t = jr.get(label, {}), tr.get(label, {})
        print(f"\n{label}  (torch: {json.dumps(t)})")
        for name, v in j.items():
            if isinstance(v, dict):
                tf = v.get("TFLOPs")
                print(f"  {name:48s} {'%7.1f TFLOP/s' % tf if tf else '':15s} err {v.get('rel_err', '-')}"
                      f" {v.get('error', '')[:200]}")
            elif name not in ("label", "experts", "K", "N", "GFLOP"):
                print(f"  {name:48s} {v}")
    decode = jr.get("decode_layer_E28", {})
    if decode:
        print(f"\ndecode_layer_E28  ({decode.get('GB_moved', 0):.2f} GB moved)")
        for name in ("table_decode", "bit_assembly_decode"):
            v = decode.get(name, {})
            ms = v.get("ms_med_p20_p80", ["-"])[0]
            print(f"  {name:48s} {ms} ms  {v.get('GB_per_s', '-')} GB/s  bit-equal {v.get('bit_equal')}"
                  f" {v.get('error', '')[:200]}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", choices=["all", "jax", "torch", "report"])
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, CPU (checks the script)")
    ap.add_argument("--cases", nargs="*", default=[], help="jax case labels to run (default: all)")
    ap.add_argument("--repeat", type=int, default=1, help="time each forward GEMM config this many times")
    args = ap.parse_args()
    ONLY.update(args.cases)
    REPEAT = args.repeat
    if args.smoke:
        M, H, F, INTERPRET = 256, 256, 256, True
    if args.part == "jax":
        part_jax(args.budget_s)
    elif args.part == "torch":
        part_torch()
    elif args.part == "report":
        part_report()
    else:
        for part in ("jax",) if args.smoke else ("jax", "torch"):
            subprocess.run([sys.executable, __file__, "--part", part, "--budget-s", str(args.budget_s),
                            "--repeat", str(args.repeat), "--cases", *args.cases]
                           + ["--smoke"] * args.smoke, env=dict(os.environ), check=False)
        part_report()

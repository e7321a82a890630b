"""MoE expert GEMMs: our kernels and `torch._grouped_mm` timed in turns, in one process on one GPU.

Why a second MoE benchmark: the H200's clock drifts over a job (the same kernel measured 545 and 598
TFLOP/s in two jobs of 2026-12-04), so timing each contender once, one after another, ranks them partly
by when they ran. Here every round times every contender (the order rotating), with the same clock (wall
time of back-to-back calls ended by one synchronisation), on the same data (torch reads JAX's arrays
through DLPack); medians over the rounds.

    PYTHONPATH=. python3 benchmarks/moe_interleaved.py [--rounds 25] [--inner 5]

Cases: 28 experts x 16384 rows (uniform and uneven groups) gate+up 3584 -> 2 x 3072 with SiTU and down
3072 -> 3584; 112 experts gate+up and down (uniform and uneven), each also at 8192 and 4096 rows; a
decode step's 256 rows over 28 experts (weight bytes set the time there: TB/s of weights read once are
printed beside TFLOP/s). Each JAX contender is first checked
against the fp32 `lax.ragged_dot` reference (relative Frobenius error < 1e-2; bf16 outputs give ~1.7e-3);
torch's output against the same reference. TFLOP/s count 2*M*K*N (gate+up: N = 2F). torch's gate+up is
timed without and with a separate SiTU pass (ours fuses it). Results: $OUT/moe_interleaved.json and a
table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch allocates beside JAX

OUT = os.environ.get("OUT", ".")
M, H, F = 16384, 3584, 3072
DECODE_ROWS = 256  # routed rows of a decode step on one GPU (e.g. 512 sequences x 16 over 32 shards)
CASES = [  # label, experts, kind, distribution, rows
    ("gate_up_E28", 28, "gate_up", "uniform", M),
    ("gate_up_E28_uneven", 28, "gate_up", "uneven", M),
    ("down_E28", 28, "down", "uniform", M),
    ("gate_up_E112", 112, "gate_up", "uniform", M),
    ("down_E112", 112, "down", "uniform", M),
    ("gate_up_E112_uneven", 112, "gate_up", "uneven", M),
    ("gate_up_E112_8k", 112, "gate_up", "uniform", M // 2),  # 73 rows per expert
    ("gate_up_E112_4k", 112, "gate_up", "uniform", M // 4),  # 37: just above decode-sized
    ("down_E112_uneven", 112, "down", "uneven", M),
    ("down_E112_8k", 112, "down", "uniform", M // 2),
    ("down_E112_4k", 112, "down", "uniform", M // 4),
    ("gate_up_E28_decode", 28, "gate_up", "uniform", DECODE_ROWS),
    ("down_E28_decode", 28, "down", "uniform", DECODE_ROWS),
]
if os.environ.get("MOE_CASES"):  # "label,label" keeps those cases only
    CASES = [c for c in CASES if c[0] in os.environ["MOE_CASES"].split(",")]


def contenders(kind: str, num_experts: int, x, w1, w3, gs) -> tuple[dict, dict]:
    """(ours, peers) for one case: each name -> a zero-argument call (JAX, then torch)."""
    import jax
    import torch

    from benchmarks.torch_peer import torch_situ
    from pallas_kernels.moe import mosaic_gpu as mg
    from pallas_kernels.moe import triton as pg

    rows = x.shape[0]
    tx, tw1, tw3 = (torch.from_dlpack(a) for a in (x, w1, w3))
    offs = torch.cumsum(torch.from_dlpack(gs), 0).to(torch.int32)
    if kind == "gate_up":
        cfg = pg.gate_up_config(rows, num_experts)
        tw = torch.cat([tw1, tw3], dim=1).transpose(-2, -1)  # [E, K, 2F], a transposed view of [E, 2F, K]
        calls = {
            "mosaic_gpu": jax.jit(mg.gate_up_situ_mgpu),
            f"mosaic_gpu_tail{mg.TAIL_ROWS}": jax.jit(functools.partial(mg.gate_up_situ_mgpu,
                                                                        tail_rows=mg.TAIL_ROWS)),
            f"triton_{cfg.label()}": jax.jit(functools.partial(pg.grouped_gate_up_situ, cfg=cfg)),
        }
        ours = {name: functools.partial(f, x, w1, w3, gs) for name, f in calls.items()}
        half = tw.shape[-1] // 2

        def torch_situ_call():
            y = torch._grouped_mm(tx, tw, offs=offs)
            return torch_situ(y[:, :half], y[:, half:])

        peers = {"torch_grouped_mm": lambda: torch._grouped_mm(tx, tw, offs=offs),
                 "torch_grouped_mm_plus_situ": torch_situ_call}
    else:
        cfg = pg.down_config(rows, num_experts)
        calls = {"mosaic_gpu": jax.jit(mg.grouped_matmul_mgpu),
                 f"mosaic_gpu_tail{mg.TAIL_ROWS}": jax.jit(functools.partial(mg.grouped_matmul_mgpu,
                                                                             tail_rows=mg.TAIL_ROWS)),
                 f"triton_{cfg.label()}": jax.jit(functools.partial(pg.grouped_matmul, cfg=cfg))}
        ours = {name: functools.partial(f, x, w1, gs) for name, f in calls.items()}
        tw = tw1.transpose(-2, -1)
        peers = {"torch_grouped_mm": lambda: torch._grouped_mm(tx, tw, offs=offs)}
    return ours, peers


def main(rounds: int, inner: int) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    from benchmarks.moe_grouped_gemm import dims, sizes_for
    from pallas_kernels.moe.reference import RAGGED_DIMS, situ

    res: dict = {"env": {"jax": jax.__version__, "torch": torch.__version__,
                         "device": jax.devices()[0].device_kind, "rounds": rounds, "inner": inner,
                         "date": time.strftime("%Y-%m-%d")}}

    def rel(a, ref):
        a = jnp.asarray(a).astype(jnp.float32)
        return float(jnp.linalg.norm(a - ref) / jnp.linalg.norm(ref))

    def ragged(x, w, gs):
        return jax.lax.ragged_dot_general(x, w, gs, RAGGED_DIMS, preferred_element_type=jnp.float32)

    for label, num_experts, kind, dist, m in CASES:
        k_dim, n_dim = dims(kind)
        n_w = F if kind == "gate_up" else H
        kx, k1, k3 = jax.random.split(jax.random.key(num_experts + len(label)), 3)
        x = jax.random.normal(kx, (m, k_dim), jnp.bfloat16)
        w1, w3 = ((jax.random.normal(k, (num_experts, n_w, k_dim), jnp.float32) * 2 * k_dim ** -0.5)
                  .astype(jnp.bfloat16) for k in (k1, k3))
        gs = jnp.asarray(sizes_for(num_experts, dist, m), jnp.int32)
        if kind == "gate_up":
            ref = jax.jit(lambda x, a, b, g: situ(ragged(x, a, g), ragged(x, b, g), 4.0, 25.0))(x, w1, w3, gs)
        else:
            ref = jax.jit(ragged)(x, w1, gs)
        ours, peers = contenders(kind, num_experts, x, w1, w3, gs)
        r: dict = {"experts": num_experts, "M": m, "K": k_dim, "N": n_dim, "dist": dist, "rel_err": {}}
        for name, call in ours.items():
            r["rel_err"][name] = rel(call(), ref)
        for name, call in peers.items():
            out = call()
            torch.cuda.synchronize()
            if out.shape[1] != ref.shape[1]:  # gate and up without SiTU: the gate half against x @ w1
                out, want = out[:, :n_w], jax.jit(ragged)(x, w1, gs)
            else:
                want = ref
            r["rel_err"][name] = rel(jax.dlpack.from_dlpack(out.contiguous()), want)
        bad = {n: e for n, e in r["rel_err"].items() if not e < 1e-2}
        if bad:
            r["error"] = f"outputs off the reference: {bad}"
            res[label] = r
            print(label, r, flush=True)
            continue

        def timed(name, call):
            """ms per call: ``inner`` back-to-back calls, then one wait for the GPU."""
            start = time.perf_counter()
            for _ in range(inner):
                out = call()
            if name in peers:
                torch.cuda.synchronize()
            else:
                jax.block_until_ready(out)
            return (time.perf_counter() - start) / inner * 1e3

        everyone = {**ours, **peers}
        names = list(everyone)
        for name in names:  # warm-up: compiles, autotunes, first-touch
            timed(name, everyone[name])
        samples: dict[str, list[float]] = {name: [] for name in names}
        for i in range(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                samples[name].append(timed(name, everyone[name]))
        flops, weight_bytes = 2 * m * k_dim * n_dim, 2 * num_experts * k_dim * n_dim
        r["ms"], r["TFLOPs"], r["weight_TBs"] = {}, {}, {}
        for name, s in samples.items():
            s = sorted(s)
            r["ms"][name] = [statistics.median(s), s[len(s) // 5], s[(4 * len(s)) // 5]]
            r["TFLOPs"][name] = flops / r["ms"][name][0] / 1e9
            r["weight_TBs"][name] = weight_bytes / r["ms"][name][0] / 1e9
        res[label] = r
        for name in names:
            print(f"{label:20s} {name:45s} {r['TFLOPs'][name]:7.1f} TFLOP/s {r['weight_TBs'][name]:5.2f} TB/s of "
                  f"weights  ms p50/p20/p80 "
                  f"{r['ms'][name][0]:.3f}/{r['ms'][name][1]:.3f}/{r['ms'][name][2]:.3f}  "
                  f"err {r['rel_err'][name]:.1e}", flush=True)
        with open(os.path.join(OUT, "moe_interleaved.json"), "w") as f:
            json.dump(res, f, indent=1)
        del ours, peers, x, w1, w3, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--inner", type=int, default=5)
    args = ap.parse_args()
    main(args.rounds, args.inner)

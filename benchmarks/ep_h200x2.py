"""Expert parallelism on two H200s (NCCL): one K3 MoE layer's routed experts split over `expert=2`,
and the golden tiny model sharded over both GPUs.

    PYTHONPATH=. python3 benchmarks/ep_h200x2.py            # on nvidia-h200-x2; log + JSON in $OUT (or .)
    PYTHONPATH=. python3 benchmarks/ep_h200x2.py --smoke    # tiny shapes on 2 fake CPU devices (checks the script)

1. Layer (`sharding.expert_parallel.ep_routed_experts`, local experts on the Pallas grouped GEMMs): K3
   widths (latent 3584, expert intermediate 3072, bf16), E=56 experts (28 per GPU, the per-GPU slice of
   the single-GPU MoE benchmark), top-8, N tokens routed uniformly at random. Every EP strategy is checked
   against the whole layer on one GPU (`routed_experts`, the same Pallas kernels) before it is timed:
   each (token, expert) row is the same bf16 GEMM on both sides, only the fp32 combine order differs, so
   the fp32 outputs agree to ~1e-7 (bound 1e-5; a lost or misrouted pair costs >= 1e-2). Gradients of
   <out, ct> w.r.t. x, w1, w2, w3, weights for all_to_all and allgather against the one-GPU layer's
   (bf16 gradients: bound 1e-2 rel-RMS, a wrong routing or a missing reduction costs O(1)).
2. Golden tiny model (tests/golden/k3-tiny-a) in fp32 on the meshes expert=2, tensor=2, data=2: logits
   against the unsharded model on one GPU (bound 1e-5, as tests/sharding/test_sharding.py) and greedy
   tokens equal; bf16 on expert=2 (the Pallas EP path) against bf16 on one GPU, reported.
3. tests/sharding/test_expert_parallel.py on both GPUs (the real `ragged_all_to_all` with two peers).

XLA_FLAGS gets `sharding.expert_parallel.RAGGED_GPU_FLAG` (XLA's ragged-all-to-all decomposer), without
which the GPU ragged exchange gives wrong gradients in jax 0.11.2 and `exchange="ragged"` refuses to run.

Timing: `jax.jit`, one warm-up call, then median of 7 calls each ending in `block_until_ready`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "."))
ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "k3-tiny-a"
BETA, LINEAR_BETA = 4.0, 25.0


def log(msg: str) -> None:
    print(msg, flush=True)
    with open(OUT / "ep_h200x2.log", "a") as fh:
        fh.write(msg + "\n")


def rel_rms(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def layer_problem(n, e, k, d, f, dtype, seed=0):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (n, d), dtype)
    w1 = (jax.random.normal(keys[1], (e, f, d), jnp.float32) * 1.5 / d**0.5).astype(dtype)
    w3 = (jax.random.normal(keys[2], (e, f, d), jnp.float32) / d**0.5).astype(dtype)
    w2 = (jax.random.normal(keys[3], (e, d, f), jnp.float32) / f**0.5).astype(dtype)
    ids = jnp.argsort(jax.random.uniform(keys[4], (n, e)), axis=1)[:, :k].astype(jnp.int32)
    weights = jax.random.uniform(keys[5], (n, k), jnp.float32, 0.1, 1.0)
    return x, w1, w2, w3, weights, ids


def place(args, mesh, tokens_split: bool):
    """Arrays where the shard_map wants them (experts split, tokens split or replicated), so that the
    timed calls move only what the strategy itself moves."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x, w1, w2, w3, weights, ids = args
    rows = NamedSharding(mesh, P("expert" if tokens_split else None, None))
    experts = NamedSharding(mesh, P("expert", None, None))
    return (jax.device_put(x, rows), *(jax.device_put(w, experts) for w in (w1, w2, w3)),
            jax.device_put(weights, rows), jax.device_put(ids, rows))


def layer_cases(smoke: bool, shapes: tuple[str, ...], grads: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import median_ms
    from pallas_kernels.moe import routed_experts
    from sharding import make_mesh
    from sharding.expert_parallel import ep_routed_experts

    mesh = make_mesh("expert=2")
    impl = "xla" if smoke else "pallas_gpu"
    dtype = jnp.float32 if smoke else jnp.bfloat16
    e, k, d, f = (8, 2, 32, 16) if smoke else (56, 8, 3584, 3072)
    sizes = {"prefill": 64 if smoke else 8192, "decode": 8 if smoke else 64}
    rows = []
    for label in shapes:
        n = sizes[label]
        args = layer_problem(n, e, k, d, f, dtype)
        one_gpu = jax.jit(lambda *a: routed_experts(*a, beta=BETA, linear_beta=LINEAR_BETA, implementation=impl))
        want = one_gpu(*args)
        flops = 2 * n * k * d * f * 3  # useful GEMM flops: gate, up, down
        shape_rows = [dict(shape=label, n=n, strategy="one GPU", ms=median_ms(one_gpu, *args), err=0.0)]
        # the padded exchange is the CPU fallback; timed here too, against XLA's ragged-all-to-all
        strategies = [("all_to_all", "ragged"), ("all_to_all", "padded"), ("allgather", "auto"), ("decode", "auto")]
        for strategy, exchange in strategies:
            fn = jax.jit(lambda *a, s=strategy, x=exchange: ep_routed_experts(
                *a, mesh=mesh, beta=BETA, linear_beta=LINEAR_BETA, strategy=s, exchange=x, implementation=impl))
            placed = place(args, mesh, tokens_split=strategy != "decode")
            strategy = f"{strategy} ({exchange})" if strategy == "all_to_all" else strategy
            try:
                err = rel_rms(fn(*placed), want)
                row = dict(shape=label, n=n, strategy=strategy, err=err, ok=err <= 1e-5)
                row["ms"] = median_ms(fn, *placed)
            except Exception as exc:  # recorded, the other cases still run
                row = dict(shape=label, n=n, strategy=strategy, error=f"{type(exc).__name__}: {exc}"[:500])
            shape_rows.append(row)
        for row in shape_rows:
            if "ms" in row:
                row["tflops"] = flops / row["ms"] * 1e-9
            log(f"layer {label:8s} N={n:5d} {row['strategy']:21s} " + (
                f"{row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s  rel-RMS vs one GPU {row['err']:.2e}"
                if "ms" in row else row["error"]))
        rows += shape_rows
        if label == "prefill" and grads:
            rows += layer_gradients(args, mesh, impl, label)
    return rows


def layer_gradients(args, mesh, impl, label) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import median_ms
    from pallas_kernels.moe import routed_experts
    from sharding.expert_parallel import ep_routed_experts

    ct = jax.random.normal(jax.random.key(9), (args[0].shape[0], args[1].shape[2]), jnp.float32)
    argnums = (0, 1, 2, 3, 4)

    def loss_one(*a):
        return jnp.sum(routed_experts(*a, beta=BETA, linear_beta=LINEAR_BETA, implementation=impl) * ct)

    grad_one = jax.jit(jax.grad(loss_one, argnums))
    want = grad_one(*args)
    rows = [dict(shape=label, strategy="one GPU fwd+bwd", ms=median_ms(grad_one, *args))]
    for strategy, exchange in (("all_to_all", "ragged"), ("all_to_all", "padded"), ("allgather", "auto")):
        def loss(*a, s=strategy, x=exchange):
            return jnp.sum(ep_routed_experts(*a, mesh=mesh, beta=BETA, linear_beta=LINEAR_BETA, strategy=s,
                                             exchange=x, implementation=impl) * ct)

        strategy = f"{strategy} ({exchange})" if strategy == "all_to_all" else strategy

        fn = jax.jit(jax.grad(loss, argnums))
        placed = place(args, mesh, tokens_split=True)
        try:
            errs = [rel_rms(g.astype(jnp.float32), w.astype(jnp.float32)) for g, w in zip(fn(*placed), want)]
            rows.append(dict(shape=label, strategy=f"{strategy} fwd+bwd", grad_errs=errs,
                             ok=max(errs) <= 1e-2, ms=median_ms(fn, *placed)))
        except Exception as exc:
            rows.append(dict(shape=label, strategy=f"{strategy} fwd+bwd", error=f"{type(exc).__name__}: {exc}"[:500]))
    for row in rows:
        log(f"layer {label:8s} {row['strategy']:29s} " + (
            f"{row['ms']:8.3f} ms" + (f"  grad rel-RMS (x, w1, w2, w3, weights) "
                                     f"{', '.join(f'{v:.1e}' for v in row['grad_errs'])}" if "grad_errs" in row else "")
            if "ms" in row else row["error"]))
    return rows


def golden_model_cases() -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import k3jax
    from sharding import make_mesh, shard_batch, shard_model

    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 16)), jnp.int32)
    # fp32 dots on a GPU default to TF32 (~1e-3 relative), which would hide a sharding error below the
    # model's own noise; "highest" gives the fp32 products the 1e-5 bound is about.
    jax.config.update("jax_default_matmul_precision", "highest")
    rows = []
    for dtype, meshes in (("float32", ("expert=2", "tensor=2", "data=2")), ("bfloat16", ("expert=2",))):
        model = k3jax.from_pretrained(GOLDEN, dtype=dtype)
        want = np.asarray(model(prompt), np.float32)
        want_tokens = np.asarray(k3jax.generate(model, prompt, max_new_tokens=8))
        for spec in meshes:
            mesh = make_mesh(spec)
            sharded = shard_model(model, mesh)
            logits = sharded(shard_batch(prompt, mesh))
            tokens = np.asarray(k3jax.generate(sharded, shard_batch(prompt, mesh), max_new_tokens=8))
            row = dict(dtype=dtype, mesh=spec, devices=len(logits.sharding.device_set),
                       logits_rel_rms=rel_rms(np.asarray(logits, np.float32), want),
                       tokens_equal=bool((tokens == want_tokens).all()))
            if dtype == "float32":
                row["ok"] = row["logits_rel_rms"] <= 1e-5 and row["tokens_equal"]
            rows.append(row)
            log(f"golden {dtype:8s} mesh {spec:9s} on {row['devices']} devices: logits rel-RMS vs one device "
                f"{row['logits_rel_rms']:.2e}, greedy tokens equal: {row['tokens_equal']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on 2 fake CPU devices")
    parser.add_argument("--parts", default="layer,grads,decode,golden,tests",
                        help="comma-separated subset of: layer (prefill shape), grads, decode, golden, tests")
    args = parser.parse_args()
    smoke, parts = args.smoke, set(args.parts.split(","))
    from sharding.expert_parallel import RAGGED_GPU_FLAG  # noqa: PLC0415 (XLA_FLAGS must be set before JAX starts)

    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {RAGGED_GPU_FLAG}".strip()
    if smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        jax.config.update("jax_num_cpu_devices", 2)
    import jax

    OUT.mkdir(parents=True, exist_ok=True)
    log(f"{time.strftime('%Y-%m-%d %H:%M:%S')} devices: {jax.devices()}")
    if jax.device_count() != 2:
        sys.exit(f"needs exactly 2 devices (nvidia-h200-x2, or --smoke), found {jax.device_count()}")
    result = dict(devices=[str(dev) for dev in jax.devices()])
    if "tests" in parts and not smoke:  # first, in its own process: nothing of ours holds GPU memory yet
        test = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/sharding/test_expert_parallel.py"], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
        result["pytest_expert_parallel"] = test.stdout[-2000:]
        log(test.stdout[-2000:])
    shapes = tuple(s for s in ("prefill", "decode") if {"prefill": "layer", "decode": "decode"}[s] in parts)
    result["layer"] = layer_cases(smoke, shapes, "grads" in parts)
    (OUT / "ep_h200x2.json").write_text(json.dumps(result, indent=1))
    if "golden" in parts:
        result["golden"] = golden_model_cases()
        (OUT / "ep_h200x2.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

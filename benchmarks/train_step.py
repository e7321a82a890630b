"""Fine-tuning step throughput of a reduced full-width K3: tokens/s, MFU, Pallas kernels against XLA.

The model keeps K3's widths (hidden 7168, 96 heads, latent experts 3584 -> 3072, vocab 163840) with fewer
layers and experts (benchmarks/e2e_reduced_k3.py builds it the same way), random bf16 weights:

* LoRA step (rank 16, the trainer's default targets) with the routed experts MXFP4-packed and frozen,
  at `--layers` / `--experts` (default 8 / 32): what fine-tuning K3 itself runs;
* full fine-tuning step (fp32 masters and AdamW moments) at `--full-layers` / `--full-experts` (default
  2 / 8), with `--full-freeze` (default: the embedding and LM head) frozen: about 16 bytes per trained
  parameter, so at full width only a multi-GPU mesh holds more (the embedding and LM head alone are
  2.35 G parameters; `k3jax plan --train full` says how much). `--modes` picks which steps run.

Each step is timed with the dispatch policy's kernels (on GPU the Pallas KDA and grouped-GEMM kernels) and
with the pure-XLA implementations; the kernels' gain is the difference. One more step is traced
(`benchmarks/trace.py`): the Pallas kernels' share of its device time and its top ops. MFU = model FLOP/s / the dense bf16
matmul FLOP/s measured in the same job (an 8192^3 `jnp.dot`), where model FLOPs per token = 6 x the
active matmul parameters (top-k of the routed experts; not the embedding, a lookup; attention scores
not counted, so MFU is a lower bound) for trained weights and 4 x for frozen ones (forward and the
activation backward, no weight gradient): LoRA steps count 4 x everything.

    PYTHONPATH=. python benchmarks/train_step.py --out train_step.json              # one H100 / H200
    PYTHONPATH=. python benchmarks/train_step.py --smoke --out smoke.json            # CPU, tiny config
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.e2e_reduced_k3 import reduced_config
from benchmarks.timing import median_ms
from benchmarks.trace import kernels_share, traced_ops
from k3jax.assets import tiny_checkpoint
from k3jax.checkpoint.names import path_names
from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.model import K3Model
from k3jax.nn.moe import pack_routed_experts
from k3jax.training import Batch, TrainConfig, Trainer

KERNELS = {"policy": Kernels(), "xla": Kernels(kda="xla", kda_decode="xla", moe="xla", mla="xla")}


def matmul_tflops(n: int, reps: int) -> float:
    """Dense bf16 [n, n] @ [n, n] TFLOP/s on this device (the MFU denominator)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    ms = median_ms(jax.jit(jnp.dot), a, a, reps=reps)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def active_params(model: K3Model, cfg: K3Config, frozen: tuple[str, ...]) -> tuple[int, int]:
    """(all, frozen): matmul parameters one token runs through, and those matching `frozen` (fnmatch
    over parameter names, as `TrainConfig.freeze` matches them): everything but the routed experts and the embedding (a lookup), plus
    top_k of E of the experts (counted as decoded weights, whatever their storage: a byte holds two)."""
    totals = {False: [0, 0], True: [0, 0]}  # frozen? -> [dense, experts]
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        name = ".".join(map(str, path_names(path)))
        if name.endswith(".scale") or name.startswith("embed_tokens."):
            continue
        size = int(np.prod(leaf.shape)) * (2 if name.endswith(".packed") else 1)
        totals[any(fnmatch.fnmatchcase(name, p) for p in frozen)][".experts." in name] += size
    active = {k: dense + experts * cfg.num_experts_per_token // cfg.num_experts for k, (dense, experts) in totals.items()}
    return active[False] + active[True], active[True]


def fill_packed(model: K3Model, seed: int = 0) -> K3Model:
    """Random MXFP4 codes with scale 2^-7 in the packed experts (a loader's zeros would decode to 0)."""
    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)

    def fill(path, x):
        if x.dtype != jnp.uint8:
            return x
        if jax.tree_util.keystr(path).endswith("scale']"):
            return jnp.full(x.shape, 120, jnp.uint8)
        return jax.random.randint(jax.random.fold_in(key, hash(jax.tree_util.keystr(path)) % 2**31),
                                  x.shape, 0, 256, jnp.int32).astype(jnp.uint8)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def time_step(model: K3Model, config: TrainConfig, batch: Batch, reps: int, top: int) -> dict:
    """Compile one trainer step, then the median of `reps` timed steps; one more step traced: the
    Pallas kernels' share of its device time and its `top` ops."""
    trainer = Trainer(model, config)
    start = time.perf_counter()
    trainer.step(batch)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        trainer.step(batch)  # returns floats: the step has finished
        times.append(time.perf_counter() - start)
    ms = sorted(times)[len(times) // 2] * 1e3
    ops = traced_ops(lambda: trainer.step(batch))
    return {"ms": ms, "tokens_per_s": batch.input_ids.size / (ms * 1e-3), "first_step_s": compile_s,
            "kernels_share": kernels_share(ops), "top_ops": ops[:top]}


def random_batch(cfg: K3Config, batch: int, seq_len: int) -> Batch:
    ids = jax.random.randint(jax.random.key(1), (batch, seq_len + 1), 0, cfg.vocab_size, jnp.int32)
    ones = jnp.ones((batch, seq_len), jnp.int32)
    return Batch(ids[:, :-1], ids[:, 1:], ones.astype(jnp.float32), ones)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/kimi_k3.json")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--full-layers", type=int, default=2)
    parser.add_argument("--full-experts", type=int, default=8)
    parser.add_argument("--full-freeze", default="embed_tokens.*,lm_head.*",
                        help="comma-separated fnmatch patterns of parameters the full step keeps frozen")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--remat", default="nothing_saveable")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--matmul", type=int, default=8192)
    parser.add_argument("--kernels", default="policy,xla")
    parser.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    parser.add_argument("--top", type=int, default=8, help="ops of the traced step kept per run")
    parser.add_argument("--smoke", action="store_true", help="CPU: the packaged tiny config, short rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.config, args.seq_len, args.reps, args.matmul = str(tiny_checkpoint() / "config.json"), 16, 2, 256
        args.layers = args.full_layers = 2
        args.experts = args.full_experts = 16
        args.kernels, args.remat = "xla", "none"

    peak = matmul_tflops(args.matmul, args.reps)
    results = {"device": str(jax.devices()[0]), "matmul_tflops": peak, "batch": args.batch, "seq_len": args.seq_len,
               "remat": args.remat, "runs": []}
    print(f"dense bf16 matmul {args.matmul}^3: {peak:.1f} TFLOP/s", flush=True)
    cases = [("lora", args.layers, args.experts, True), ("full", args.full_layers, args.full_experts, False)]
    modes = args.modes.split(",")
    if not set(modes) <= {"lora", "full"}:
        parser.error(f"--modes: expected lora and/or full, got {args.modes!r}")
    for mode, layers, experts, packed in (case for case in cases if case[0] in modes):
        cfg = dataclasses.replace(reduced_config(args.config, layers, experts), dtype="bfloat16")
        for name in args.kernels.split(","):
            model = K3Model.init(cfg, seed=0, kernels=KERNELS[name])
            if packed:
                model = fill_packed(pack_routed_experts(model))
            freeze = tuple(p for p in args.full_freeze.split(",") if p) if mode == "full" else ()
            active, frozen = active_params(model, cfg, freeze)
            config = TrainConfig(learning_rate=1e-5, total_steps=1000, lora_rank=args.lora_rank if mode == "lora" else 0,
                                 remat=args.remat, freeze=freeze)
            run = {"mode": mode, "kernels": name, "layers": layers, "experts": experts,
                   "experts_storage": "mxfp4" if packed else "bf16", "active_params": active,
                   "frozen_active_params": active if mode == "lora" else frozen, "frozen": list(freeze)}
            try:
                timing = time_step(model, config, random_batch(cfg, args.batch, args.seq_len), args.reps, args.top)
            except Exception as err:  # noqa: BLE001 - out of memory in one configuration is a result
                run["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            else:
                flops_per_token = 6 * active - 2 * run["frozen_active_params"]
                tflops = timing["tokens_per_s"] * flops_per_token / 1e12
                run.update(timing, model_tflops=tflops, mfu=tflops / peak)
            results["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "top_ops"}), flush=True)
            del model
    print("\n| step | layers x experts | kernels | ms | tokens/s | model TFLOP/s | MFU | Pallas kernels' share |\n"
          "|---|---|---|---:|---:|---:|---:|---:|")
    for r in results["runs"]:
        if "error" in r:
            print(f"| {r['mode']} | {r['layers']} x {r['experts']} | {r['kernels']} | {r['error'][:80]} | | | | |")
            continue
        frozen = f", frozen {' '.join(r['frozen'])}" if r["mode"] == "full" and r["frozen"] else ""
        print(f"| {r['mode']} ({r['experts_storage']} experts{frozen}) | {r['layers']} x {r['experts']} | {r['kernels']} | "
              f"{r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['model_tflops']:.1f} | {100 * r['mfu']:.1f}% | "
              f"{100 * r['kernels_share']:.0f}% |")
    for r in results["runs"]:
        if r.get("top_ops"):
            print(f"\n{r['mode']} / {r['kernels']}, top ops of one traced step:\n| op | ms | calls | share |\n|---|---:|---:|---:|")
            for op in r["top_ops"]:
                print(f"| {op['op'][:70]} | {op['total_us'] / 1e3:.2f} | {op['calls']} | {100 * op['share']:.1f}% |")
    for mode in ("lora", "full"):
        by = {r["kernels"]: r["ms"] for r in results["runs"] if r["mode"] == mode and "ms" in r}
        if {"policy", "xla"} <= by.keys():
            print(f"{mode}: kernels save {by['xla'] - by['policy']:.1f} ms of {by['xla']:.1f} ms "
                  f"({100 * (1 - by['policy'] / by['xla']):.0f}% of the XLA step)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

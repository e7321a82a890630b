"""End-to-end prefill and decode tokens/s of a reduced-depth K3 at full width: Pallas kernels vs XLA.

The model keeps K3's widths (hidden 7168, 96 KDA/MLA heads, latent experts 3584 -> 3072, vocab
163840) with fewer layers and experts so that it fits one H200. Both variants share the same
random bf16 weights; only the kernel choice differs ("policy" = every op's dispatch policy, on GPU the
Pallas kernels; "xla" = lax.ragged_dot and the pure-JAX KDA, prefill and decode).

    PYTHONPATH=. python benchmarks/e2e_reduced_k3.py --layers 8 --experts 64 --out e2e.json
    PYTHONPATH=. python benchmarks/e2e_reduced_k3.py --mesh expert=2 --kernels policy   # two GPUs

With ``--mesh`` the model, inputs and caches are placed by `sharding` (the routed experts then run
expert-parallel); the model is still built on one device first, so it must fit one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from benchmarks.timing import median_ms
from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.generate import _decode_step, prefill
from k3jax.model import K3Model
from sharding import make_mesh, shard_batch, shard_cache, shard_model


def reduced_config(path: str, layers: int, experts: int) -> K3Config:
    cfg = K3Config.from_hf(path)
    kinds = cfg.mixer_kinds[: layers - 1] + ("mla",)  # K3 ends on an MLA layer
    return dataclasses.replace(
        cfg, num_hidden_layers=layers, mixer_kinds=kinds, num_experts=experts,
        num_experts_per_token=min(cfg.num_experts_per_token, experts),
    )


KERNELS = {"policy": Kernels(), "xla": Kernels(kda="xla", kda_decode="xla", moe="xla")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/kimi_k3.json")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=4096)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--mesh", default=None, help="a mesh spec over all devices, e.g. expert=2")
    parser.add_argument("--kernels", default="policy,xla", help=f"kernel choices to time, of {sorted(KERNELS)}")
    args = parser.parse_args()

    cfg = reduced_config(args.config, args.layers, args.experts)
    model = K3Model.init(cfg, seed=0)
    params = sum(x.size for x in jax.tree.leaves(model))
    results = {"device": str(jax.devices()[0]), "devices": jax.device_count(), "mesh": args.mesh,
               "layers": cfg.num_hidden_layers, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_token,
               "hidden": cfg.hidden_size, "params": params, "runs": {}}
    print(json.dumps(results), flush=True)
    key = jax.random.key(0)
    prompt = jax.random.randint(key, (1, args.prefill_len), 0, cfg.vocab_size, jnp.int32)
    context = jax.random.randint(key, (args.decode_batch, args.decode_context), 0, cfg.vocab_size, jnp.int32)
    capacity = args.decode_context + args.decode_steps * (args.repeats + 2)
    mesh = make_mesh(args.mesh) if args.mesh else None
    if mesh is not None:
        model = shard_model(model, mesh)
        prompt, context = shard_batch(prompt, mesh), shard_batch(context, mesh)

    # The decode context is prefilled once, by the kernels: XLA's GPU ragged_dot expands the
    # routed rows densely per expert ([experts, rows, 3072] bf16 = 192 GiB for 32 x 1024 tokens
    # at 64 experts), which no H200 holds. The cache is the same whichever path filled it.
    model.use_kernels(KERNELS["policy"])
    _, context_cache = prefill(model, context, capacity=capacity)
    if mesh is not None:
        context_cache = shard_cache(context_cache, mesh)
    jax.block_until_ready(context_cache)
    check_ids = prompt[:, :256]
    check_logits = {}
    for choice in args.kernels.split(","):
        model.use_kernels(KERNELS[choice])
        check_logits[choice] = prefill(model, check_ids, return_all_logits=True)[0].astype(jnp.float32)
        # The whole prompt in one call (the last position's logits), as the kernels' prefill tokens/s.
        prefill_s = median_ms(lambda: prefill(model, prompt, chunk_size=args.prefill_len)[0], reps=args.repeats) / 1e3
        cache = jax.tree.map(jnp.copy, context_cache)
        tokens = context[:, -1]

        def decode_steps():
            nonlocal cache
            for _ in range(args.decode_steps):
                logits, cache = _decode_step(model, cache, tokens)
            return logits

        decode_s = median_ms(decode_steps, reps=args.repeats) / 1e3
        run = {
            "prefill_tokens_per_s": args.prefill_len / prefill_s, "prefill_ms": prefill_s * 1e3,
            "decode_tokens_per_s": args.decode_batch * args.decode_steps / decode_s,
            "decode_step_ms": decode_s / args.decode_steps * 1e3,
        }
        results["runs"][choice] = run
        print(choice, json.dumps(run), flush=True)
        del cache
    if {"policy", "xla"} <= set(check_logits):
        diff = check_logits["policy"] - check_logits["xla"]
        rel = float(jnp.sqrt(jnp.mean(diff**2) / jnp.mean(check_logits["xla"] ** 2)))
        results["logits_rel_rms_policy_vs_xla"] = rel
        print("logits rel-RMS policy vs xla (bf16, 256 tokens):", rel, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

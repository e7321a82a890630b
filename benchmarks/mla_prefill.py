"""MLA prefill attention at K3's shapes: the blockwise pure-JAX op ("xla"), cuDNN flash attention
("cudnn", keys/values expanded first, values padded to the key size; a chunk at a cache offset
passes an explicit [B, 1, T, S] mask), the chunk as two cuDNN calls with built-in masks merged by
their log-sum-exps ("cudnn two calls", `cudnn_chunk.py`) and the previous XLA path (all keys
expanded, [heads, 1024, S] fp32 scores per query chunk), in one job on one device.

K3: 96 heads, key 128 nope + 64 rope = 192, value 128, latent rank 512. Cases: a whole prompt of T
tokens (T = S) and the last chunk of a chunked prefill (T = 8192 new tokens after S - T cached).
Every output is compared with the blockwise op's (bf16 rel-RMS): the "cudnn" row is the GPU check
of the policy's GPU defaults (pallas_kernels/mla/dispatch.py). FLOP/s counts the causal pairs.

    PYTHONPATH=. python benchmarks/mla_prefill.py --out mla_prefill.json          # GPU
    PYTHONPATH=. python benchmarks/mla_prefill.py --smoke --out /tmp/mla.json     # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp

from benchmarks.timing import median_ms
from pallas_kernels.mla import (
    attention_mask, blockwise_mla_attention, cudnn_chunk_mla_attention, cudnn_mla_attention, expand_keys_values,
    mla_prefill_attention,
)

F32 = jnp.float32
K3 = dict(heads=96, nope=128, rope=64, value=128, rank=512)
TINY = dict(heads=3, nope=8, rope=8, value=8, rank=16)


def old_xla_path(q, latents, w_kv_b, *, nope_dim, scale, q_offset=0, start=None, query_chunk=1024):
    """The model's previous prefill attention: keys/values of every position expanded at once, then
    [B, H, chunk, S] fp32 scores per query chunk of `query_chunk` rows (lax.map)."""
    k, v = expand_keys_values(latents, w_kv_b, q.shape[2], nope_dim, q.dtype)
    seq, key_pos = q.shape[1], jnp.arange(k.shape[1])

    def attend(q_rows, rows_pos):
        s = jnp.einsum("bthd,bshd->bhts", q_rows, k, preferred_element_type=F32) * scale
        probs = jax.nn.softmax(jnp.where(attention_mask(rows_pos, key_pos, start)[:, None], s, -jnp.inf), -1)
        return jnp.einsum("bhts,bshd->bthd", probs.astype(q.dtype), v, preferred_element_type=F32).astype(q.dtype)

    chunk = min(query_chunk, seq)
    pad = -seq % chunk
    qc = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(q.shape[0], -1, chunk, *q.shape[2:])
    pos = (q_offset + jnp.arange(seq + pad)).reshape(-1, chunk)
    out = jax.lax.map(lambda a: attend(*a), (jnp.moveaxis(qc, 1, 0), pos))
    return jnp.moveaxis(out, 0, 1).reshape(q.shape[0], seq + pad, *out.shape[3:])[:, :seq]


def implementations(smoke: bool) -> dict:
    cudnn = "xla" if smoke else "cudnn"  # the same call through XLA's attention where cuDNN is absent
    return {
        "blockwise (ours, xla)": lambda **kw: blockwise_mla_attention(**kw),
        f"cudnn ({cudnn})": lambda **kw: cudnn_mla_attention(**kw, implementation=cudnn),
        f"cudnn two calls ({cudnn})": lambda **kw: cudnn_chunk_mla_attention(**kw, implementation=cudnn),
        "previous xla path": old_xla_path,
        "policy": lambda q, latents, w_kv_b, **kw: mla_prefill_attention(q, latents, w_kv_b, **kw),
    }


def run_case(dims: dict, seq: int, keys: int, reps: int, smoke: bool) -> dict:
    h, n, p, v, r = dims["heads"], dims["nope"], dims["rope"], dims["value"], dims["rank"]
    rng = jax.random.split(jax.random.key(seq + keys), 3)
    q = jax.random.normal(rng[0], (1, seq, h, n + p), jnp.bfloat16)
    latents = jax.random.normal(rng[1], (1, keys, r + p), jnp.bfloat16)
    w = (jax.random.normal(rng[2], (h * (n + v), r), F32) / math.sqrt(r)).astype(jnp.bfloat16)
    offset = keys - seq
    # Causal pairs (query, visible key): each query sees the cache before the chunk and its own prefix.
    pairs = seq * offset + seq * (seq + 1) / 2
    flops = 2 * pairs * h * (n + p + v)
    case = {"T": seq, "S": keys, "offset": offset, "runs": {}}
    reference = None
    for name, fn in implementations(smoke).items():
        # A chunk's offset is traced, as in the model (the cache length); a whole prompt's is 0.
        call = jax.jit(lambda q, lat, w, o, fn=fn: fn(q=q, latents=lat, w_kv_b=w, nope_dim=n, scale=(n + p) ** -0.5,
                                                      q_offset=o if offset else 0))
        try:
            out = call(q, latents, w, offset)
            ms = median_ms(call, q, latents, w, offset, reps=reps)
        except Exception as err:  # noqa: BLE001 - an implementation that cannot run is reported, not fatal
            case["runs"][name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            print(f"T={seq} S={keys} {name}: {case['runs'][name]['error']}", flush=True)
            continue
        out = out.astype(F32)
        reference = out if reference is None else reference
        rel = float(jnp.sqrt(jnp.mean((out - reference) ** 2) / jnp.mean(reference**2)))
        case["runs"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_rms_vs_blockwise": rel}
        print(f"T={seq} S={keys} {name}: {ms:.2f} ms, {flops / ms / 1e9:.1f} TFLOP/s, rel {rel:.2e}", flush=True)
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (the smoke test)")
    parser.add_argument("--lengths", default="8192,32768", help="whole-prompt lengths T = S")
    parser.add_argument("--chunk-context", default="32768,131072", help="caches S for an 8192-token last chunk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        dims, cases, reps = TINY, [(24, 24), (8, 40)], 1
    else:
        dims, reps = K3, args.repeats
        cases = [(t, t) for t in map(int, args.lengths.split(","))]
        cases += [(8192, s) for s in map(int, args.chunk_context.split(","))]
    results = {"device": str(jax.devices()[0]), "dims": dims, "cases": []}
    for seq, keys in cases:
        results["cases"].append(run_case(dims, seq, keys, reps, args.smoke))
    names = list(implementations(args.smoke))
    print("\n| T | S | " + " | ".join(f"{n} ms (TFLOP/s)" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for case in results["cases"]:
        cells = [f"{r['ms']:.2f} ({r['tflops']:.0f})" if "ms" in r else "-" if "skipped" in r else "error"
                 for r in (case["runs"][n] for n in names)]
        print(f"| {case['T']} | {case['S']} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""Serving throughput: the continuous-batching engine of `k3jax serve` driven in-process (no HTTP).

The reduced full-width K3 of `e2e_reduced_k3.py` (random bf16 weights) serves C concurrent clients
(default 1, 16 and 64; the engine has C slots), each with its own random prompt, all submitted at
once and decoded to `--new` tokens (eos ignored). The engine admits queued prompts in batched
prefills of at most `--max-prefill-tokens` tokens (rows x padded width; the default, the engine's,
is 16 rows of 512 tokens, so 64 clients are admitted in 4 steps; C x 512 admits all C in one).
Reported per level: output tokens/s, time to first token (from submission) and inter-token latency,
against batched `k3jax.generate` on the same C prompts in the same job (one fused prefill + decode
program: the ceiling without scheduling). First a two-turn chat on a `--turn-prompt`-token first
prompt: the second turn's time to first token with the prefix cache (its prompt continues the first
turn's snapshot) and without it (the whole prompt prefilled again), beside the share of the second
prompt the cache holds. A long first prompt makes the uncached prefill compute-bound, as a real
conversation's is; at a few hundred tokens both are one weight read and the cut says little.

Every shape is run once before it is timed, so compilation is not counted. Needs only jax (no
starlette / uvicorn):

    PYTHONPATH=. python benchmarks/serve_throughput.py --out serve.json
    PYTHONPATH=. python benchmarks/serve_throughput.py --max-prefill-tokens 32768 --out serve.json
    PYTHONPATH=. python benchmarks/serve_throughput.py --smoke            # CPU, the tiny checkpoint
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from collections.abc import Sequence

import jax
import numpy as np

from benchmarks.e2e_reduced_k3 import reduced_config
from k3jax.assets import tiny_checkpoint
from k3jax.generate import generate
from k3jax.model import K3Model
from k3jax.pretrained import LAYER_LAYOUTS, from_pretrained, unrolls
from k3jax.serving.prefix_cache import PrefixCache
from k3jax.serving.request import Finish, GenerationRequest
from k3jax.serving.scheduler import Scheduler


class Timed:
    """A sink that stamps every token."""

    def __init__(self) -> None:
        self.submitted = time.perf_counter()
        self.stamps: list[float] = []
        self.tokens: list[int] = []
        self.result: Finish | None = None

    def token(self, token: int) -> None:
        self.stamps.append(time.perf_counter())
        self.tokens.append(token)

    def finish(self, finish: Finish) -> None:
        self.result = finish


def _max_len(args: argparse.Namespace) -> int:
    """One limit for every level's engine, so equal batches share programs."""
    return args.prompt + args.new


def _serve(scheduler: Scheduler, prompts: np.ndarray, new: int) -> tuple[list[Timed], float]:
    sinks = [Timed() for _ in prompts]
    start = time.perf_counter()
    for prompt, sink in zip(prompts, sinks):
        sink.submitted = time.perf_counter()
        scheduler.submit(GenerationRequest(tuple(prompt.tolist()), new), sink)
    scheduler.run_until_idle()
    return sinks, time.perf_counter() - start


def _level(model: K3Model, clients: int, args: argparse.Namespace, rng: np.random.Generator) -> dict:
    vocab = model.config.vocab_size
    scheduler = Scheduler(model, max_batch=clients, max_len=_max_len(args), prefill_chunk=args.chunk,
                          max_prefill_tokens=args.max_prefill_tokens)
    _serve(scheduler, rng.integers(0, vocab, (clients, args.prompt)), args.new)  # compile every shape
    prompts = rng.integers(0, vocab, (clients, args.prompt))
    sinks, seconds = _serve(scheduler, prompts, args.new)
    ttft = [s.stamps[0] - s.submitted for s in sinks]
    itl = np.concatenate([np.diff(s.stamps) for s in sinks if len(s.stamps) > 1] or [np.zeros(0)])
    tokens = sum(len(s.tokens) for s in sinks)

    ids = np.asarray(prompts, np.int32)
    jax.block_until_ready(generate(model, ids, max_new_tokens=args.new))  # compile
    start = time.perf_counter()
    jax.block_until_ready(generate(model, ids, max_new_tokens=args.new))
    generate_s = time.perf_counter() - start
    return {
        "clients": clients, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "ttft_mean_ms": 1e3 * float(np.mean(ttft)), "ttft_p50_ms": 1e3 * float(np.median(ttft)),
        "ttft_max_ms": 1e3 * float(np.max(ttft)),
        "itl_mean_ms": 1e3 * float(itl.mean()) if itl.size else float("nan"),
        "itl_p50_ms": 1e3 * float(np.median(itl)) if itl.size else float("nan"),
        "generate_seconds": generate_s, "generate_tokens_per_s": clients * args.new / generate_s,
    }


def _second_turn(model: K3Model, args: argparse.Namespace, rng: np.random.Generator, *, cached: bool
                 ) -> tuple[float, float]:
    """(TTFT of a follow-up turn (first prompt + its reply + `--turn` new tokens), the share of its
    prompt found in the prefix cache)."""
    vocab = model.config.vocab_size
    scheduler = Scheduler(model, max_batch=1, max_len=args.turn_prompt + 2 * args.new + args.turn,
                          prefill_chunk=args.chunk, prefix_cache=PrefixCache(args.prefix_cache_mib << 20 if cached else 0))
    ttft = share = 0.0
    for _ in range(2):  # the first pair compiles
        first = rng.integers(0, vocab, (1, args.turn_prompt))
        (reply,), _ = _serve(scheduler, first, args.new)
        follow = np.concatenate([first[0], reply.tokens, rng.integers(0, vocab, args.turn)])[None]
        (second,), _ = _serve(scheduler, follow, args.new)
        assert (second.result.cached_tokens > 0) == cached
        ttft, share = second.stamps[0] - second.submitted, second.result.cached_tokens / follow.shape[1]
    return ttft, share


def _table(results: dict) -> str:
    rows = ["| clients | served tok/s | generate tok/s | served / generate | TTFT p50 ms | TTFT max ms | ITL p50 ms |",
            "|---|---|---|---|---|---|---|"]
    for r in results["levels"]:
        rows.append(f"| {r['clients']} | {r['tokens_per_s']:.1f} | {r['generate_tokens_per_s']:.1f} | "
                    f"{r['tokens_per_s'] / r['generate_tokens_per_s']:.2f} | {r['ttft_p50_ms']:.1f} | "
                    f"{r['ttft_max_ms']:.1f} | {r['itl_p50_ms']:.2f} |")
    turn = results["second_turn"]
    rows.append("")
    cut = 1 - turn["with_prefix_cache_ms"] / turn["without_prefix_cache_ms"]
    rows.append(f"second-turn TTFT ({turn['prompt_tokens']}-token prompt): {turn['with_prefix_cache_ms']:.1f} ms "
                f"with the prefix cache, {turn['without_prefix_cache_ms']:.1f} ms without: cut {cut:.0%}, "
                f"prefix share {turn['prefix_share']:.0%}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/kimi_k3.json")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--clients", default="1,16,64", help="comma-separated concurrency levels")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per client")
    parser.add_argument("--new", type=int, default=128, help="tokens generated per client")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    parser.add_argument("--turn-prompt", type=int, default=4096, help="first prompt of the two-turn chat")
    parser.add_argument("--turn", type=int, default=64, help="new tokens of the second chat turn")
    parser.add_argument("--max-prefill-tokens", type=int,
                        default=inspect.signature(Scheduler).parameters["max_prefill_tokens"].default,
                        help="the engine's bound on one batched admission (rows x padded width)")
    parser.add_argument("--prefix-cache-mib", type=int, default=8192)
    parser.add_argument("--layer-layout", choices=LAYER_LAYOUTS, default="auto",
                        help="as `k3jax serve --layers` (auto: unrolled on GPU/TPU)")
    parser.add_argument("--smoke", action="store_true", help="CPU: the tiny checkpoint, small shapes")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        model = from_pretrained(tiny_checkpoint(), dtype="float32", layers=args.layer_layout)
        args.clients, args.prompt, args.new, args.chunk, args.turn_prompt, args.turn = "1", 12, 4, 16, 20, 5
    else:
        model = K3Model.init(reduced_config(args.config, args.layers, args.experts), seed=0)
        if unrolls(args.layer_layout):
            model.unroll_layers()
    rng = np.random.default_rng(0)
    results = {"device": str(jax.devices()[0]), "layers": model.config.num_hidden_layers,
               "experts": model.config.num_experts, "prompt": args.prompt, "new": args.new, "chunk": args.chunk,
               "max_prefill_tokens": args.max_prefill_tokens, "unrolled": model.group_layers is None, "levels": []}

    def record(part: dict) -> None:
        """Print each part as it finishes and rewrite --out, so a run cut short keeps what it measured."""
        print(json.dumps(part), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    with_cache, share = _second_turn(model, args, rng, cached=True)
    without_cache, _ = _second_turn(model, args, rng, cached=False)
    results["second_turn"] = {
        "first_prompt_tokens": args.turn_prompt, "turn_tokens": args.turn,
        "prompt_tokens": args.turn_prompt + args.new + args.turn, "prefix_share": share,
        "with_prefix_cache_ms": 1e3 * with_cache, "without_prefix_cache_ms": 1e3 * without_cache,
    }
    record(results["second_turn"])
    for clients in args.clients.split(","):
        results["levels"].append(_level(model, int(clients), args, rng))
        record(results["levels"][-1])
    print(_table(results), flush=True)
    return results


if __name__ == "__main__":
    main()

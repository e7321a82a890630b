"""`k3jax serve`: an OpenAI-compatible HTTP server for a checkpoint (Starlette + uvicorn, the `serve` extra).

Under a multi-process launcher (a pod, docs/serving.md) every process loads its shards of the model on
the `--mesh` spanning the job and runs the engine in lockstep (`replicate.py`); process 0 serves HTTP.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

import jax

from k3jax.chat import k3_tokenizer
from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.config import ConfigError, K3Config
from k3jax.memory_plan.command import int_at_least
from k3jax.pretrained import add_layers_argument, from_pretrained
from k3jax.serving.metrics import Metrics
from k3jax.serving.prefix_cache import PrefixCache
from k3jax.serving.replicate import BroadcastChannel, ReplicatedScheduler
from k3jax.serving.scheduler import Scheduler
from k3jax.serving.state import ServerState
from k3jax.tokenizer import load_tokenizer

try:  # the web server is the `serve` extra, not a core dependency: without it, only `serve` fails
    import uvicorn

    from k3jax.serving.app import create_app
except ImportError as err:
    _WEB_SERVER_MISSING: ImportError | None = err
else:
    _WEB_SERVER_MISSING = None

MIB = 1 << 20


def add_serve_command(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument("--model", type=Path, required=True, help="HF release or `k3jax convert` directory")
    serve.add_argument("--mesh", metavar="SPEC", default=None, help="e.g. expert=8,tensor=8 (default: one device)")
    serve.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    add_layers_argument(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int_at_least(0), default=8000)
    serve.add_argument("--max-batch", type=int_at_least(1), default=16, help="requests decoded together (slots)")
    serve.add_argument("--max-len", type=int_at_least(2), default=4096,
                       help="most tokens of one request, prompt + completion")
    serve.add_argument("--prefill-chunk", type=int_at_least(1), default=512,
                       help="prompt tokens run per step between decode steps")
    serve.add_argument("--max-prefill-tokens", type=int_at_least(1), default=8192,
                       help="most tokens (rows x padded width) one step prefills when it admits several "
                            "short fresh prompts together")
    serve.add_argument("--max-queue", type=int_at_least(0), default=1024,
                       help="requests that may wait for a slot; more are refused with 503")
    serve.add_argument("--prefix-cache-mib", type=int_at_least(0), default=1024,
                       help="device memory for prefix-cache snapshots (0: off)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients name (default: the directory name)")


def build_state(args: argparse.Namespace) -> ServerState:
    """Load the checkpoint and build the engine; returns the routes' `ServerState`."""
    config = K3Config.from_hf(args.model / "config.json")
    tokenizer = load_tokenizer(args.model)
    try:
        chat_tokenizer = k3_tokenizer(tokenizer)
    except ValueError as err:
        logging.getLogger(__name__).warning("no chat endpoint: %s", err)
        chat_tokenizer = None
    model = from_pretrained(args.model, dtype=args.dtype, mesh=args.mesh, layers=args.layers)
    engine = dict(max_batch=args.max_batch, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                  max_prefill_tokens=args.max_prefill_tokens, max_queue=args.max_queue,
                  prefix_cache=PrefixCache(args.prefix_cache_mib * MIB),
                  metrics=Metrics(args.max_batch))
    if jax.process_count() > 1:  # a pod: every process runs the engine, the leader's inputs broadcast
        scheduler: Scheduler = ReplicatedScheduler(model, channel=BroadcastChannel(),
                                                   leader=jax.process_index() == 0, **engine)
    else:
        scheduler = Scheduler(model, **engine)
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else config.bos_token_id
    return ServerState(scheduler, tokenizer, chat_tokenizer, args.served_model_name or args.model.resolve().name,
                       config.vocab_size, args.max_len, config.eos_token_id, bos, int(time.time()))


def run_serve_command(args: argparse.Namespace) -> int:
    """Serve until interrupted; a bad checkpoint or a missing web server is a one-line error."""
    if _WEB_SERVER_MISSING is not None:
        print(f"error: `k3jax serve` needs starlette and uvicorn (pip install 'k3jax[serve]'): {_WEB_SERVER_MISSING}",
              file=sys.stderr)
        return 1
    if jax.process_count() > 1 and args.mesh is None:
        print(f"error: this is one of {jax.process_count()} processes; serving from several processes needs "
              "--mesh SPEC (the model sharded over every process's devices), or run it as one process",
              file=sys.stderr)
        return 2
    try:
        state = build_state(args)
    except (CheckpointError, ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if jax.process_index() > 0:
        return _follow(state.scheduler)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level="info")
    return 0


def _follow(scheduler: ReplicatedScheduler) -> int:
    """A follower of a pod: run the engine until the leader's stop reaches it (0) or the pod breaks (1).
    SIGINT and SIGTERM do not end it: the leader drains first, then its stop ends every process."""
    print(f"process {jax.process_index()} of {jax.process_count()}: following the leader (process 0, which "
          "serves HTTP); running the engine", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    scheduler.start()
    while True:
        try:
            scheduler.join()
            break
        except KeyboardInterrupt:
            print(f"process {jax.process_index()}: interrupted; it stops when the leader does", file=sys.stderr,
                  flush=True)
    if scheduler.failed is not None:
        print(f"error: the pod's engine stopped: {scheduler.failed}", file=sys.stderr)
        return 1
    return 0

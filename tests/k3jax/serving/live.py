"""A live server on the tiny golden model for the serving tests: uvicorn in a thread on a free port."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import uvicorn

from k3jax.serving.app import create_app
from k3jax.serving.command import build_state
from k3jax.serving.state import ServerState
from tests.local_job import free_port


class LiveServer:
    """`k3jax serve` in this process: start() returns once /health answers; stop() drains and joins."""

    def __init__(self, model_dir: Path, **flags) -> None:
        args = argparse.Namespace(model=model_dir, mesh=None, dtype="float32", layers="unrolled", max_batch=8, max_len=512,
                                  prefill_chunk=64, max_prefill_tokens=8192, max_queue=1024, prefix_cache_mib=64,
                                  served_model_name="tiny")
        for key, value in flags.items():
            setattr(args, key, value)
        self.state: ServerState = build_state(args)
        self.port = free_port()
        config = uvicorn.Config(create_app(self.state), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 120) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

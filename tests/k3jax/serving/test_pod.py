"""A pod of two processes serves k3-tiny-a (fp32): `k3jax serve --mesh` under a localhost coordinator.

Each process has 4 CPU devices (JAX_NUM_CPU_DEVICES) and joins the job through the K3JAX_* variables; the
mesh spans all 8, so every engine step runs on both processes. Concurrent greedy completions sent to the
leader must be the tokens `k3jax.generate` gives in this process; after SIGINT to the leader, both
processes must exit 0 (the leader's stop reaches the follower).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

import k3jax
from tests.conftest import GOLDEN_DIR
from tests.local_job import free_port, job_logs, start_local_job

MESH = "expert=4,tensor=2"
NEW = 5
PROMPT_LENGTH = 9


def _start_pod(http_port: int, log_dir: Path) -> list[subprocess.Popen]:
    return start_local_job([sys.executable, "-m", "k3jax", "serve", "--model", str(GOLDEN_DIR), "--mesh", MESH,
                            "--dtype", "float32", "--port", str(http_port), "--max-batch", "4", "--max-len", "64",
                            "--prefill-chunk", "16", "--prefix-cache-mib", "16"], log_dir)


def _wait_healthy(url: str, procs: list[subprocess.Popen], seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return  # a process ended early: the exit checks below show its log
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the pod's leader did not answer /health")


@pytest.mark.slow
def test_a_two_process_pod_serves_the_single_process_tokens(golden_model_fp32, tmp_path):
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, 256, (3, PROMPT_LENGTH)).tolist()
    http_port = free_port()
    url = f"http://127.0.0.1:{http_port}"
    procs = _start_pod(http_port, tmp_path)
    try:
        # the reference, while the pod loads: rows of one batch compute what each prompt computes alone
        expected = np.asarray(k3jax.generate(golden_model_fp32, np.asarray(prompts, np.int32),
                                             max_new_tokens=NEW)).tolist()
        _wait_healthy(url, procs)

        def complete(prompt: list[int]) -> list[int]:
            body = {"model": "k3-tiny-a", "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(complete, prompts))
        assert served == expected
        procs[0].send_signal(signal.SIGINT)
        logs = job_logs(procs, tmp_path, timeout=120)
    finally:
        for p in procs:
            p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {rank} exited {p.returncode}:\n{log[-3000:]}"
    assert "process 1 of 2: following the leader" in logs[1]

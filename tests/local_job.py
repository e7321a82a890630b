"""A multi-process JAX job on localhost for tests: N CPU processes joined through the K3JAX_* variables."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_job(command: list[str], log_dir: Path, *, processes: int = 2,
                    devices_per_process: int = 4) -> list[subprocess.Popen]:
    """`command` once per process, each with `devices_per_process` CPU devices (JAX_NUM_CPU_DEVICES) and
    the repository importable, coordinated on a free localhost port.

    Each process writes its stdout and stderr to `log_dir`/process-RANK.log (`job_logs` reads them), not
    to a pipe: a pipe that nobody reads while the job runs fills up (64 KiB) and blocks the process
    writing to it, and with it every process waiting on it in a collective."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices_per_process),
           "K3JAX_COORDINATOR_ADDRESS": f"localhost:{free_port()}", "K3JAX_NUM_PROCESSES": str(processes)}
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(processes):
        with open(log_dir / f"process-{rank}.log", "w") as log:  # the child keeps its own handle
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                          env={**env, "K3JAX_PROCESS_ID": str(rank)}))
    return procs


def job_logs(procs: list[subprocess.Popen], log_dir: Path, timeout: float) -> list[str]:
    """Wait for every process (at most `timeout` seconds each), then each one's output."""
    for proc in procs:
        proc.wait(timeout=timeout)
    return [(log_dir / f"process-{rank}.log").read_text() for rank in range(len(procs))]

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


def start_local_job(command: list[str], *, processes: int = 2, devices_per_process: int = 4) -> list[subprocess.Popen]:
    """`command` once per process (stdout and stderr merged, text), each with `devices_per_process` CPU
    devices (JAX_NUM_CPU_DEVICES) and the repository importable, coordinated on a free localhost port."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices_per_process),
           "K3JAX_COORDINATOR_ADDRESS": f"localhost:{free_port()}", "K3JAX_NUM_PROCESSES": str(processes)}
    return [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**env, "K3JAX_PROCESS_ID": str(rank)}) for rank in range(processes)]

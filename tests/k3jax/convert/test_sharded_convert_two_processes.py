"""Two JAX processes convert one release jointly: `k3jax convert --mesh` under a localhost coordinator.

Each process has 4 CPU devices (JAX_NUM_CPU_DEVICES) and joins the job through the K3JAX_* variables
(`k3jax.distributed.initialize`); cross-process collectives on CPU go through gloo, JAX's default.
The mesh spans all 8 devices, so each process reads and writes half of every expert leaf, and
checksums need the all-gather path. The result must be the single-host conversion, and a single process
`--resume --verify` (verification reads everything back, so it is not a multi-process step) passes on it.
"""

from __future__ import annotations

import json

import jax
import numpy as np

import k3jax
from k3jax.checkpoint.store import COMPLETE, ITEMS, MANIFEST
from k3jax.cli import main
from tests.k3jax.convert.conftest import k3jax_command
from tests.local_job import job_logs, start_local_job

MESH = "expert=4,tensor=2"


def test_two_processes_write_the_single_host_conversion(tmp_path, golden_dir, converted_fp32):
    out = tmp_path / "out"
    procs = start_local_job(k3jax_command("convert", golden_dir, out, "--dtype", "float32", "--mesh", MESH, "--quiet"),
                            tmp_path / "logs")
    try:
        logs = job_logs(procs, tmp_path / "logs", timeout=600)
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"process {rank} failed:\n{log[-3000:]}"
    assert (out / COMPLETE).is_file()
    assert all((item / "ocdbt.process_1").is_dir() for item in (out / ITEMS).iterdir())  # every process took part in every save
    written = json.loads((out / MANIFEST).read_text())["items"]
    assert written == json.loads((converted_fp32 / MANIFEST).read_text())["items"]
    assert main(["convert", str(golden_dir), str(out), "--dtype", "float32", "--resume", "--verify", "--quiet"]) == 0
    # written by two processes, restored by one onto another layout of 8 devices
    restored = k3jax.from_pretrained(out, dtype="float32", mesh="expert=2,tensor=2,data=2")
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(k3jax.from_pretrained(converted_fp32, dtype="float32"))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

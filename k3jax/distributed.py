"""Multi-host start-up: `initialize()` joins this process to the job, `log_from_process_zero()` keeps
logs readable.

Why a wrapper around `jax.distributed.initialize()`: the same script must run unchanged on a laptop
(one process, where initialising would wait for a coordinator that never comes), under SLURM on a GPU
cluster and on a TPU pod slice. JAX's own cluster detection already covers SLURM (SLURM_JOB_ID,
SLURM_NTASKS, ...), TPU pod VMs (the TPU metadata server), Open MPI and Kubernetes/GKE; explicit
variables override it for anything else:

    K3JAX_COORDINATOR_ADDRESS=host:port  K3JAX_NUM_PROCESSES=N  K3JAX_PROCESS_ID=i  [K3JAX_LOCAL_DEVICE_IDS=0,1]

(JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID are read too; K3JAX_DISTRIBUTED=0 opts out.)
With none of these, no multi-process launcher and no TPU chips, `initialize()` does nothing. It must run before anything
touches `jax.devices()`; after it, `sharding.make_mesh` spans every process's devices. See
docs/multihost.md for launch scripts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import jax

_PREFIXES = ("K3JAX_", "JAX_")


def _env(env: Mapping[str, str], name: str) -> str | None:
    for prefix in _PREFIXES:
        value = env.get(prefix + name)
        if value:
            return value
    return None


def _detected_cluster(env: Mapping[str, str]) -> str | None:
    """The multi-process launcher visible in `env`, or None for a plain single process.

    Cheap environment checks only (no metadata-server requests), so a laptop run never blocks:
    SLURM with more than one task, a TPU pod VM with several workers, Open MPI with more than one rank.
    """
    if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1"))) > 1:
        return "slurm"
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or env.get("MEGASCALE_COORDINATOR_ADDRESS") or _on_tpu_vm():
        return "tpu"  # a TPU VM: JAX reads the worker count and id from its metadata (1 worker is fine too)
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "mpi"
    return None


def _on_tpu_vm() -> bool:
    """TPU chips on this host (the device files a Cloud TPU VM has). GCE TPU VMs set no worker variables:
    JAX finds the slice's workers through the metadata server, so the chips are the cue to ask it."""
    return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")


def initialize(env: Mapping[str, str] | None = None) -> bool:
    """Join the multi-process job described by the environment; True if `jax.distributed` was initialised.

    Explicit K3JAX_*/JAX_* variables win; else JAX's auto-detection runs when a launcher is visible
    (SLURM, TPU pod, MPI); else this is a single process and nothing happens. Safe to call twice.
    """
    env = os.environ if env is None else env
    if env.get("K3JAX_DISTRIBUTED", "").lower() in ("0", "off", "false"):
        return False  # opt out, e.g. several independent single-host jobs under one SLURM allocation
    if jax.distributed.is_initialized():
        return True
    address, count, index = (_env(env, k) for k in ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID"))
    local = _env(env, "LOCAL_DEVICE_IDS")
    if address or count or index:
        if count is not None and int(count) == 1:
            return False  # an explicit single-process job: nothing to join
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=int(count) if count is not None else None,
            process_id=int(index) if index is not None else None,
            local_device_ids=[int(i) for i in local.split(",")] if local else None,
        )
        return True
    if _detected_cluster(env) is not None:
        jax.distributed.initialize()  # JAX fills address, count and id from the cluster
        return True
    return False


class ProcessZeroFilter(logging.Filter):
    """Drop records on every process but 0: N hosts would otherwise print every line N times.

    Reads `jax.process_index()` per record (cheap, and correct even if the filter is installed before
    `initialize()`). A record with `extra={"all_processes": True}` passes everywhere (per-host errors).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "all_processes", False) or jax.process_index() == 0


def log_from_process_zero(level: int = logging.INFO, logger: logging.Logger | None = None) -> logging.Logger:
    """Configure `logger` (default: the root logger) to log at `level` with the process index in each
    line, through a handler that only lets process 0's records out. Returns the logger."""
    logger = logger or logging.getLogger()
    logger.setLevel(level)
    if not any(isinstance(f, ProcessZeroFilter) for h in logger.handlers for f in h.filters):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s [p%(process_index)s] %(name)s: %(message)s"))
        handler.addFilter(_ProcessIndex())
        handler.addFilter(ProcessZeroFilter())
        logger.addHandler(handler)
    return logger


class _ProcessIndex(logging.Filter):
    """Adds `process_index` to every record for the formatter (never drops anything)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.process_index = jax.process_index()
        return True

"""Fake CPU devices shaped like the planned mesh.

Compiling for a mesh needs as many devices as it has, and a CPU backend gets its device count once,
when JAX creates it: `ensure_cpu_devices` must run before anything asks JAX for devices (the
`k3jax plan` command calls it first thing). In a process whose backend already exists it raises and
says to run a fresh one or set XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""

from __future__ import annotations

import jax


def ensure_cpu_devices(n: int) -> None:
    """Make this process's JAX backend CPU with at least `n` devices; must run before JAX initialises."""
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as err:  # the backend already exists
        if len(jax.devices()) < n:
            raise RuntimeError(
                f"the mesh needs {n} devices but JAX is already initialised with {len(jax.devices())}; run the "
                f"planner in a fresh process or set XLA_FLAGS=--xla_force_host_platform_device_count={n}"
            ) from err
    if len(jax.devices()) < n:
        raise RuntimeError(f"asked for {n} CPU devices, JAX has {len(jax.devices())}")

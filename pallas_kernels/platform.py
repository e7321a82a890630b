"""The one place that reads which platform the kernels are being built for.

Kernel dispatch needs to know "cpu", "gpu" or "tpu". Normally that is JAX's default backend, but
lowering for a device one does not own (an abstract H200 while planning memory or checking that a
kernel lowers, on a CPU-only machine) needs the choice made as if for that device: `target`
states it for a block of code, so nothing has to patch JAX.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Literal

import jax

Platform = Literal["cpu", "gpu", "tpu"]
PLATFORMS: tuple[Platform, ...] = ("cpu", "gpu", "tpu")

_target = threading.local()


def current_platform() -> Platform:
    """The platform kernels are chosen for: the innermost `target`, else JAX's default backend."""
    stated = getattr(_target, "platform", None)
    if stated is not None:
        return stated
    backend = jax.default_backend()
    if backend in ("cuda", "rocm"):
        return "gpu"
    if backend not in PLATFORMS:
        raise NotImplementedError(f"JAX backend {backend!r}: k3jax kernels know only {PLATFORMS}")
    return backend


@contextlib.contextmanager
def target(platform: Platform) -> Iterator[None]:
    """Choose kernels as if running on `platform` inside this block (lowering for another device)."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform: expected one of {PLATFORMS}, got {platform!r}")
    previous = getattr(_target, "platform", None)
    _target.platform = platform
    try:
        yield
    finally:
        _target.platform = previous

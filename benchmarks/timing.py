"""Wall-clock timing of jitted JAX calls, shared by the benchmark scripts (`from benchmarks.timing
import median_ms` with the repository root on PYTHONPATH)."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax


def samples_ms(fn: Callable, *args, reps: int = 7, inner: int = 1, warmups: int = 1) -> list[float]:
    """Milliseconds per call of ``fn(*args)``, sorted: after ``warmups`` untimed calls (the first
    compiles), ``reps`` samples, each the mean of ``inner`` back-to-back calls ended by one
    ``block_until_ready``."""
    for _ in range(warmups):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / inner * 1e3)
    return sorted(samples)


def median_ms(fn: Callable, *args, reps: int = 7, inner: int = 1, warmups: int = 1) -> float:
    """The upper median of ``samples_ms`` (a real sample when ``reps`` is even)."""
    samples = samples_ms(fn, *args, reps=reps, inner=inner, warmups=warmups)
    return samples[len(samples) // 2]

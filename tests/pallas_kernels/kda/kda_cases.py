"""K3-like KDA inputs shared by the kernel tests: unit q/k, a gate in (lower_bound, 0) with many
steps near the bound (where the safe-gate factorisation is tightest), beta in (0, 1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def kda_case(
    rng: np.random.Generator, batch: int, T: int, H: int, K: int, V: int, lower_bound: float = -5.0,
    states: int | None = None, gate_spread: float = 2.0, state_scale: float = 0.5,
) -> dict[str, np.ndarray]:
    """q, k [batch, T, H, K] unit rows; v [batch, T, H, V]; g = lower_bound sigmoid(gate_spread x),
    beta; s0 [states, H, K, V] scaled by state_scale (numpy; states defaults to batch, packed
    sequences pass their count)."""
    q = rng.standard_normal((batch, T, H, K))
    k = rng.standard_normal((batch, T, H, K))
    return dict(
        q=q / np.linalg.norm(q, axis=-1, keepdims=True),
        k=k / np.linalg.norm(k, axis=-1, keepdims=True),
        v=rng.standard_normal((batch, T, H, V)),
        g=lower_bound * _sigmoid(gate_spread * rng.standard_normal((batch, T, H, K))),
        beta=_sigmoid(rng.standard_normal((batch, T, H))),
        s0=state_scale * rng.standard_normal((batch if states is None else states, H, K, V)),
    )


def as_f32(x: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {n: jnp.asarray(a, jnp.float32) for n, a in x.items()}


def rel(a: jax.Array, b: jax.Array, floor: float = 1e-30) -> float:
    """Relative L2 error ||a - b|| / max(||b||, floor)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor))


"""The KDA forward's inter stage split along time, for few (sequence, head) pairs.

The inter stage is a serial loop over chunks, one CTA per (sequence, head, value block). With few
sequence-heads (K3's B1 T32768 H16: 32 CTAs on 132 SMs, each walking 512 chunks) the loop's
latency is the forward's critical path. The state recurrence is affine in the state,
``S_end = A S_start + B`` over any chunk range, so the sequence can be cut into ``n`` segments
that run side by side:

1. every segment's recurrence alone (``inter.states_mgpu``) from ``[s | I]``: the state's columns
   from a start ``s`` (the initial state for the first segment, zero for the others) and K more
   from the identity, which the chunks carry through without v. It gives ``[A_j s + B_j | A_j]``:
   the segment's state from zero and its [K, K] transition matrix;
2. the segments' start states in order, ``S_{j+1} = A_j S_j + B_j`` (n - 2 small IEEE fp32 XLA
   products: the first segment's pass already started from the initial state; one Pallas-Triton
   kernel for the chain was much slower);
3. every segment again from its own start state, now forming o (``inter.inter_mgpu``); the last
   segment's final state is the sequence's.

Three passes do about 2.5 times the serial stage's work, in ``n`` times the parallelism (timings
in benchmarks/RESULTS.md; the number of segments: ``gpu_config.segments_for``). Each segment is a
batch row of the same arrays ([B, n T', ...] read as [B n, T', ...], no copy), so the passes are
the Mosaic GPU inter kernels unchanged. The caller pads T to whole segments with identity steps
(k = v = beta = 0, no decay).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda.chunk_math import C
from pallas_kernels.kda.mosaic_gpu.inter import inter_mgpu, states_mgpu

_F32 = jnp.float32


def _as_segments(x: jax.Array, n: int) -> jax.Array:
    """[B, n L, ...] -> [B n, L, ...]: segment j of row b is row ``b n + j`` (no copy)."""
    return x.reshape(x.shape[0] * n, x.shape[1] // n, *x.shape[2:])


def _start_states(ends: jax.Array, h0: jax.Array) -> jax.Array:
    """Every segment's start state [B, n, H, K, V] from pass 1's ``ends`` [B, n, H, K, V + K]
    (``[A_j s + B_j | A_j]``, s = h0 for the first segment, zero for the others)."""
    V = h0.shape[-1]
    starts = [h0, ends[:, 0, ..., :V]]
    for j in range(1, ends.shape[1] - 1):
        A, B = ends[:, j, ..., V:], ends[:, j, ..., :V]
        starts.append(jnp.einsum("bhkj,bhjv->bhkv", A, starts[-1],
                                 precision=lax.Precision.HIGHEST) + B)
    return jnp.stack(starts, axis=1)


def inter_segments(x, bk, v, beta, qg, kd, aqk, gl, h0, *, segments: int, fused: bool,
                   interpret: bool) -> tuple[jax.Array, jax.Array]:
    """``(o, final state)`` of the fused inter stage (``inter_mgpu``'s inputs and outputs) in
    ``segments`` segments per sequence; Tp a multiple of ``64 segments``."""
    B, Tp, H, K = bk.shape
    V, n = v.shape[-1], segments
    if n < 2 or Tp % (C * n):
        raise ValueError(f"inter_segments: segments={n} must be at least 2 and divide the "
                         f"{Tp // C} chunks of bk {bk.shape}")
    seg = lambda *xs: [_as_segments(t, n) for t in xs]  # noqa: E731
    x, bk, v, beta, qg, kd, aqk, gl = seg(x, bk, v, beta, qg, kd, aqk, gl)
    first = jnp.zeros((B, n, H, K, V), _F32).at[:, 0].set(h0.astype(_F32))
    eye = jnp.broadcast_to(jnp.eye(K, dtype=_F32), (B, n, H, K, K))
    per_segment = lambda s: s.reshape(B * n, H, K, s.shape[-1])  # noqa: E731
    ends = states_mgpu(x, bk, v, beta, kd, gl, per_segment(jnp.concatenate([first, eye], -1)),
                       fused=fused, interpret=interpret)
    starts = _start_states(ends.reshape(B, n, H, K, V + K), h0.astype(_F32))
    o, ht = inter_mgpu(x, bk, v, beta, qg, kd, aqk, gl, per_segment(starts), fused=fused,
                       interpret=interpret)
    return o.reshape(B, Tp, H, V), ht.reshape(B, n, H, K, V)[:, -1]

"""Chunked KDA on each implementation as a differentiable op: the forward with the backward that
belongs to the op, and the runners that ``dispatch.py``'s table names.

A runner takes either pre-activated inputs (``gate=None``) or K3's raw ones with their activation
parameters (``gate=Gate(A_log, dt_bias, lower_bound)``; ``reference.activate``), so one table
serves ``api.chunk_kda`` and ``api.chunk_kda_fused``:

* "xla": the activations and the exact chunked reference in XLA, differentiated by JAX.
* "pallas_gpu": the GPU forward (``gpu_pipeline``, the activations fused into its intra stage
  when given) with a custom VJP: the forward keeps the inputs and each chunk's ``(I + L)^{-1}``
  and ``Aqk`` (64 values each per token and head, in the inputs' dtype, as fla's backward keeps
  them); the backward recomputes the activations in XLA (cheap elementwise ops), runs the
  analytic GPU backward (``gpu_backward``) on the activated inputs and pulls its gradients back
  through the activations.
* "mosaic_tpu": the activations in XLA, the Mosaic TPU forward (TPU interpret mode off TPU), and
  the VJP of the exact chunked reference (recomputed from the inputs): there is no TPU backward
  kernel yet.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.kda.gpu_backward import gpu_chunk_kda_bwd
from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda, gpu_chunk_kda_fused
from pallas_kernels.kda.mosaic_tpu.chunk import tpu_chunk_kda
from pallas_kernels.kda.reference import activate, chunked_kda, host_offsets

_F32 = jnp.float32
Offsets = tuple[int, ...] | None  # packed sequences' offsets, hashable (a static argument)


class Gate(NamedTuple):
    """The activation parameters of K3's raw inputs (``reference.activate``)."""

    A_log: jax.Array
    dt_bias: jax.Array
    lower_bound: float


# ---- pallas_gpu -------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _gpu(q, k, v, g, beta, s0, scale: float, offsets: Offsets):
    return gpu_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=s0, cu_seqlens=offsets)


def _gpu_fwd(q, k, v, g, beta, s0, scale, offsets):
    o, state, intra = gpu_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=s0,
                                    cu_seqlens=offsets, return_intra=True)
    return (o, state), ((q, k, v, g, beta, s0), intra)


def _gpu_bwd(scale, offsets, residuals, cotangents):
    inputs, intra = residuals
    return gpu_chunk_kda_bwd(*inputs, *cotangents, scale=scale, cu_seqlens=offsets,
                             intra=intra)


_gpu.defvjp(_gpu_fwd, _gpu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _gpu_fused(q_raw, k_raw, v, g_raw, beta_logits, A_log, dt_bias, s0, lower_bound: float,
               scale: float, offsets: Offsets):
    return gpu_chunk_kda_fused(q_raw, k_raw, v, g_raw, beta_logits, A_log, dt_bias,
                               lower_bound=lower_bound, scale=scale, initial_state=s0,
                               cu_seqlens=offsets)


def _gpu_fused_fwd(q_raw, k_raw, v, g_raw, beta_logits, A_log, dt_bias, s0, lower_bound, scale,
                   offsets):
    o, state, intra = gpu_chunk_kda_fused(
        q_raw, k_raw, v, g_raw, beta_logits, A_log, dt_bias, lower_bound=lower_bound,
        scale=scale, initial_state=s0, cu_seqlens=offsets, return_intra=True)
    return (o, state), ((q_raw, k_raw, v, g_raw, beta_logits, A_log, dt_bias, s0), intra)


def _gpu_fused_bwd(lower_bound, scale, offsets, residuals, cotangents):
    (q_raw, k_raw, v, g_raw, beta_logits, A_log, dt_bias, s0), intra = residuals
    activated, pull_back = jax.vjp(
        functools.partial(activate, lower_bound=lower_bound),
        q_raw, k_raw, g_raw, beta_logits, A_log, dt_bias)
    q, k, g, beta = activated
    dq, dk, dv, dg, dbeta, ds0 = gpu_chunk_kda_bwd(q, k, v, g, beta, s0, *cotangents, scale=scale,
                                                   cu_seqlens=offsets, intra=intra)
    dq_raw, dk_raw, dg_raw, dlogits, dA_log, ddt_bias = pull_back((dq, dk, dg, dbeta))
    return dq_raw, dk_raw, dv, dg_raw, dlogits, dA_log, ddt_bias, ds0


_gpu_fused.defvjp(_gpu_fused_fwd, _gpu_fused_bwd)


# ---- mosaic_tpu -------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _tpu(q, k, v, g, beta, s0, scale: float, offsets: Offsets):
    return tpu_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=s0, cu_seqlens=offsets)


def _tpu_fwd(q, k, v, g, beta, s0, scale, offsets):
    out = tpu_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=s0, cu_seqlens=offsets)
    return out, (q, k, v, g, beta, s0)


def _tpu_bwd(scale, offsets, inputs, cotangents):
    reference = lambda q, k, v, g, beta, s0: chunked_kda(  # noqa: E731
        q, k, v, g, beta, scale=scale, initial_state=s0, cu_seqlens=offsets)
    _, vjp = jax.vjp(reference, *inputs)
    return vjp(cotangents)


_tpu.defvjp(_tpu_fwd, _tpu_bwd)


# ---- runners ----------------------------------------------------------------------------------

def _prepared(q, v, initial_state, cu_seqlens) -> tuple[jax.Array, Offsets]:
    """A zero initial state when none is given, and the packed offsets as a hashable tuple."""
    offsets = None
    if cu_seqlens is not None:
        offsets = tuple(int(o) for o in host_offsets(cu_seqlens, q.shape[1]))
    n_states = q.shape[0] if offsets is None else len(offsets) - 1
    if initial_state is None:
        initial_state = jnp.zeros((n_states, q.shape[2], q.shape[3], v.shape[3]), _F32)
    return initial_state, offsets


def run_xla(q, k, v, g, beta, gate: Gate | None, *, scale, initial_state, cu_seqlens,
            segment_ids=None):
    if gate is not None:
        q, k, g, beta = activate(q, k, g, beta, gate.A_log, gate.dt_bias,
                                 lower_bound=gate.lower_bound)
    return chunked_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       cu_seqlens=cu_seqlens, segment_ids=segment_ids)


def run_pallas_gpu(q, k, v, g, beta, gate: Gate | None, *, scale, initial_state, cu_seqlens):
    s0, offsets = _prepared(q, v, initial_state, cu_seqlens)
    if gate is None:
        return _gpu(q, k, v, g, beta, s0, scale, offsets)
    return _gpu_fused(q, k, v, g, beta, gate.A_log, gate.dt_bias, s0, float(gate.lower_bound),
                      scale, offsets)


def run_mosaic_tpu(q, k, v, g, beta, gate: Gate | None, *, scale, initial_state, cu_seqlens):
    if gate is not None:
        q, k, g, beta = activate(q, k, g, beta, gate.A_log, gate.dt_bias,
                                 lower_bound=gate.lower_bound)
    s0, offsets = _prepared(q, v, initial_state, cu_seqlens)
    return _tpu(q, k, v, g, beta, s0, scale, offsets)

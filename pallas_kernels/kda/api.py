"""Public KDA entry points: input validation and implementation dispatch.

Conventions follow fla's ``chunk_kda`` with a pre-activated gate (see ``reference.py``).
``implementation="pallas"`` runs the safe-gate Pallas kernel (``pallas_kda.py``; Triton lowering
on GPU, interpret mode on CPU); it needs ``lower_bound`` in [-5, 0), the caller's promise that
every ``g >= lower_bound`` (K3's gate); packed ``cu_seqlens`` are supported. ``"auto"`` picks it
only on GPU when those hold (verified on an H200, 2026-11-29, before packed sequences were added:
``benchmarks/kda_varlen_h200.py`` checks those) and the XLA reference elsewhere. On TPU,
``"pallas"`` runs the Mosaic TPU chunk kernel (``pallas_mosaic_tpu_chunk.py``), which has so far
run only in TPU interpret mode, so ``"auto"`` keeps the XLA reference there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels.kda.pallas_decode import gpu_supported as _decode_gpu_supported
from pallas_kernels.kda.pallas_decode import pallas_kda_decode
from pallas_kernels.kda.pallas_kda import LOWER_BOUND_MIN, pallas_chunk_kda
from pallas_kernels.kda.pallas_kda_bwd import pallas_chunk_kda_bwd
from pallas_kernels.kda.pallas_mosaic_tpu import tpu_kda_decode
from pallas_kernels.kda.pallas_mosaic_tpu_chunk import tpu_chunk_kda
from pallas_kernels.kda.reference import chunked_kda, host_offsets, recurrent_kda_step

Implementation = Literal["auto", "xla", "pallas"]
_IMPLEMENTATIONS = ("auto", "xla", "pallas")


def _expect_rank(name: str, x: jax.Array, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {tuple(x.shape)}")


def _expect_shape(name: str, x: jax.Array, expected: tuple[int, ...], layout: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected} {layout}, got {tuple(x.shape)}")


def _expect_state(name: str, x: jax.Array, expected: tuple[int, ...], layout: str) -> None:
    _expect_shape(name, x, expected, layout)
    if x.dtype != jnp.float32:
        raise ValueError(f"{name}: expected dtype float32 (states are kept in fp32), got {x.dtype}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _pallas_kda_differentiable(q, k, v, g, beta, initial_state, scale, cu_seqlens):
    """The Pallas forward, differentiable: gradients for q, k, v, g, beta and the initial state
    from the analytic Pallas backward (``pallas_kda_bwd.py``), packed sequences included. The
    forward keeps each chunk's ``(I + L)^{-1}`` and ``Aqk`` (64 values each per token and head,
    in the inputs' dtype, as fla's backward keeps them) so the backward recomputes only the
    cheap rest of the intra stage."""
    return pallas_chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )


def _pallas_kda_fwd(q, k, v, g, beta, initial_state, scale, cu_seqlens):
    o, final_state, intra = pallas_chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        return_intra=True,
    )
    return (o, final_state), ((q, k, v, g, beta, initial_state), intra)


def _pallas_kda_bwd(scale, cu_seqlens, residuals, cotangents):
    inputs, intra = residuals
    return pallas_chunk_kda_bwd(*inputs, *cotangents, scale=scale, cu_seqlens=cu_seqlens,
                                intra=intra)


_pallas_kda_differentiable.defvjp(_pallas_kda_fwd, _pallas_kda_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _tpu_kda_with_reference_vjp(q, k, v, g, beta, initial_state, scale, cu_seqlens):
    """The Mosaic TPU forward, differentiable through the VJP of the exact chunked reference
    (recomputed from the inputs): there is no TPU backward kernel yet."""
    return tpu_chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )


def _tpu_kda_fwd(q, k, v, g, beta, initial_state, scale, cu_seqlens):
    out = tpu_chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    return out, (q, k, v, g, beta, initial_state)


def _tpu_kda_bwd(scale, cu_seqlens, inputs, cotangents):
    reference = lambda q, k, v, g, beta, s0: chunked_kda(  # noqa: E731
        q, k, v, g, beta, scale=scale, initial_state=s0, cu_seqlens=cu_seqlens
    )
    _, vjp = jax.vjp(reference, *inputs)
    return vjp(cotangents)


_tpu_kda_with_reference_vjp.defvjp(_tpu_kda_fwd, _tpu_kda_bwd)


def _run_differentiable(
    differentiable: Callable[..., tuple[jax.Array, jax.Array]],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float,
    initial_state: jax.Array | None,
    cu_seqlens: object | None,
) -> tuple[jax.Array, jax.Array]:
    """Call a kernel's custom VJP with a zero initial state when none is given and the packed
    offsets as a hashable tuple (its non-differentiable argument)."""
    offsets = None
    if cu_seqlens is not None:
        offsets = tuple(int(o) for o in host_offsets(cu_seqlens, q.shape[1]))
    n_states = q.shape[0] if offsets is None else len(offsets) - 1
    if initial_state is None:
        initial_state = jnp.zeros((n_states, q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
    return differentiable(q, k, v, g, beta, initial_state, scale, offsets)


_pallas_op = functools.partial(_run_differentiable, _pallas_kda_differentiable)
_tpu_op = functools.partial(_run_differentiable, _tpu_kda_with_reference_vjp)


def _safe_gate(lower_bound: float | None) -> bool:
    return lower_bound is not None and LOWER_BOUND_MIN <= lower_bound < 0


def _select(
    implementation: str, lower_bound: float | None = None
) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """Pick the operator: Pallas needs the safe gate and (for "auto") a GPU; on TPU "pallas" is
    the Mosaic TPU kernel, which "auto" does not pick before it has run on TPU hardware."""
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation: expected one of {_IMPLEMENTATIONS}, got {implementation!r}"
        )
    backend = jax.default_backend()
    if implementation == "pallas":
        if backend not in ("gpu", "cpu", "tpu"):
            raise NotImplementedError(
                f"implementation='pallas': the Pallas KDA kernels are Triton (GPU; interpret mode "
                f"on CPU) and Mosaic TPU, none exists for {backend!r}; use 'xla' or 'auto'."
            )
        if not _safe_gate(lower_bound):
            raise NotImplementedError(
                "implementation='pallas': no Pallas KDA kernel for an unbounded gate; pass "
                "lower_bound in [-5, 0) (the safe gate: every g >= lower_bound) or use 'xla' / "
                f"'auto' (got lower_bound={lower_bound!r})."
            )
        return _tpu_op if backend == "tpu" else _pallas_op
    if implementation == "auto" and backend == "gpu" and _safe_gate(lower_bound):
        return _pallas_op
    return chunked_kda


def chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: object | None = None,
    implementation: Implementation = "auto",
    lower_bound: float | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Chunked KDA over a sequence (prefill / training).

    q, k [B, T, H, K] L2-normalised; v [B, T, H, V]; g [B, T, H, K] log-decay <= 0;
    beta [B, T, H]; initial_state fp32 [B, H, K, V] (or [N, H, K, V] with ``cu_seqlens``,
    host int offsets [N + 1] of packed sequences, B == 1); scale defaults to K**-0.5.
    Returns ``(o [B, T, H, V] in v.dtype, final state fp32 or None)``.
    ``lower_bound`` (K3: -5.0) declares ``g >= lower_bound`` everywhere (the safe gate); it is
    what allows ``implementation="pallas"`` (and "auto" to pick it on GPU). It is not checked
    against the traced ``g``; a violating gate can overflow the kernel's midpoint factorisation.
    Differentiable on every path; under ``jax.grad`` the Pallas path keeps, besides the inputs,
    each chunk's ``(I + L)^{-1}`` and ``Aqk`` from the forward (2 x 64 values per token and head
    in the inputs' dtype) for its backward.
    """
    _expect_rank("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    _expect_shape("k", k, (B, T, H, K), "[B, T, H, K] like q")
    _expect_rank("v", v, 4, "[B, T, H, V]")
    V = v.shape[3]
    _expect_shape("v", v, (B, T, H, V), "[B, T, H, V] matching q's B, T, H")
    _expect_shape("g", g, (B, T, H, K), "[B, T, H, K] like q")
    _expect_shape("beta", beta, (B, T, H), "[B, T, H]")
    n_states = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B == 1, got q shape {q.shape}")
        n_states = host_offsets(cu_seqlens, T).size - 1
    if initial_state is not None:
        layout = "[B, H, K, V]" if cu_seqlens is None else "[N, H, K, V], N = len(cu_seqlens) - 1"
        _expect_state("initial_state", initial_state, (n_states, H, K, V), layout)
    op = _select(implementation, lower_bound)
    o, state = op(
        q,
        k,
        v,
        g,
        beta,
        scale=K**-0.5 if scale is None else scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
    )
    return o, (state if output_final_state else None)


def kda_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float | None = None,
    implementation: Implementation = "auto",
) -> tuple[jax.Array, jax.Array]:
    """One recurrent decode step: q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state fp32.

    Returns ``(o [B, H, V] in v.dtype, new_state fp32 [B, H, K, V])``.
    ``implementation="pallas"`` runs the state-streaming Pallas kernel (``pallas_decode.py``;
    Triton on GPU, interpret mode on CPU; ``pallas_mosaic_tpu.py`` on TPU, which has so far run only
    in TPU interpret mode, so "auto" does not pick it); ``"auto"`` picks it only on GPU with K and V powers of
    two >= 16, and the XLA reference ``recurrent_kda_step`` everywhere else. The state is not
    donated here: inside a jit that donates the state XLA updates it in place.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation: expected one of {_IMPLEMENTATIONS}, got {implementation!r}"
        )
    _expect_rank("q", q, 3, "[B, H, K]")
    B, H, K = q.shape
    _expect_shape("k", k, (B, H, K), "[B, H, K] like q")
    _expect_rank("v", v, 3, "[B, H, V]")
    V = v.shape[2]
    _expect_shape("v", v, (B, H, V), "[B, H, V] matching q's B, H")
    _expect_shape("g", g, (B, H, K), "[B, H, K] like q")
    _expect_shape("beta", beta, (B, H), "[B, H]")
    _expect_state("state", state, (B, H, K, V), "[B, H, K, V]")
    backend = jax.default_backend()
    if implementation == "pallas":
        if backend == "tpu":  # Mosaic TPU kernel; tested in TPU interpret mode, not yet on hardware
            return tpu_kda_decode(q, k, v, g, beta, state, scale=scale)
        if backend not in ("gpu", "cpu"):
            raise NotImplementedError(
                f"implementation='pallas': no Pallas KDA decode kernel for {backend!r}; use 'xla' or 'auto'."
            )
        return pallas_kda_decode(q, k, v, g, beta, state, scale=scale)
    if implementation == "auto" and backend == "gpu" and _decode_gpu_supported(K, V):
        return pallas_kda_decode(q, k, v, g, beta, state, scale=scale)
    return recurrent_kda_step(q, k, v, g, beta, state, scale=scale)

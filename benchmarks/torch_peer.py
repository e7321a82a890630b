"""Shared pieces of the benchmark scripts' torch halves (the peers run on the GPU machine only)."""

from __future__ import annotations

from collections.abc import Callable

K3_BETA, K3_LINEAR_BETA = 4.0, 25.0  # SiTU-GLU softcaps of K3's experts (gate, linear)


def do_bench_ms(fn: Callable[[], object]) -> list[float]:
    """[median, p20, p80] milliseconds by ``triton.testing.do_bench`` (CUDA events, L2 flushed)."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.5, 0.2, 0.8])


def torch_situ(g, u):
    """K3's SiTU product ``beta tanh(g / beta) sigmoid(g) * lbeta tanh(u / lbeta)`` in fp32 torch
    ops, returned in bf16: the epilogue ``torch._grouped_mm`` needs as a separate pass."""
    import torch

    g, u = g.float(), u.float()
    return (K3_BETA * torch.tanh(g / K3_BETA) * torch.sigmoid(g)
            * K3_LINEAR_BETA * torch.tanh(u / K3_LINEAR_BETA)).to(torch.bfloat16)

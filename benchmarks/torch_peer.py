"""Shared pieces of the benchmark scripts' torch halves (the peers run on the GPU machine only)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

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


def keep_autotuning(cache_dir: str | None) -> None:
    """Keep Triton's autotune results in ``cache_dir`` (call before the first kernel runs).

    fla autotunes every KDA kernel on its first call per shape key: 180-264 s at H=96 on an H200,
    more than a device job can spare beside our half. With ``TRITON_CACHE_AUTOTUNING`` Triton
    writes each kernel's timings to ``<cache_dir>/<key>/<kernel>.autotune.json`` and a later
    process that finds them skips the search (it compiles only the chosen config).
    ``export_autotuning`` copies those small files out so a later job can carry them back."""
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = str(Path(cache_dir).resolve())
        os.environ["TRITON_CACHE_AUTOTUNING"] = "1"


def export_autotuning(cache_dir: str | None, out_dir: str) -> int:
    """Copy the ``*.autotune.json`` files of ``cache_dir`` (with their key folders) to
    ``out_dir``; returns how many. The compiled kernels stay behind: they are large and are
    rebuilt in seconds once the configs are known."""
    if not cache_dir or not Path(cache_dir).is_dir():
        return 0
    files = sorted(Path(cache_dir).glob("*/*.autotune.json"))
    for f in files:
        dest = Path(out_dir, f.parent.name, f.name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
    return len(files)

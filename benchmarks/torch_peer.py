"""Shared pieces of the benchmark scripts' torch halves (the peers run on the GPU machine only)."""

from __future__ import annotations

import os
import tarfile
import tempfile
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


# fla-core 0.6.0's autotune results for the KDA benchmarks' shapes on an H200 with triton 3.6 (the
# GPU machine's versions): Triton keys each result by a hash of the kernel's source and constants,
# so other versions simply miss them and autotune as before.
TUNED_ARCHIVE = Path(__file__).with_name("peer_tuning") / "fla-0.6.0_triton-3.6_h200.tar.gz"


def keep_autotuning(source: str | None) -> str | None:
    """Keep Triton's autotune results in a cache folder (call before the first kernel runs) and
    return that folder.

    fla autotunes every KDA kernel on its first call per shape key: 180-264 s at H=96 on an H200,
    more than a benchmark job can spare beside our half. With ``TRITON_CACHE_AUTOTUNING`` Triton
    writes each kernel's timings to ``<cache>/<key>/<kernel>.autotune.json`` and a later process
    that finds them skips the search (it compiles only the chosen config). ``source``: a cache
    folder, or a ``.tar.gz`` of results (``export_autotuning``'s, or ``TUNED_ARCHIVE``), which is
    unpacked into a fresh folder; None: nothing kept."""
    if not source:
        return None
    cache = Path(source)
    if cache.is_file():
        folder = Path(tempfile.mkdtemp(prefix="fla_autotune_"))
        with tarfile.open(cache) as archive:
            archive.extractall(folder, filter="data")
        cache = folder
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(cache.resolve())
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
    return str(cache)


def export_autotuning(cache_dir: str | None, archive: str) -> int:
    """Write the ``*.autotune.json`` files of ``cache_dir`` (with their key folders) to the
    ``.tar.gz`` ``archive``; returns how many. The compiled kernels stay behind: they are large
    and are rebuilt in seconds once the configs are known."""
    if not cache_dir or not Path(cache_dir).is_dir():
        return 0
    files = sorted(Path(cache_dir).glob("*/*.autotune.json"))
    with tarfile.open(archive, "w:gz") as out:
        for f in files:
            out.add(f, arcname=f"{f.parent.name}/{f.name}")
    return len(files)

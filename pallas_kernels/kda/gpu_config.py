"""Stage forms, stage kernels and launch parameters of the GPU KDA kernels ("pallas_gpu"), and the
heuristics that pick them for a problem.

A config chooses, inside the GPU implementation, each stage's form and kernel (Triton, or Mosaic
GPU where it fits) and the Triton launch parameters; it never chooses the op's implementation
(that is ``dispatch.py``'s). ``for_problem`` gives the fastest forms measured on an H200
(benchmarks/RESULTS.md) for a problem; benchmarks and tests fix single fields to sweep them or
to reach a code path, and every field a caller fixes is checked against the problem here.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.kda.chunk_math import C
from pallas_kernels.kda.mosaic_gpu import inter as mosaic_gpu_inter
from pallas_kernels.kda.mosaic_gpu import pairs as mosaic_gpu_pairs
from pallas_kernels.kda.triton.intra_blocks import triton_takes
from pallas_kernels.platform import current_platform

INTER_STAGES = ("fused", "two_pass", "segments")
STAGE_KERNELS = ("triton", "mosaic_gpu")
INTRA_WARPS = 8  # the intra stage's Triton pair and W/U kernels (and the backward's recompute)
INVERSE_WARPS = 1  # the 16x16-block inverse kernel: one warp, where no tile is replicated
PIPELINE_STAGES = 2  # Triton pipeline stages where a chunk loop's tiles leave room to prefetch
FEW_SEQUENCE_HEADS = 32  # below this many (sequence, head) pairs the forward favours parallelism
FEW_SEQUENCE_HEADS_STATES = 128  # below this many the backward's recurrences take narrow blocks
# Segments per sequence of the segmented inter stage: as many as keep (sequence-heads x segments)
# within one wave of an H200's 132 SMs at two CTAs per head, each segment at least
# MIN_SEGMENT_CHUNKS chunks long (the passes' fixed costs then stay small against the loop), and
# at most MAX_SEGMENTS (the start states are chained one product at a time).
SEGMENT_HEADS = 128
MIN_SEGMENT_CHUNKS = 16
MAX_SEGMENTS = 16


@dataclasses.dataclass(frozen=True)
class ChunkProblem:
    """What the forward's choices depend on: head widths, input dtypes, the number of (sequence,
    head) pairs, chunks per sequence, and whether sequences are packed (``cu_seqlens``)."""

    K: int
    V: int
    q_dtype: jnp.dtype
    k_dtype: jnp.dtype
    v_dtype: jnp.dtype
    g_dtype: jnp.dtype
    sequence_heads: int
    n_chunks: int
    varlen: bool

    @classmethod
    def of(cls, q, k, v, g, n_sequences: int, varlen: bool) -> "ChunkProblem":
        """The problem of inputs q, k, g [B, T, H, K], v [B, T, H, V] (arrays or shape structs)."""
        _, T, H, K = q.shape
        return cls(K=K, V=v.shape[-1], q_dtype=q.dtype, k_dtype=k.dtype, v_dtype=v.dtype,
                   g_dtype=g.dtype, sequence_heads=n_sequences * H, n_chunks=-(-T // C),
                   varlen=varlen)

    @property
    def mosaic_gpu_pairs_fit(self) -> bool:
        """The Mosaic GPU pair kernel takes the inputs (bf16 q, k, a bf16 or fp32 gate, K a
        multiple of 64; an fp32 gate stays exact, rounded to bf16 it would move a chunk's decays by
        up to ``|G| 2^-9``) and v is bf16, since its outputs are bf16 where the rest of the stage
        stores intermediates in v's dtype."""
        return (self.v_dtype == jnp.bfloat16
                and mosaic_gpu_pairs.takes(self.q_dtype, self.k_dtype, self.g_dtype, self.K))

    @property
    def mosaic_gpu_inter_fits(self) -> bool:
        """The Mosaic GPU inter kernels take the problem (bf16, K and V multiples of 64, K <= 128,
        no packed sequences)."""
        return mosaic_gpu_inter.takes(self.K, self.V, self.v_dtype, self.varlen)


def chunk_config(q, k, v, g, *, cu_seqlens: object | None = None,
                 **fixed: object) -> "GpuChunkConfig":
    """``GpuChunkConfig.for_problem`` for inputs q, k, v, g (arrays or shape structs) and packed
    offsets ``cu_seqlens [N + 1]`` (or None), with the fields in ``fixed`` fixed."""
    n_sequences = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    problem = ChunkProblem.of(q, k, v, g, n_sequences, cu_seqlens is not None)
    return GpuChunkConfig.for_problem(problem, **fixed)


def segments_for(sequence_heads: int, n_chunks: int) -> int:
    """The number of segments (a power of two; 1: do not segment) for a forward with
    ``sequence_heads`` (sequence, head) pairs of ``n_chunks`` chunks each."""
    n = 1
    while (2 * n <= MAX_SEGMENTS and sequence_heads * 2 * n <= SEGMENT_HEADS
           and n_chunks >= 2 * n * MIN_SEGMENT_CHUNKS):
        n *= 2
    return n


def default_inter(sequence_heads: int, segments: int = 1) -> tuple[str, int, int]:
    """``(inter, block_v, num_warps)``: the inter stage's form, and the Triton kernels' value
    columns and warps. Each program walks all chunks of one (sequence, head, V block), so with
    many sequence-heads the fused form (one kernel, W and U formed in its loop) at block_v 64 wins;
    with few, parallelism counts: the segmented form where the sequences are long enough to cut
    (``segments`` > 1), else the two-pass form (a lighter serial loop, o formed afterwards for all
    chunks at once) at block_v 16. The threshold lies between measured points."""
    if sequence_heads < FEW_SEQUENCE_HEADS:
        return ("segments" if segments > 1 else "two_pass"), 16, 4
    return "fused", 64, 4


def _forms_wu_in_loop(inter: str) -> bool:
    """The fused and segmented inter stages form W and U in their own loops (no W/U kernel); the
    two-pass stage takes them from the intra stage's W/U kernel."""
    return inter in ("fused", "segments")


@dataclasses.dataclass(frozen=True)
class GpuChunkConfig:
    """The forward's choices. ``inter``: the inter stage's form (``INTER_STAGES``); ``block_v``,
    ``num_warps``: its Triton kernels' value columns per program and warps; ``num_stages``: every
    Triton kernel's pipeline stages; ``pairs``: the intra stage's pair kernel and
    ``inter_kernel``: the fused or segmented inter stage's kernel (``STAGE_KERNELS``);
    ``segments``: per sequence, 1 unless ``inter == "segments"``."""

    inter: str
    block_v: int
    num_warps: int
    num_stages: int
    pairs: str
    inter_kernel: str
    segments: int = 1

    @classmethod
    def for_problem(
        cls,
        problem: ChunkProblem,
        *,
        inter: str | None = None,
        block_v: int | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
        pairs: str | None = None,
        inter_kernel: str | None = None,
    ) -> "GpuChunkConfig":
        """The fastest measured config for ``problem``, with the fields given fixed (each checked
        against the problem)."""
        segmentable = inter_kernel in (None, "mosaic_gpu") and problem.mosaic_gpu_inter_fits
        segments = segments_for(problem.sequence_heads, problem.n_chunks) if segmentable else 1
        d_inter, d_block_v, d_warps = default_inter(problem.sequence_heads, segments)
        inter = d_inter if inter is None else inter
        block_v = d_block_v if block_v is None else block_v
        _check_block_v(block_v)
        if inter_kernel is None:
            fits = _forms_wu_in_loop(inter) and problem.mosaic_gpu_inter_fits
            inter_kernel = "mosaic_gpu" if fits else "triton"
        if pairs is None:
            pairs = "mosaic_gpu" if problem.mosaic_gpu_pairs_fit else "triton"
        config = cls(
            inter=inter,
            # a block that does not divide V falls back to all of V
            block_v=block_v if problem.V % block_v == 0 else problem.V,
            num_warps=d_warps if num_warps is None else num_warps,
            # one stage where the loop forms W and U: its per-chunk tiles at two stages leave the
            # SM one program
            num_stages=(1 if _forms_wu_in_loop(inter) else PIPELINE_STAGES)
            if num_stages is None else num_stages,
            pairs=pairs,
            inter_kernel=inter_kernel,
            segments=max(segments, 2) if inter == "segments" else 1,
        )
        return config.checked(problem)

    def checked(self, problem: ChunkProblem) -> "GpuChunkConfig":
        """This config, after checking that every choice runs ``problem``; errors name the field."""
        p = problem
        got = (f"v {jnp.dtype(p.v_dtype).name}, K={p.K}, V={p.V}, cu_seqlens "
               f"{'given' if p.varlen else 'None'}")
        if self.inter not in INTER_STAGES:
            raise ValueError(f"inter: expected one of {INTER_STAGES}, got {self.inter!r}")
        if self.block_v != p.V:  # all of V is a block (on GPU V itself is a power of two)
            _check_block_v(self.block_v)
        if p.V % self.block_v:
            raise ValueError(f"block_v: expected a divisor of V={p.V}, got {self.block_v}")
        for name in ("pairs", "inter_kernel"):
            if getattr(self, name) not in STAGE_KERNELS:
                raise ValueError(f"{name}: expected one of {STAGE_KERNELS}, "
                                 f"got {getattr(self, name)!r}")
        if self.pairs == "mosaic_gpu" and not p.mosaic_gpu_pairs_fit:
            raise ValueError(
                f"pairs='mosaic_gpu' needs bf16 q, k, v, a bf16 or fp32 g and K a multiple of 64, "
                f"got q {jnp.dtype(p.q_dtype).name}, k {jnp.dtype(p.k_dtype).name}, "
                f"v {jnp.dtype(p.v_dtype).name}, g {jnp.dtype(p.g_dtype).name}, K={p.K}")
        if self.inter == "segments" and not (self.inter_kernel == "mosaic_gpu"
                                             and p.mosaic_gpu_inter_fits):
            raise ValueError(
                f"inter='segments' runs the Mosaic GPU inter kernels: needs bf16 v, K and V "
                f"multiples of 64 with K <= 128, no cu_seqlens and inter_kernel 'mosaic_gpu', got "
                f"{got}, inter_kernel={self.inter_kernel!r}")
        if self.inter_kernel == "mosaic_gpu" and not (_forms_wu_in_loop(self.inter)
                                                      and p.mosaic_gpu_inter_fits):
            raise ValueError(
                f"inter_kernel='mosaic_gpu' needs the fused or segmented inter stage, bf16 v, K "
                f"and V multiples of 64 with K <= 128 and no cu_seqlens, got "
                f"inter={self.inter!r}, {got}")
        if (self.segments > 1) != (self.inter == "segments"):
            raise ValueError(f"segments: expected more than 1 exactly for inter='segments', got "
                             f"{self.segments} with inter={self.inter!r}")
        return self

    @property
    def with_wu_kernel(self) -> bool:
        """Whether the intra stage runs its W/U kernel (only the two-pass inter stage reads W, U)."""
        return not _forms_wu_in_loop(self.inter)


def _check_block_v(block_v: int) -> None:
    if not triton_takes(block_v):
        raise ValueError(f"block_v: expected a power of two >= 16, got {block_v}")


def default_states(sequence_heads: int) -> tuple[int, int]:
    """``(block_v, num_warps)`` of the backward's two state recurrences. One program per
    (sequence, head, V block) walks all chunks, so with few sequence-heads narrow blocks at 4 warps
    buy parallelism; with many, whole 128-wide blocks at 8 warps were fastest."""
    return (16, 4) if sequence_heads < FEW_SEQUENCE_HEADS_STATES else (128, 8)


@dataclasses.dataclass(frozen=True)
class GpuBackwardConfig:
    """The backward's choices. ``block_v``, ``states_warps``: V columns per program and warps of
    the two state recurrences; ``grads_block_k``, ``grads_warps``: key channels per program and
    warps of the gradient pass's key side; ``num_warps``: the intra recompute's; ``num_stages``:
    every Triton kernel's pipeline stages (the chunk loops prefetch the next chunk's tiles)."""

    block_v: int
    states_warps: int
    grads_block_k: int = 32
    grads_warps: int = 4
    num_warps: int = INTRA_WARPS
    num_stages: int = PIPELINE_STAGES

    @classmethod
    def for_problem(cls, *, sequence_heads: int, K: int, V: int,
                    **fixed: int | None) -> "GpuBackwardConfig":
        """The fastest measured config for ``sequence_heads`` (sequence, head) pairs of widths K,
        V, with the fields in ``fixed`` fixed (None: the default); blocks that do not divide V or K
        fall back to all of it."""
        unknown = sorted(set(fixed) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"GpuBackwardConfig: unknown field(s) {unknown}")
        block_v, states_warps = default_states(sequence_heads)
        values = dict(block_v=block_v if V % block_v == 0 else V, states_warps=states_warps)
        values.update({n: x for n, x in fixed.items() if x is not None})
        values["block_v"] = min(values["block_v"], V)
        config = cls(**values)
        if config.grads_block_k >= 1 and K % config.grads_block_k:
            config = dataclasses.replace(config, grads_block_k=K)
        return config.checked(K, V)

    def checked(self, K: int, V: int, triton: bool = False) -> "GpuBackwardConfig":
        """This config, after checking that it runs widths K, V (with ``triton``, also the Triton
        lowering's shape rules); errors name the field."""
        if self.block_v < 1 or V % self.block_v:
            raise ValueError(f"block_v: V={V} is not a multiple of block_v={self.block_v}")
        if self.grads_block_k < 1 or K % self.grads_block_k:
            raise ValueError(f"grads_block_k: expected a positive divisor of K={K}, "
                             f"got {self.grads_block_k}")
        if triton and not triton_takes(self.grads_block_k):
            raise ValueError(f"grads_block_k: expected a power of two >= 16 on GPU (Triton), "
                             f"got {self.grads_block_k}")
        return self


def backward_config(q, v, *, cu_seqlens: object | None = None,
                    **fixed: int | None) -> GpuBackwardConfig:
    """``GpuBackwardConfig.for_problem`` for inputs q [B, T, H, K], v [B, T, H, V] (arrays or
    shape structs) and packed offsets ``cu_seqlens [N + 1]`` (or None)."""
    n_sequences = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    return GpuBackwardConfig.for_problem(sequence_heads=n_sequences * q.shape[2], K=q.shape[3],
                                         V=v.shape[3], **fixed)


def interpret_mode(K: int, V: int, what: str) -> bool:
    """Whether the GPU kernels run in Pallas interpret mode (off a GPU, as the tests run them); on a
    GPU the Triton kernels need K and V powers of two >= 16, checked here with `what` named."""
    if current_platform() != "gpu":
        return True
    if not triton_takes(K, V):
        raise ValueError(f"pallas_gpu {what} needs K and V powers of two >= 16 (Triton), got K={K}, V={V}")
    return False

"""Chunked KDA forward as Pallas kernels, for the lower-bounded ("safe") gate.

Scope: forward only, K3's safe gate (every per-step log-decay ``g`` in ``[-5, 0]``, i.e.
``lower_bound = -5`` as in ``linear_attn_config.gate_lower_bound``), chunk ``C = 64``,
sub-chunk ``BC = 16``. Math: kda.md sections 2.1 / 2.4.

Two stages:

1. The intra-chunk stage (``pallas_intra.py``), fully parallel over ``(B, H, N)`` with
   ``N = ceil(T / 64)`` chunks: per chunk the cumulative gate ``G``, the pair matrices
   ``L = beta_r P(k, k)`` and ``Aqk = P(scale q, k)`` (``P[r, i] = sum_d x_r y_i e^{G_r - G_i}``,
   each factor taken against a 16-row sub-chunk's midpoint: the lower bound keeps both within
   e^40, so they are plain matmuls), ``X = (I + L)^{-1}``, ``bk = beta k e^G``,
   ``W = X bk``, ``U = X (beta v)``, ``Qg = scale q e^G``, ``Kd = k e^{G_last - G}``,
   ``gl = e^{G_last}``.
   Optionally it fuses the input activations of fla's K3 call (q/k L2 norm,
   ``g = lb * sigmoid(exp(A_log) (g_raw + dt_bias))``, ``beta = sigmoid(b)``), so they cost no
   extra HBM pass.
2. ``_inter_kernel``, grid ``(B, H, V / BV)``, sequential ``fori_loop`` over chunks keeping the
   fp32 state ``S [K, BV]`` on chip: ``v_new = U - W S``, ``o = Qg S + Aqk v_new``,
   ``S = gl * S + Kd^T v_new``. Output and final state written directly (no per-chunk states).
   By default (``WU``) it reads X, bk, v and beta instead of W and U and forms
   ``v_new = X (beta v - bk S)`` itself, so the intra stage skips its W/U kernel.
   Or, with ``inter="two_pass"``, the recurrence alone (``pallas_states.state_pass``, storing every
   chunk's state and ``v_new``) and then ``o`` for all chunks in parallel: half the products in
   the serial loop, for an HBM round trip of the states. Or, with ``inter="segments"``
   (``segmented_inter.py``), each sequence cut into segments that run side by side: every
   segment's state and transition matrix, the segments' start states chained, then the fused
   loop per segment. With few sequence-heads the serial loop is the critical path, and these two
   are the defaults there (``default_inter``).

Packed sequences (``cu_seqlens``): the inputs are gathered into a chunk-aligned layout
(``varlen_layout.py``: each sequence padded to whole chunks, at most ``N * (C - 1)`` extra
tokens, where a padded ``[N, max_len]`` batch can cost up to ``N`` times the tokens), the intra
stage runs on it unchanged, and the inter kernel's grid becomes ``(N, H, V / BV)``: each program
loops over its own sequence's chunk range (int32 chunk offsets read in the kernel) from that
sequence's initial state, so the sequences run in parallel and no state crosses a boundary. The
price is one gather of the inputs and one of the output.

Splitting the intra-chunk work out of the sequential loop keeps the serial critical path to
four matmuls per chunk, which matters when ``B * H`` is small (B=1, H=16 has only 16-64
programs for 132 SMs); the price is one HBM round trip of W, U, Qg, Kd, Aqk (in the input
dtype, like fla's pipeline).

Backends: the intra stage's pair kernel is Mosaic GPU (``mosaic_gpu_pairs.py``: TMA copies and
wgmma products, the documented GPU direction in jax 0.11) wherever it fits (bf16 q, k, v, a bf16 or
fp32 gate, K a multiple of 64; ``pallas_intra.default_pairs``), the Pallas-Triton one otherwise;
so is the fused inter stage (``mosaic_gpu_inter.py``: bf16, K <= 128, no packed sequences;
``default_inter_kernel``). Every other kernel is Pallas-Triton (still working on jax 0.11.2,
deprecated). Why the mix: the pair kernel is where Triton's lack of register slicing cost most
(each 16-column block of L and Aqk a masked 64-column product, 255 registers), and Mosaic GPU's
explicit shared-memory tiles and wgmma into accumulator column slices fix exactly that (4.84 ->
3.55 ms at B4 T8192 H96); the inter stage's serial loop gains from TMA loading the next chunk
while this one runs, and from the value blocks of a head sharing one CTA's copies (~2.7 -> ~1.2
ms). The inverse, the W/U products and the remaining chunk loops are written as Triton kernels that run
unchanged in ``interpret=True`` mode on CPU; they avoid Triton-only primitives (only ref
loads/stores with ``pl.ds``, ``jnp`` math, ``lax.fori_loop``), so moving them to Mosaic GPU or
Mosaic TPU is a rewrite of the memory movement, not of the math. Mosaic GPU kernels are tested on
CPU in Mosaic GPU's interpreter. Triton constraints: K, V and BV must be powers of two >= 16.

Measured on one H200 (benchmarks/RESULTS.md, twelfth run; fla-core 0.6.0 in the same job):
B4 T8192 H96 D128 bf16 5.35 ms with the fused activations (fla 9.96 ms), B1 T32768 H16 1.26 ms
with the segmented inter stage (fla 2.24 ms); bf16 error vs the fp32 reference equal to fla's. bf16 inputs take the hardware exp2 /
reciprocal (``intra_blocks.gate_exp``); fp32 inputs stay exact. Defaults: ``default_inter`` (the
inter stage's form, block_v and warps by the number of sequence-heads), ``default_pairs``,
``WU``, ``INTRA_WARPS``, ``INVERSE_WARPS`` and ``PIPELINE_STAGES``, the fastest measured.
Intra stages measured slower on the H200 and removed (benchmarks/RESULTS.md): one kernel over
16-row sub-chunks ("v1", 13.5 ms at B4 T8192 H96), the same as two kernels ("split"), and the
variants "lean", "blocks", "stream" and "kblock".

Requires the safe gate: a step with ``g < -5`` (more precisely, > 35-40 nats of decay inside a
16-token sub-chunk) can overflow the midpoint factorisation; use the XLA reference otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import C
from pallas_kernels.kda.chunk_math import dot as _dot
from pallas_kernels.kda import mosaic_gpu_inter
from pallas_kernels.kda.intra_blocks import beta_values, compiler_params, matmul_dtypes
from pallas_kernels.kda.pallas_intra import (
    PAIR_KERNELS, default_pairs, intra_stage, mosaic_gpu_pairs_fit,
)
from pallas_kernels.kda.pallas_states import sequence_chunks, state_pass
from pallas_kernels.kda.reference import host_offsets
from pallas_kernels.kda.segmented_inter import inter_segments, segments_for
from pallas_kernels.kda.varlen_layout import chunk_layout, from_aligned, to_aligned

_F32 = jnp.float32
LOWER_BOUND_MIN = -5.0


def _inter_kernel(*refs, n_chunks, bv, mm_dtype, varlen, wu_in_loop, fused):
    """Program (s, h, iv) runs the chunks of sequence s (``pallas_states.sequence_chunks``), so
    with ``varlen`` sequence s starts from its own initial state and never sees another
    sequence's chunks. With ``wu_in_loop`` it reads ``X``, ``bk``, v and beta (logits when
    ``fused``) instead of W and U, and forms ``v_new = X (beta v - bk S)``, which equals
    ``U - W S`` (``W = X bk``, ``U = X beta v``): one more product in the serial loop for no
    W/U kernel and its HBM round trip."""
    refs, s, b, c_begin, c_end = sequence_chunks(refs, n_chunks, varlen)
    if wu_in_loop:
        x_ref, bk_ref, v_ref, beta_ref, *refs = refs
    else:
        w_ref, u_ref, *refs = refs
    qg_ref, kd_ref, a_ref, gl_ref, h0_ref, o_ref, ht_ref = refs
    h, iv = pl.program_id(1), pl.program_id(2)
    vs = pl.ds(iv * bv, bv)

    def body(c, S):
        ts = pl.ds(c * C, C)
        qg = qg_ref[b, ts, h, :]
        kd = kd_ref[b, ts, h, :]
        a = a_ref[b, ts, h, :]
        gl = gl_ref[b, c, h, :]
        if wu_in_loop:
            bv_ = beta_values(beta_ref[b, ts, h], v_ref[b, ts, h, vs], fused)
            v_new = _dot(x_ref[b, ts, h, :], bv_ - _dot(bk_ref[b, ts, h, :], S, mm_dtype),
                         mm_dtype)
        else:
            v_new = u_ref[b, ts, h, vs].astype(_F32) - _dot(w_ref[b, ts, h, :], S, mm_dtype)
        o = _dot(qg, S, mm_dtype) + _dot(a, v_new, mm_dtype)
        o_ref[b, ts, h, vs] = o.astype(o_ref.dtype)
        return gl[:, None] * S + _dot(kd, v_new, mm_dtype, trans_a=True)

    S = lax.fori_loop(c_begin, c_end, body, h0_ref[s, h, :, vs])
    ht_ref[s, h, :, vs] = S


def _output_kernel(qg_ref, a_ref, hs_ref, vn_ref, o_ref, *, mm_dtype):
    """The two-pass inter stage's second kernel, parallel over chunks: ``o = Qg h + Aqk v_new``
    from the chunk's stored input state ``h`` and ``v_new`` (both in the dtype that the fused
    kernel's products round them to, so the two stages give the same o)."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ts = pl.ds(c * C, C)
    o = _dot(qg_ref[b, ts, h, :], hs_ref[b, c, h, :, :], mm_dtype) + _dot(
        a_ref[b, ts, h, :], vn_ref[b, ts, h, :], mm_dtype)
    o_ref[b, ts, h, :] = o.astype(o_ref.dtype)


def _inter_two_pass(w, u, qg, kd, aqk, gl, h0, chunk_offsets, *, block_v, out_dtype, interpret,
                    params):
    """``(o, final state)`` in two kernels: the state recurrence alone (``pallas_states``), which
    stores every chunk's input state, then ``_output_kernel`` over all chunks at once. The serial
    loop then makes two products per chunk instead of four, for an HBM round trip of the
    states."""
    mm_dtype, sd = matmul_dtypes(u)
    hs, vn, ht = state_pass(w, u, kd, gl, h0, chunk_offsets, block_v=block_v, mm_dtype=mm_dtype,
                            store_dtype=sd, interpret=interpret, params=params)
    B, Tp, H, _ = qg.shape
    o = pl.pallas_call(
        functools.partial(_output_kernel, mm_dtype=mm_dtype),
        grid=(B, H, Tp // C),
        out_shape=jax.ShapeDtypeStruct(u.shape, out_dtype),
        interpret=interpret,
        name="kda_output",
        **params,
    )(qg, aqk, hs, vn)
    return o, ht


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "interpret", "fused", "lower_bound", "block_v", "num_warps", "num_stages",
        "intra_warps", "inverse_warps", "inter", "keep_intra", "pairs", "wu", "inter_kernel",
        "segments",
    ),
)
def _pallas_chunk_kda(
    q, k, v, g, beta, initial_state, gate_scale, dt_bias, chunk_offsets=None, *, scale,
    interpret, fused, lower_bound, block_v, num_warps, num_stages, intra_warps, inverse_warps,
    inter, keep_intra, pairs, wu, inter_kernel, segments,
):
    """``chunk_offsets`` (int32 [N + 1], traced) marks a chunk-aligned packed batch (B == 1);
    ``segments``: the segmented inter stage's segments per sequence (Tp a multiple of 64 of them).
    Returns ``(o, final state)``, with ``keep_intra`` also ``(X, Aqk)`` (see ``pallas_chunk_kda``)."""
    B, Tp, H, K = q.shape  # Tp: a multiple of C (padded by the caller)
    V = v.shape[-1]
    n = Tp // C
    mm_dtype, _ = matmul_dtypes(v)
    bv = min(block_v, V)
    params = compiler_params(interpret, num_warps, num_stages)

    ins = (q, k, v, g, beta) + ((gate_scale, dt_bias) if fused else ())
    wu_in_loop = forms_wu_in_loop(inter, wu)
    x, bk, w, u, qg, kd, aqk, gl = intra_stage(
        ins, scale=scale, fused=fused, lower_bound=lower_bound, interpret=interpret,
        params=compiler_params(interpret, intra_warps, num_stages),
        inverse_params=compiler_params(interpret, inverse_warps, num_stages), pairs=pairs,
        with_wu=not wu_in_loop,
    )

    kept = ((x, aqk),) if keep_intra else ()
    if inter == "two_pass":
        return _inter_two_pass(w, u, qg, kd, aqk, gl, initial_state, chunk_offsets, block_v=bv,
                               out_dtype=v.dtype, interpret=interpret, params=params) + kept
    if inter == "segments":
        return inter_segments(x, bk, v, beta, qg, kd, aqk, gl, initial_state, segments=segments,
                              fused=fused, interpret=interpret) + kept
    if inter_kernel == "mosaic_gpu":
        return mosaic_gpu_inter.inter_mgpu(x, bk, v, beta, qg, kd, aqk, gl, initial_state,
                                           fused=fused, interpret=interpret) + kept
    varlen = chunk_offsets is not None
    n_seq = initial_state.shape[0]
    o, ht = pl.pallas_call(
        functools.partial(_inter_kernel, n_chunks=n, bv=bv, mm_dtype=mm_dtype, varlen=varlen,
                          wu_in_loop=wu_in_loop, fused=fused),
        grid=(n_seq, H, V // bv),
        out_shape=(
            jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype),
            jax.ShapeDtypeStruct((n_seq, H, K, V), _F32),
        ),
        interpret=interpret,
        name="kda_inter_state_varlen" if varlen else "kda_inter_state",
        **params,
    )(*((chunk_offsets,) if varlen else ()), *((x, bk, v, beta) if wu_in_loop else (w, u)),
      qg, kd, aqk, gl, initial_state)
    return (o, ht) + kept


INVERSE_WARPS = 1  # the intra stage's inverse kernel (16x16 blocks): one warp, fastest of 1, 2, 4
INTRA_WARPS = 8  # the intra stage's pair and W/U kernels: at 4 the pair kernel spills
FEW_SEQUENCE_HEADS = 32  # below this many (sequence, head) pairs, favour parallelism
# Triton pipeline stages (``default_stages``; the backward's too): the chunk loops prefetch the next
# chunk's tiles while the state update runs (B1 T32768 H16, block_v 64: 3.14 vs 3.22 ms,
# benchmarks/RESULTS.md). 3 stages exceed the shared memory.
PIPELINE_STAGES = 2
# Where the fused inter stage gets W and U (``WU_PLACES``): in its own loop, ``v_new = X (beta v
# - bk S)``, one more product on the serial path for no W/U kernel (B4 T8192 H96 6.99 vs 7.66 ms
# at one pipeline stage, benchmarks/RESULTS.md, tenth run).
WU = "loop"
# The fused inter stage's kernel where the Mosaic GPU one fits (``default_inter_kernel``):
# B4 T8192 H96 5.35 vs 6.84 ms, B1 T8192 H96 1.43 vs 1.84 (benchmarks/RESULTS.md, eleventh run).
INTER_KERNEL = "mosaic_gpu"


def default_inter(sequence_heads: int, segments: int = 1) -> tuple[str, int, int]:
    """``(inter, block_v, num_warps)`` of the inter stage, the fastest measured on an H200
    (benchmarks/RESULTS.md, ninth and tenth runs, with the Mosaic GPU pair kernel).

    The inter stage has one program per (sequence, head, V block), each walking all chunks. The
    fused kernel at block_v 64, 4 warps and one pipeline stage, forming W and U in its loop
    (``WU``), took 6.99 ms at B4 T8192 H96 (384 sequence-heads; two stages 7.60, with the W/U
    kernel 7.38 / 7.66; block_v 32 9.68-10.30) and 1.89 ms at B1 T8192 H96 (96; two stages 2.03,
    the two-pass stage 2.31 in the ninth run). With very few, parallelism is what counts: the
    two-pass stage (a lighter serial loop, o formed afterwards for all chunks at once) at
    block_v 16 and 4 warps took 2.01-2.05 ms at B1 T32768 H16 (16 sequence-heads; fused at 64 and 4
    warps 2.04-2.07 with the W/U kernel). The threshold lies between 16 and 96 and is not itself
    measured. With the Mosaic GPU inter kernel (``default_inter_kernel``; block_v and warps are
    the Triton kernel's) the fused stage took 5.35 / 1.43 ms at B4 / B1 T8192 H96, and 2.70 at
    B1 T32768 H16, where the two-pass stage's 1.97 stayed ahead (eleventh run). Where the Mosaic
    GPU kernels fit and the sequences are long enough to cut (``segments``:
    ``segmented_inter.segments_for``, 1 otherwise), few sequence-heads take the segmented stage:
    1.26 ms at B1 T32768 H16 in 8 segments, the two-pass stage 1.99 (twelfth run).
    """
    if sequence_heads < FEW_SEQUENCE_HEADS:
        return ("segments" if segments > 1 else "two_pass"), 16, 4
    return "fused", 64, 4


def forms_wu_in_loop(inter: str, wu: str) -> bool:
    """Whether the inter stage forms W and U in its own loop: the fused and segmented stages can
    (``wu`` asks for it; the two-pass stage always takes the W/U kernel)."""
    return inter in ("fused", "segments") and wu == "loop"


def mosaic_gpu_inter_fits(inter: str, wu: str, K: int, V: int, dtype, varlen: bool) -> bool:
    """Whether the inter stage can take ``mosaic_gpu_inter``: the fused or segmented stage
    forming W and U in its loop, on inputs the kernel takes (``mosaic_gpu_inter.takes``)."""
    return forms_wu_in_loop(inter, wu) and mosaic_gpu_inter.takes(K, V, dtype, varlen)


def default_inter_kernel(inter: str, wu: str, K: int, V: int, dtype, varlen: bool) -> str:
    """The fused inter stage's kernel when a call names none: ``INTER_KERNEL`` wherever it
    fits (``mosaic_gpu_inter_fits``), else Triton."""
    if INTER_KERNEL == "mosaic_gpu" and mosaic_gpu_inter_fits(inter, wu, K, V, dtype, varlen):
        return "mosaic_gpu"
    return "triton"


def default_stages(inter: str, wu: str) -> int:
    """Triton pipeline stages of the forward's kernels: one for the fused inter stage forming W
    and U in its loop, whose per-chunk tiles (X, bk, v, Qg, Kd, Aqk) at two stages leave the SM
    one program (B4 T8192 H96: 6.99 vs 7.60 ms), else ``PIPELINE_STAGES`` (with the W/U kernel
    7.38 at two stages vs 7.66 at one; benchmarks/RESULTS.md, tenth run)."""
    return 1 if forms_wu_in_loop(inter, wu) else PIPELINE_STAGES


def _default_interpret() -> bool:
    return jax.default_backend() != "gpu"


def pallas_chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    cu_seqlens: object | None = None,
    interpret: bool | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    intra_warps: int = INTRA_WARPS,
    inverse_warps: int = INVERSE_WARPS,
    inter: str | None = None,
    return_intra: bool = False,
    pairs: str | None = None,
    wu: str = WU,
    inter_kernel: str | None = None,
) -> tuple[jax.Array, ...]:
    """Chunked KDA forward (safe gate, pre-activated inputs; fla conventions).

    q, k [B, T, H, K] L2-normalised; v [B, T, H, V]; g [B, T, H, K] log-decay in [-5, 0];
    beta [B, T, H]; initial_state fp32 [B, H, K, V] or None. Returns ``(o in v.dtype,
    final state fp32 [B, H, K, V])``. ``interpret`` defaults to True off GPU.
    ``cu_seqlens``: host int offsets [N + 1] of packed sequences (B == 1); then initial_state
    and the final state are [N, H, K, V] and no state crosses a sequence boundary.
    ``inter``: ``"fused"``, one sequential kernel that also forms o, ``"two_pass"``, the state
    recurrence alone with every chunk's state stored, then o for all chunks in parallel
    (``_inter_two_pass``), or ``"segments"``, each sequence cut into segments that run side by
    side (``segmented_inter.py``: the Mosaic GPU kernels, so bf16 v, K and V multiples of 64,
    K <= 128, no ``cu_seqlens``); ``block_v`` and ``num_warps`` are the Triton inter kernels'.
    The three default to ``default_inter`` for the call's number of (sequence, head) pairs. ``num_stages``: every
    kernel's Triton pipeline stages, by default ``default_stages``. ``intra_warps``:
    num_warps of the intra stage's pair and W/U kernels; ``inverse_warps``: of its 16x16-block
    inverse kernel. ``return_intra``: also return every chunk's ``(X, Aqk)`` [B, Tp, H, 64]
    (``X = (I + L)^{-1}``, in the kernel's padded or chunk-aligned token layout and the
    intermediates' dtype) for ``pallas_chunk_kda_bwd(..., intra=...)``, which then skips the
    intra stage's pair products and inverse: the residuals fla's backward keeps too.
    ``pairs``: the intra stage's pair kernel, ``"triton"`` or ``"mosaic_gpu"``
    (``mosaic_gpu_pairs.py``: bf16 q, k, v, a bf16 or fp32 gate, K a multiple of 64); default
    ``default_pairs``. ``wu``: where the fused inter stage gets ``W = X bk`` and
    ``U = X (beta v)``: from the intra stage's W/U kernel (``"kernel"``) or formed in its own
    loop (``"loop"``, ``v_new = X (beta v - bk S)``); the two-pass stage always takes the kernel.
    ``inter_kernel``: the fused inter stage's kernel when it forms W and U in its loop,
    ``"triton"`` or ``"mosaic_gpu"`` (``mosaic_gpu_inter.py``: bf16, K and V multiples of 64,
    K <= 128, no ``cu_seqlens``); default ``default_inter_kernel``.
    """
    return _call(q, k, v, g, beta, None, None, scale, initial_state, interpret, False, 0.0,
                 cu_seqlens, block_v=block_v, num_warps=num_warps, num_stages=num_stages,
                 intra_warps=intra_warps, inverse_warps=inverse_warps, inter=inter,
                 keep_intra=return_intra, pairs=pairs, wu=wu, inter_kernel=inter_kernel)


def pallas_chunk_kda_fused_gate(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g_raw: jax.Array,
    beta_logits: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    *,
    lower_bound: float = -5.0,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    cu_seqlens: object | None = None,
    interpret: bool | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    intra_warps: int = INTRA_WARPS,
    inverse_warps: int = INVERSE_WARPS,
    inter: str | None = None,
    pairs: str | None = None,
    wu: str = WU,
    inter_kernel: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """As ``pallas_chunk_kda`` with K3's input activations fused into the intra stage.

    q, k raw (L2-normalised in the kernel, ``x * rsqrt(sum x^2 + 1e-6)``); g_raw [B, T, H, K]
    gate pre-activation, ``g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias))``;
    A_log [H] (or K3's zero-padded [>= H], first H used); dt_bias [H * K]; beta_logits
    [B, T, H] (sigmoid in the kernel). Same computation as fla ``chunk_kda(...,
    use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, safe_gate,
    lower_bound)``.
    """
    if not LOWER_BOUND_MIN <= lower_bound < 0:
        raise ValueError(f"lower_bound: expected a value in [-5, 0), got {lower_bound}")
    H, K = q.shape[2], q.shape[3]
    gate_scale, dt = gate_params(A_log, dt_bias, H, K)
    return _call(q, k, v, g_raw, beta_logits, gate_scale, dt, scale, initial_state, interpret,
                 True, float(lower_bound), cu_seqlens, block_v=block_v, num_warps=num_warps,
                 num_stages=num_stages, intra_warps=intra_warps, inverse_warps=inverse_warps,
                 inter=inter, keep_intra=False, pairs=pairs, wu=wu, inter_kernel=inter_kernel)


def gate_params(A_log: jax.Array, dt_bias: jax.Array, H: int, K: int) -> tuple[jax.Array, jax.Array]:
    """The fused gate's per-head inputs as the intra stage reads them: ``exp(A_log[h])``
    broadcast to [H, K] (A_log [H] or K3's zero-padded [>= H]) and dt_bias as [H, K], fp32."""
    gate_scale = jnp.broadcast_to(jnp.exp(A_log.reshape(-1)[:H].astype(_F32))[:, None], (H, K))
    return gate_scale, dt_bias.astype(_F32).reshape(H, K)


INTER_STAGES = ("fused", "two_pass", "segments")
WU_PLACES = ("kernel", "loop")
INTER_KERNELS = ("triton", "mosaic_gpu")


def _call(q, k, v, g, beta, gate_scale, dt_bias, scale, initial_state, interpret, fused,
          lower_bound, cu_seqlens, *, block_v, num_warps, num_stages, intra_warps,
          inverse_warps, inter, keep_intra, pairs, wu, inter_kernel):
    B, T, H, K = q.shape
    V = v.shape[-1]
    if interpret is None:
        interpret = _default_interpret()
    if not interpret:
        bad = [f"{n}={d}" for n, d in (("K", K), ("V", V)) if d < 16 or not _is_pow2(d)]
        if bad:
            raise ValueError(
                f"pallas KDA on GPU needs K and V powers of two >= 16 (Triton), got {bad}"
            )
    n_seq = B if cu_seqlens is None else host_offsets(cu_seqlens, T).size - 1
    n_chunks = -(-T // C)
    varlen = cu_seqlens is not None
    segmentable = (inter_kernel in (None, "mosaic_gpu")
                   and mosaic_gpu_inter_fits("segments", wu, K, V, v.dtype, varlen))
    segments = segments_for(n_seq * H, n_chunks) if segmentable else 1
    inter_default, block_v_default, warps_default = default_inter(n_seq * H, segments)
    inter = inter_default if inter is None else inter
    block_v = block_v_default if block_v is None else block_v
    num_warps = warps_default if num_warps is None else num_warps
    if not _is_pow2(block_v) or block_v < 16:
        raise ValueError(f"block_v: expected a power of two >= 16, got {block_v}")
    if inter not in INTER_STAGES:
        raise ValueError(f"inter: expected one of {INTER_STAGES}, got {inter!r}")
    if wu not in WU_PLACES:
        raise ValueError(f"wu: expected one of {WU_PLACES}, got {wu!r}")
    if inter == "segments" and not segmentable:
        raise ValueError(
            f"inter='segments' runs the Mosaic GPU inter kernels: needs wu='loop', bf16 v, K and V "
            f"multiples of 64 with K <= 128, no cu_seqlens and inter_kernel 'mosaic_gpu' or None, "
            f"got wu={wu!r}, v {v.dtype}, K={K}, V={V}, cu_seqlens "
            f"{'given' if varlen else 'None'}, inter_kernel={inter_kernel!r}")
    segments = max(segments, 2) if inter == "segments" else 1
    num_stages = default_stages(inter, wu) if num_stages is None else num_stages
    pairs = default_pairs(q, k, v, g) if pairs is None else pairs
    if pairs not in PAIR_KERNELS:
        raise ValueError(f"pairs: expected one of {PAIR_KERNELS}, got {pairs!r}")
    if pairs == "mosaic_gpu" and not mosaic_gpu_pairs_fit(q, k, v, g):
        raise ValueError(f"pairs='mosaic_gpu' needs bf16 q, k, v, a bf16 or fp32 g and K a "
                         f"multiple of 64, got "
                         f"q {q.dtype}, k {k.dtype}, v {v.dtype}, g {g.dtype}, K={K}")
    if inter_kernel is None:
        inter_kernel = default_inter_kernel(inter, wu, K, V, v.dtype, varlen)
    if inter_kernel not in INTER_KERNELS:
        raise ValueError(f"inter_kernel: expected one of {INTER_KERNELS}, got {inter_kernel!r}")
    if inter_kernel == "mosaic_gpu" and not mosaic_gpu_inter_fits(inter, wu, K, V, v.dtype,
                                                                  varlen):
        raise ValueError(
            f"inter_kernel='mosaic_gpu' needs the fused inter stage forming W and U in its loop "
            f"(inter='fused', wu='loop'), bf16 v, K and V multiples of 64 with K <= 128 and no "
            f"cu_seqlens, got inter={inter!r}, wu={wu!r}, v {v.dtype}, K={K}, V={V}, "
            f"cu_seqlens {'given' if varlen else 'None'}")
    scale = K**-0.5 if scale is None else float(scale)
    # Padding steps are identities: k = v = 0, beta = 0 and g = 0; with the fused activations the
    # gate and beta pre-activations are padded with -inf (sigmoid(-inf) = 0). Padding happens
    # outside the jit so that every T with the same chunk count shares a compile.
    neg = -jnp.inf if fused else 0.0
    kw = dict(
        scale=scale, interpret=bool(interpret), fused=fused, lower_bound=lower_bound,
        block_v=block_v if V % block_v == 0 else V, num_warps=num_warps, num_stages=num_stages,
        intra_warps=intra_warps,
        inverse_warps=inverse_warps, inter=inter, keep_intra=keep_intra, pairs=pairs, wu=wu,
        inter_kernel=inter_kernel, segments=segments,
    )
    if cu_seqlens is not None:
        return _call_varlen(q, k, v, g, beta, gate_scale, dt_bias, initial_state, cu_seqlens,
                            neg, kw)
    if initial_state is None:
        initial_state = jnp.zeros((B, H, K, V), _F32)
    Tp = -(-n_chunks // segments) * segments * C  # whole segments of whole chunks
    if Tp != T:
        pad = lambda x, c=0.0: jnp.pad(
            x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2), constant_values=c
        )
        q, k, v, g, beta = pad(q), pad(k), pad(v), pad(g, neg), pad(beta, neg)
    o, ht, *kept = _pallas_chunk_kda(
        q, k, v, g, beta, initial_state.astype(_F32), gate_scale, dt_bias, **kw
    )
    # (X, Aqk) of whole chunks only, as the backward takes them: no padding segments' chunks
    kept = [tuple(t[:, :n_chunks * C] for t in intra) for intra in kept]
    return ((o if Tp == T else o[:, :T]), ht, *kept)


def _call_varlen(q, k, v, g, beta, gate_scale, dt_bias, initial_state, cu_seqlens, neg, kw):
    """Packed sequences: run on the chunk-aligned layout (``varlen_layout.py``), in which each
    sequence starts on a chunk boundary, so the intra stage runs unchanged and the inter kernel
    loops over one sequence's chunk range per program."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if B != 1:
        raise ValueError(f"cu_seqlens: packed sequences need B == 1, got q shape {q.shape}")
    layout = chunk_layout(host_offsets(cu_seqlens, T), C)
    n_seq = layout.chunk_offsets.size - 1
    if initial_state is None:
        initial_state = jnp.zeros((n_seq, H, K, V), _F32)
    if tuple(initial_state.shape) != (n_seq, H, K, V):
        raise ValueError(
            f"initial_state: expected shape {(n_seq, H, K, V)} [N, H, K, V] with N = "
            f"len(cu_seqlens) - 1, got {tuple(initial_state.shape)}"
        )
    q, k, v = (to_aligned(x, layout) for x in (q, k, v))
    g, beta = to_aligned(g, layout, neg), to_aligned(beta, layout, neg)
    o, *rest = _pallas_chunk_kda(
        q, k, v, g, beta, initial_state.astype(_F32), gate_scale, dt_bias,
        jnp.asarray(layout.chunk_offsets), **kw
    )
    return (from_aligned(o, layout), *rest)


__all__ = ["LOWER_BOUND_MIN", "default_inter", "default_stages", "pallas_chunk_kda",
           "pallas_chunk_kda_fused_gate"]

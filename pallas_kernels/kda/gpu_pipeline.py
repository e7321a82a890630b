"""The GPU chunked-KDA forward ("pallas_gpu"), for the lower-bounded ("safe") gate: two stages,
each stage's kernel Triton or Mosaic GPU by what fits (``gpu_config``).

Scope: K3's safe gate (every per-step log-decay ``g`` in ``[-5, 0]``, ``lower_bound = -5`` as in
``linear_attn_config.gate_lower_bound``), chunk ``C = 64``, sub-chunk ``BC = 16``. Math: kda.md
sections 2.1 / 2.4.

1. The intra-chunk stage (``intra_stage``), fully parallel over ``(B, H, N)`` with
   ``N = ceil(T / 64)`` chunks: per chunk the cumulative gate ``G``, the pair matrices
   ``L = beta_r P(k, k)`` and ``Aqk = P(scale q, k)`` (``P[r, i] = sum_d x_r y_i e^{G_r - G_i}``,
   each factor taken against a 16-row sub-chunk's midpoint: the lower bound keeps both within
   e^40, so they are plain matmuls), ``X = (I + L)^{-1}``, ``bk = beta k e^G``, ``Qg = scale q
   e^G``, ``Kd = k e^{G_last - G}``, ``gl = e^{G_last}``, and for the two-pass inter stage
   ``W = X bk``, ``U = X (beta v)``. Optionally it fuses K3's input activations (q/k L2 norm,
   ``g = lb * sigmoid(exp(A_log) (g_raw + dt_bias))``, ``beta = sigmoid(b)``), so they cost no
   extra HBM pass. The pair kernel is Mosaic GPU (``mosaic_gpu/pairs.py``) where it fits, where
   Triton's lack of register slicing costs most; the inverse and W/U kernels are Triton.
2. The inter stage, sequential over chunks with the fp32 state on chip: ``v_new = U - W S``,
   ``o = Qg S + Aqk v_new``, ``S = gl * S + Kd^T v_new``, in one of three forms
   (``GpuChunkConfig.inter``): ``"fused"`` (one kernel forming W and U in its loop: Mosaic GPU's
   ``mosaic_gpu/inter.py`` where it fits, where TMA loads the next chunk while this one runs,
   else ``triton/inter.py``), ``"two_pass"`` (the recurrence alone, then o for all chunks in
   parallel; Triton) or ``"segments"`` (``mosaic_gpu/segmented_inter.py``: each sequence cut into
   segments that run side by side).

Splitting the intra-chunk work out of the sequential loop keeps the serial critical path to a few
matmuls per chunk, which matters when ``B * H`` is small (B=1, H=16 has only 16-64 programs for
132 SMs); the price is one HBM round trip of the intermediates (in the input dtype, like fla's
pipeline). bf16 inputs take the hardware exp2 / reciprocal (``triton/intra_blocks.gate_exp``);
fp32 inputs stay exact.

Packed sequences (``cu_seqlens``): the inputs are gathered into a chunk-aligned layout
(``varlen_layout.py``: each sequence padded to whole chunks, at most ``N * (C - 1)`` extra tokens
where a padded ``[N, max_len]`` batch can cost up to ``N`` times the tokens), the intra stage runs
on it unchanged, and the inter kernels' grids become ``(N, H, V / BV)``: each program loops over
its own sequence's chunk range from that sequence's initial state, so no state crosses a
boundary.

Requires the safe gate: a step with ``g < -5`` (more precisely, > 35-40 nats of decay inside a
16-token sub-chunk) can overflow the midpoint factorisation; use the XLA reference otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda.chunk_math import C, LOWER_BOUND_MIN
from pallas_kernels.kda.gpu_config import INTRA_WARPS, INVERSE_WARPS, ChunkProblem, GpuChunkConfig, interpret_mode
from pallas_kernels.kda.mosaic_gpu.inter import inter_mgpu
from pallas_kernels.kda.mosaic_gpu.pairs import intra_pairs_mgpu
from pallas_kernels.kda.mosaic_gpu.segmented_inter import inter_segments
from pallas_kernels.kda.reference import host_offsets
from pallas_kernels.kda.triton.inter import inter_fused, inter_two_pass
from pallas_kernels.kda.triton.intra import chunk_inverses, intra_pairs, intra_wu
from pallas_kernels.kda.triton.intra_blocks import compiler_params
from pallas_kernels.kda.varlen_layout import chunk_layout, from_aligned, to_aligned

_F32 = jnp.float32


def pair_matrices(ins, *, scale, fused, lower_bound, interpret, params, pairs):
    """``(L fp32, bk, Qg, Kd, Aqk, gl)`` of every chunk from the named pair kernel
    (``gpu_config.STAGE_KERNELS``; ``params``: the Triton one's launch parameters). ``ins``: q, k,
    v, g, beta [, gate_scale, dt_bias when ``fused``]."""
    if pairs == "mosaic_gpu":
        return intra_pairs_mgpu(ins, scale=scale, fused=fused, lower_bound=lower_bound,
                                interpret=interpret)
    return intra_pairs(ins, scale=scale, fused=fused, lower_bound=lower_bound,
                       interpret=interpret, params=params)


def intra_stage(ins, *, scale, fused, lower_bound, interpret, params, inverse_params, pairs,
                with_wu):
    """``(X, bk, W, U, Qg, Kd, Aqk, gl)`` of every chunk, ``X = (I + L)^{-1}`` (the backward
    reuses it); W and U None without ``with_wu`` (the fused and segmented inter stages form them
    in their loops). ``inverse_params``: the inverse kernel's launch parameters (it wants fewer
    warps than the others); ``pairs``: the pair kernel (``pair_matrices``)."""
    v, beta = ins[2], ins[4]
    L, bk, qg, kd, aqk, gl = pair_matrices(ins, scale=scale, fused=fused, lower_bound=lower_bound,
                                           interpret=interpret, params=params, pairs=pairs)
    x = chunk_inverses(L, qg.dtype, interpret=interpret, params=inverse_params)
    w, u = (intra_wu(x, bk, v, beta, fused=fused, interpret=interpret, params=params)
            if with_wu else (None, None))
    return x, bk, w, u, qg, kd, aqk, gl


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "fused", "lower_bound",
                                             "config", "keep_intra"))
def _forward(q, k, v, g, beta, initial_state, gate_scale, dt_bias, chunk_offsets=None, *, scale,
             interpret, fused, lower_bound, config: GpuChunkConfig, keep_intra):
    """Inputs padded to whole chunks (whole segments); ``chunk_offsets`` (int32 [N + 1]) marks a
    chunk-aligned packed batch (B == 1). Returns ``(o, final state)``, with ``keep_intra`` also
    ``(X, Aqk)``."""
    ins = (q, k, v, g, beta) + ((gate_scale, dt_bias) if fused else ())
    params = compiler_params(interpret, config.num_warps, config.num_stages)
    x, bk, w, u, qg, kd, aqk, gl = intra_stage(
        ins, scale=scale, fused=fused, lower_bound=lower_bound, interpret=interpret,
        params=compiler_params(interpret, INTRA_WARPS, config.num_stages),
        inverse_params=compiler_params(interpret, INVERSE_WARPS, config.num_stages),
        pairs=config.pairs, with_wu=config.with_wu_kernel)
    if config.inter == "two_pass":
        o, ht = inter_two_pass(w, u, qg, kd, aqk, gl, initial_state, chunk_offsets,
                               block_v=config.block_v, out_dtype=v.dtype, interpret=interpret,
                               params=params)
    elif config.inter == "segments":
        o, ht = inter_segments(x, bk, v, beta, qg, kd, aqk, gl, initial_state,
                               segments=config.segments, fused=fused, interpret=interpret)
    elif config.inter_kernel == "mosaic_gpu":
        o, ht = inter_mgpu(x, bk, v, beta, qg, kd, aqk, gl, initial_state, fused=fused,
                           interpret=interpret)
    else:
        o, ht = inter_fused(x, bk, v, beta, qg, kd, aqk, gl, initial_state, chunk_offsets,
                            block_v=config.block_v, fused=fused, interpret=interpret,
                            params=params)
    return (o, ht) + (((x, aqk),) if keep_intra else ())


def gpu_chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    cu_seqlens: object | None = None,
    config: GpuChunkConfig | None = None,
    return_intra: bool = False,
) -> tuple[jax.Array, ...]:
    """Chunked KDA forward on pre-activated inputs (safe gate; fla conventions).

    q, k [B, T, H, K] L2-normalised; v [B, T, H, V]; g [B, T, H, K] log-decay in [-5, 0];
    beta [B, T, H]; initial_state fp32 [B, H, K, V] or None. Returns ``(o in v.dtype, final state
    fp32 [B, H, K, V])``. Runs in interpret mode off GPU. ``cu_seqlens``: host int offsets
    [N + 1] of packed sequences (B == 1); then initial_state and the final state are
    [N, H, K, V]. ``config``: the stages' forms and kernels, by default
    ``GpuChunkConfig.for_problem``. ``return_intra``: also return every chunk's ``(X, Aqk)``
    [B, Tp, H, 64] (``X = (I + L)^{-1}``, in the kernel's padded or chunk-aligned token layout and
    the intermediates' dtype) for ``gpu_chunk_kda_bwd(..., intra=...)``, which then skips the
    intra stage's pair products and inverse: the residuals fla's backward keeps too.
    """
    return _run(q, k, v, g, beta, None, None, scale, initial_state, False, 0.0, cu_seqlens,
                config, return_intra)


def gpu_chunk_kda_fused(
    q_raw: jax.Array,
    k_raw: jax.Array,
    v: jax.Array,
    g_raw: jax.Array,
    beta_logits: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    *,
    lower_bound: float,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    cu_seqlens: object | None = None,
    config: GpuChunkConfig | None = None,
    return_intra: bool = False,
) -> tuple[jax.Array, ...]:
    """As ``gpu_chunk_kda`` with K3's input activations fused into the intra stage
    (``reference.activate``): q, k raw (L2-normalised in the kernel); g_raw [B, T, H, K] the gate
    pre-activation, ``g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias))``; A_log [H]
    (or K3's zero-padded [>= H], first H used); dt_bias [H * K]; beta_logits [B, T, H]. The same
    computation as fla ``chunk_kda(..., use_qk_l2norm_in_kernel, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, safe_gate, lower_bound)``. A gate or beta logit of -inf makes its
    step an identity (how padding is written).
    """
    if not LOWER_BOUND_MIN <= lower_bound < 0:
        raise ValueError(f"lower_bound: expected a value in [{LOWER_BOUND_MIN}, 0), "
                         f"got {lower_bound}")
    H, K = q_raw.shape[2], q_raw.shape[3]
    gate_scale, dt = gate_params(A_log, dt_bias, H, K)
    return _run(q_raw, k_raw, v, g_raw, beta_logits, gate_scale, dt, scale, initial_state, True,
                float(lower_bound), cu_seqlens, config, return_intra)


def gate_params(A_log: jax.Array, dt_bias: jax.Array, H: int, K: int) -> tuple[jax.Array, jax.Array]:
    """The fused gate's per-head inputs as the intra stage reads them: ``exp(A_log[h])``
    broadcast to [H, K] (A_log [H] or K3's zero-padded [>= H]) and dt_bias as [H, K], fp32."""
    gate_scale = jnp.broadcast_to(jnp.exp(A_log.reshape(-1)[:H].astype(_F32))[:, None], (H, K))
    return gate_scale, dt_bias.astype(_F32).reshape(H, K)


def _run(q, k, v, g, beta, gate_scale, dt_bias, scale, initial_state, fused, lower_bound,
         cu_seqlens, config, keep_intra):
    """Checks, picks the config, pads to whole chunks (or the packed chunk-aligned layout) and
    runs ``_forward``. Padding happens outside the jit so that every T with the same chunk count
    shares a compile."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    interpret = interpret_mode(K, V, "KDA")
    offsets = None if cu_seqlens is None else host_offsets(cu_seqlens, T)
    if offsets is not None and B != 1:
        raise ValueError(f"cu_seqlens: packed sequences need B == 1, got q shape {q.shape}")
    n_seq = B if offsets is None else offsets.size - 1
    problem = ChunkProblem.of(q, k, v, g, n_seq, offsets is not None)
    config = GpuChunkConfig.for_problem(problem) if config is None else config.checked(problem)
    if initial_state is None:
        initial_state = jnp.zeros((n_seq, H, K, V), _F32)
    if tuple(initial_state.shape) != (n_seq, H, K, V):
        layout = "[B, H, K, V]" if offsets is None else "[N, H, K, V] with N = len(cu_seqlens) - 1"
        raise ValueError(f"initial_state: expected shape {(n_seq, H, K, V)} {layout}, "
                         f"got {tuple(initial_state.shape)}")
    kw = dict(scale=K**-0.5 if scale is None else float(scale), interpret=interpret, fused=fused,
              lower_bound=lower_bound, config=config, keep_intra=keep_intra)
    # Padding steps are identities: k = v = 0, beta = 0 and g = 0; with the fused activations the
    # gate and beta pre-activations are padded with -inf (sigmoid(-inf) = 0).
    neg = -jnp.inf if fused else 0.0
    if offsets is not None:
        return _run_packed(q, k, v, g, beta, gate_scale, dt_bias, initial_state, offsets, neg, kw)
    n_chunks = -(-T // C)
    Tp = -(-n_chunks // config.segments) * config.segments * C  # whole segments of whole chunks
    if Tp != T:
        pad = lambda x, c=0.0: jnp.pad(  # noqa: E731
            x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2), constant_values=c)
        q, k, v, g, beta = pad(q), pad(k), pad(v), pad(g, neg), pad(beta, neg)
    o, ht, *kept = _forward(q, k, v, g, beta, initial_state.astype(_F32), gate_scale, dt_bias,
                            **kw)
    # (X, Aqk) of whole chunks only, as the backward takes them: no padding segments' chunks
    kept = [tuple(t[:, :n_chunks * C] for t in intra) for intra in kept]
    return ((o if Tp == T else o[:, :T]), ht, *kept)


def _run_packed(q, k, v, g, beta, gate_scale, dt_bias, initial_state, offsets: np.ndarray, neg,
                kw):
    """Packed sequences on the chunk-aligned layout (``varlen_layout.py``), in which each sequence
    starts on a chunk boundary, so the intra stage runs unchanged and the inter kernels loop over
    one sequence's chunk range per program."""
    layout = chunk_layout(offsets, C)
    q, k, v = (to_aligned(x, layout) for x in (q, k, v))
    g, beta = to_aligned(g, layout, neg), to_aligned(beta, layout, neg)
    o, *rest = _forward(q, k, v, g, beta, initial_state.astype(_F32), gate_scale, dt_bias,
                        jnp.asarray(layout.chunk_offsets), **kw)
    return (from_aligned(o, layout), *rest)

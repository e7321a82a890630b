"""Expert-parallel routed experts under `jax.shard_map`: the math of `experts_ragged_dot`, experts split over `expert`.

    out = ep_routed_experts(x, w1, w2, w3, weights, ids, mesh=mesh, beta=b, linear_beta=lb)  # fp32 [N, out]

Shapes and sharding (global arrays in, global array out; call it inside the caller's `jax.jit`):
  x [N, in] (any float dtype), weights [N, k] fp32, ids [N, k] int32 (global expert ids);
  w1, w3 [E, F, in], w2 [E, out, F] dense or `MXFP4Experts` (kept packed into the local Pallas
  kernels for decode-sized batches, as `routed_experts` does; decoded here, shard by shard, otherwise);
  E must be divisible by the size of `expert_axis`; each device holds E/ep experts
  (w1/w3 `P(expert, tensor, None)`, w2 `P(expert, None, tensor)` — exactly DEFAULT_RULES' layout of
  `RoutedExperts`: exp->expert, mlp_moe->tensor, embed_moe replicated). F is split over `tensor_axis`
  when it divides (gate/up/SiTU are elementwise in F, the down GEMM's partial sums are psum'd over
  `tensor` before the cast to x.dtype, as the reference casts after its full fp32 sum); otherwise F is
  replicated. Tokens are split over `token_axes` (and over `expert` too for "all_to_all"/"allgather");
  N is padded internally to a multiple of the token shards (padded pairs carry a sentinel expert id
  and are never computed or sent), so any N works. Inputs already laid out this way are not moved.

Strategies (all dropless, all differentiable w.r.t. x, w1, w2, w3 and weights):
  "all_to_all" tokens on (token_axes..., expert). Each device sorts its N_loc*k (token, expert) pairs by
      expert (hence by destination shard), sends each row to the shard owning its expert, runs the
      local grouped GEMMs over its E/ep experts (`lax.ragged_dot_general` with LOCAL group sizes),
      sends the x.dtype results back, and combines them with the routing weights in fp32 at home.
      Exchange: `exchange="ragged"` uses `jax.lax.ragged_all_to_all` (moves only the real rows; counts
      are all-gathered first, as MaxText's `ra2a_and_route`). XLA:CPU does not implement the
      `ragged-all-to-all` HLO (jax 0.11.2: "UNIMPLEMENTED ... not supported by XLA:CPU ThunkEmitter"),
      so `exchange="padded"` does the same exchange with a dense `lax.all_to_all` of a buffer
      [ep, C, in] per device, C = N_loc * min(k, E/ep) — the worst case for one (source, destination)
      pair, so nothing is ever dropped, at ep*C/(N_loc*k) times the real traffic. The ragged exchange
      carries its own VJP (`_ragged_exchange`: the reverse exchange), as autodiff through
      `ragged_all_to_all` gave wrong gradients on two H200s. On GPU, XLA's default ragged-all-to-all
      lowering (jax 0.11.2) took 45.5 ms for [32768, 3584] bf16 rows per device where a dense
      all_to_all of them took 0.87 ms, and it has a known corruption bug in its one-shot path; with
      XLA's decomposer (`RAGGED_GPU_FLAG` in XLA_FLAGS) the whole EP layer ran at the padded exchange's
      speed (benchmarks/RESULTS.md). So "ragged" on GPU requires that flag, and "auto" = ragged on TPU
      and on GPU with the flag, padded otherwise.
  "allgather" (MaxText ring-of-experts) tokens on (token_axes..., expert). All-gather x, weights, ids
      along `expert` (before the k-fold replication: N_loc*in per peer, not N_loc*k*in), each device
      computes the pairs routed to its own experts (others masked out of the grouped GEMM), and a
      `psum_scatter` over `expert` sums the fp32 partial outputs and returns each device its tokens.
  "decode" tokens on token_axes only, i.e. replicated across `expert`: each device computes its local
      experts' pairs and a `psum` over `expert` adds them (jax-llm-examples' `moe_block_ep`). One
      collective, no all-gather; for a few tokens per step.
  "auto" "decode" when a token shard holds <= decode_max_tokens tokens, else whichever of "all_to_all"
      and "allgather" moves fewer bytes per token by `dispatch_bytes_per_token` (with the exchange in
      use: the padded exchange is never chosen by auto over the ring, the ragged one is at K3 shapes).

Compute note: rows of the grouped GEMMs are sized for the worst case (dropless, static shapes); rows past
the sum of the local group sizes are zero and masked. XLA:CPU's ragged_dot costs groups x all rows (it
computes every group densely and masks), so CPU timings say nothing about GPU/TPU; the ragged
all-to-all path's receive buffer has the same worst-case size (MaxText's `ragged_buffer_factor=-1`). A
bounded buffer factor (drop on overflow) is not implemented. Communication per strategy at K3 shapes and
the measured CPU overheads: benchmarks/RESULTS.md, "Expert-parallel dispatch".

LatentMoE (`k3jax/nn/moe.py`) calls it in place of `routed_experts` when it holds an expert mesh
(`expert_mesh`), with its expert weights as stored (dense or MXFP4). What the call relies on:

  latent_in [B*T, latent] and weights/ids [B*T, k] come from the flattened batch, whose rows GSPMD has
  on ("data", "fsdp") (activation_batch); the function reshards them to its token layout itself.
  The expert weights must stay sharded as DEFAULT_RULES gives them (`exp`->expert, `mlp_moe`->tensor);
  `embed_moe` must stay replicated (it is, by the rules) — a weight sharded some other way is resharded
  to the layout above by the shard_map's in_specs, i.e. all-gathered, which is correct but slow.
  The result is fp32 [B*T, latent] sharded like the tokens; the rest of LatentMoE (norm, up-proj,
  shared experts) stays GSPMD. Under a mesh with expert size 1, `routed_experts` is the right call.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.moe.api import Weights, auto_implementation, mxfp4_in_kernels
from pallas_kernels.moe.reference import MXFP4Experts, combine_by_token, decode_experts, situ
from pallas_kernels.precision import exact_if_fp32

F32 = jnp.float32
Strategy = Literal["auto", "all_to_all", "allgather", "decode"]
Exchange = Literal["auto", "ragged", "padded"]
Implementation = Literal["auto", "xla", "pallas"]

# rows [M, in] against w [G, out, in]: contract rows' dim 1 with w's dim 2, rows grouped along dim 0.
_RAGGED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


# ---- communication volume (analytic) ---------------------------------------------------------------


def dispatch_bytes_per_token(
    strategy: str, *, ep: int, k: int, num_experts: int, d_in: int, d_out: int, itemsize: int,
    exchange: str = "ragged",
) -> float:
    """Bytes on the interconnect per token, all devices of one expert group together, uniform routing.

    For all_to_all/allgather (a device holds N_loc tokens) this is also what one device sends (and, by
    symmetry, receives) per token it holds; times N_loc it is one device's traffic per step. For decode
    (every device of the group holds the same N_loc tokens) one device sends 1/ep of it per token.
    all_to_all/ragged: k*(ep-1)/ep rows of d_in leave (plus an int32 local expert id each), the same
        number of d_out results come back (x.dtype); the counts (ep int32 per device per step) are ignored.
    all_to_all/padded: (ep-1) peers x C/N_loc = min(k, E/ep) rows per token, both ways, zeros included.
    allgather: (ep-1) x (x row + k fp32 weights + k int32 ids) gathered, (ep-1) x d_out fp32 reduce-scattered.
    decode: a ring psum (all-reduce) of the fp32 d_out partial sums, 2 (ep-1)/ep per device, on ep devices.
    """
    if ep == 1:
        return 0.0
    if strategy == "all_to_all":
        if exchange == "padded":
            rows = (ep - 1) * min(k, num_experts // ep)
        else:
            rows = k * (ep - 1) / ep
        return rows * (d_in * itemsize + 4) + rows * d_out * itemsize
    if strategy == "allgather":
        return (ep - 1) * (d_in * itemsize + 8 * k) + (ep - 1) * d_out * 4
    if strategy == "decode":
        return 2 * (ep - 1) * d_out * 4
    raise ValueError(f"unknown strategy {strategy!r}")


# ---- per-device pieces -----------------------------------------------------------------------------


def _grouped_mlp(rows, group_sizes, w1, w2, w3, *, beta, linear_beta, f_axis, implementation):
    """SiTU-GLU of rows grouped by local expert; rows past sum(group_sizes) come out zero. -> rows.dtype.

    "pallas": the Pallas grouped GEMMs (gate+up+SiTU fused, then down; custom VJP), else
    `lax.ragged_dot_general` (which reaches only 7-28 TFLOP/s at K3's expert shapes on an H200). With F
    split over `tensor`, the Pallas down GEMM hands its partial sums over in rows.dtype: one rounding more
    than the XLA path's fp32 psum (bf16: 2^-9 relative, the size of the output's own rounding)."""
    dtype = rows.dtype
    if implementation == "pallas":
        from pallas_kernels.moe.pallas_experts import grouped_expert_mlp  # noqa: PLC0415 (GPU path only)

        out = grouped_expert_mlp(rows, group_sizes, w1, w2, w3, beta=beta, linear_beta=linear_beta)
    else:
        def grouped(lhs, rhs):
            return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, _RAGGED_DIMS, preferred_element_type=F32,
                                              precision=exact_if_fp32(lhs.dtype))

        hidden = situ(grouped(rows, w1).astype(dtype), grouped(rows, w3).astype(dtype), beta, linear_beta)
        out = grouped(hidden, w2)
    if f_axis is not None:  # F split over tensor: the down GEMM gave partial sums over F
        out = jax.lax.psum(out.astype(F32), f_axis)
    return out.astype(dtype)


def _local_experts_partial(x, weights, ids, w1, w2, w3, *, expert_axis, mlp):
    """fp32 [M, out]: sum over the pairs routed to THIS device's experts only (the rest contribute 0)."""
    m, k = ids.shape
    e_loc = w1.shape[0]
    e0 = jax.lax.axis_index(expert_axis) * e_loc
    lid = ids.reshape(-1) - e0
    key = jnp.where((lid >= 0) & (lid < e_loc), lid, e_loc)  # e_loc: not ours (or padding), sorts last
    order = jnp.argsort(key, stable=True)[: m * min(k, e_loc)]  # a token has <= min(k, e_loc) local pairs
    group_sizes = jnp.bincount(key, length=e_loc).astype(jnp.int32)
    token_of = order // k
    out = mlp(x[token_of], group_sizes, w1, w2, w3)
    pair_w = jnp.where(key[order] < e_loc, weights.reshape(-1)[order], 0.0)
    return combine_by_token(out, pair_w, token_of, m)


def _allgather_body(x, weights, ids, w1, w2, w3, *, expert_axis, mlp):
    gather = lambda a: jax.lax.all_gather(a, expert_axis, axis=0, tiled=True)  # noqa: E731
    partial = _local_experts_partial(gather(x), gather(weights), gather(ids), w1, w2, w3,
                                     expert_axis=expert_axis, mlp=mlp)
    return jax.lax.psum_scatter(partial, expert_axis, scatter_dimension=0, tiled=True)


def _decode_body(x, weights, ids, w1, w2, w3, *, expert_axis, mlp):
    # x, weights, ids are replicated over `expert`; mark them varying explicitly, so the transpose of this
    # cast (a psum of the whole [M, in] cotangent) is what sums the devices' gradients. Left implicit,
    # jax 0.11.2 puts the psum on the gathered rows' cotangent instead (each device gathered different
    # rows), and d/dx, d/dweights come out wrong; tests/sharding/test_expert_parallel.py checks this.
    x, weights, ids = (jax.lax.pcast(a, expert_axis, to="varying") for a in (x, weights, ids))
    partial = _local_experts_partial(x, weights, ids, w1, w2, w3, expert_axis=expert_axis, mlp=mlp)
    return jax.lax.psum(partial, expert_axis)


def _all_to_all_body(x, weights, ids, w1, w2, w3, *, expert_axis, ep, num_experts, exchange, mlp):
    n, k = ids.shape
    e_loc = w1.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by expert, hence by destination shard; padding (id E) last
    sorted_ids = flat[order]
    dest = sorted_ids // e_loc  # padding -> ep, out of range
    send_counts = jnp.bincount(dest, length=ep).astype(jnp.int32)
    starts = (jnp.cumsum(send_counts) - send_counts).astype(jnp.int32)
    sorted_lid = jnp.where(sorted_ids < num_experts, sorted_ids - dest * e_loc, e_loc).astype(jnp.int32)
    cap = n * min(k, e_loc)  # most rows one source can send one destination

    if exchange == "padded":
        c = jnp.arange(cap, dtype=jnp.int32)
        slot_valid = c[None, :] < send_counts[:, None]  # [ep, cap]
        slot_sorted = jnp.where(slot_valid, starts[:, None] + c[None, :], 0)
        slot_pair = order[slot_sorted]  # original pair index of each slot
        send_x = jnp.where(slot_valid[..., None], x[slot_pair // k], 0).astype(x.dtype)  # [ep, cap, in]
        send_lid = jnp.where(slot_valid, sorted_lid[slot_sorted], e_loc)
        a2a = lambda a: jax.lax.all_to_all(a, expert_axis, 0, 0, tiled=True)  # noqa: E731
        recv_x, recv_lid = a2a(send_x).reshape(ep * cap, -1), a2a(send_lid).reshape(-1)
        out = _expert_side(recv_x, recv_lid, w1, w2, w3, mlp)
        back = a2a(out.reshape(ep, cap, -1))  # [ep, cap, out], slot for slot what this device sent
        pair_w = jnp.where(slot_valid, weights.reshape(-1)[slot_pair], 0.0)
        contrib = back.astype(F32) * pair_w[..., None]
        return jnp.zeros((n, back.shape[-1]), F32).at[(slot_pair // k).reshape(-1)].add(
            contrib.reshape(ep * cap, -1))

    # ragged: counts matrix counts[s, d] = rows shard s sends shard d
    me = jax.lax.axis_index(expert_axis)
    counts = jax.lax.all_gather(send_counts, expert_axis, axis=0, tiled=False)  # [ep, ep]
    # where my rows land in shard d's receive buffer: after those of shards s < me
    before = jnp.cumsum(counts, axis=0) - counts  # before[s, d] = sum_{s' < s} counts[s', d]
    out_offsets = before[me].astype(jnp.int32)
    recv_sizes = counts[:, me].astype(jnp.int32)
    recv_offsets = before[:, me].astype(jnp.int32)
    recv_cap = ep * cap
    rows = x[order // k]  # [n*k, in], sorted by expert
    # back: I send shard s its rows (at recv_offsets[s]); they land at its starts[me] = sum_{d < me} counts[s, d]
    home_offsets = (jnp.cumsum(counts, axis=1) - counts)[:, me].astype(jnp.int32)
    there = (starts, send_counts, out_offsets, recv_sizes)
    home = (recv_offsets, recv_sizes, home_offsets, send_counts)
    recv_x = _ragged_exchange(rows, there, home, recv_cap, expert_axis)
    recv_lid = jax.lax.ragged_all_to_all(sorted_lid[:, None], jnp.full((recv_cap, 1), e_loc, jnp.int32), *there,
                                         axis_name=expert_axis)[:, 0]
    out = _expert_side(recv_x, recv_lid, w1, w2, w3, mlp)  # [recv_cap, out], receive order
    back = _ragged_exchange(out, home, there, n * k, expert_axis)  # [n*k, out] in sorted-pair order
    pair_w = jnp.where(sorted_ids < num_experts, weights.reshape(-1)[order], 0.0)
    return combine_by_token(back, pair_w, order // k, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged_exchange(rows, params, reverse, out_rows, axis_name):
    """`ragged_all_to_all` of rows into a zero buffer of out_rows rows; params = (input offsets, send
    sizes, output offsets, receive sizes), reverse = the same for the way back.

    Its gradient is the exchange the other way (the rows a device received go back where they came
    from), written out here with the offsets the forward already has, instead of JAX's transpose rule:
    on two H200s (jax 0.11.2) autodiff of the ragged exchange gave wrong x and weight gradients (rel.
    error 1-2, with and without XLA's decomposer; benchmarks/RESULTS.md) while the forward was exact."""
    buffer = jnp.zeros_like(rows, shape=(out_rows, *rows.shape[1:]))  # varies over rows' mesh axes, as rows
    return jax.lax.ragged_all_to_all(rows, buffer, *params, axis_name=axis_name)


def _ragged_exchange_fwd(rows, params, reverse, out_rows, axis_name):
    return _ragged_exchange(rows, params, reverse, out_rows, axis_name), (rows.shape[0], reverse)


def _ragged_exchange_bwd(out_rows, axis_name, res, ct):
    in_rows, reverse = res
    return _ragged_exchange(ct, reverse, None, in_rows, axis_name), None, None


_ragged_exchange.defvjp(_ragged_exchange_fwd, _ragged_exchange_bwd)


def _expert_side(recv_x, recv_lid, w1, w2, w3, mlp):
    """Received rows (any order, lid = local expert or e_loc for empty slots) -> outputs in the same order."""
    e_loc = w1.shape[0]
    order = jnp.argsort(recv_lid, stable=True)
    group_sizes = jnp.bincount(recv_lid, length=e_loc).astype(jnp.int32)  # e_loc (empty) not counted
    out = mlp(recv_x[order], group_sizes, w1, w2, w3)
    return out[jnp.argsort(order)]  # inverse permutation: back to receive order


# ---- entry point -----------------------------------------------------------------------------------


RAGGED_GPU_FLAG = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"


def _resolve_exchange(exchange: Exchange) -> str:
    backend = jax.default_backend()
    decomposed = RAGGED_GPU_FLAG in os.environ.get("XLA_FLAGS", "")
    if exchange == "auto":
        return "ragged" if backend == "tpu" or (backend == "gpu" and decomposed) else "padded"
    if exchange not in ("ragged", "padded"):
        raise ValueError(f"exchange={exchange!r}: expected 'auto', 'ragged' or 'padded'")
    if exchange == "ragged" and backend == "gpu" and not decomposed:
        raise ValueError(
            f"exchange='ragged' on GPU: XLA's default ragged-all-to-all lowering (jax 0.11.2) ran ~50x slower "
            f"than a dense all_to_all of the same rows and has a known corruption bug; set "
            f"XLA_FLAGS={RAGGED_GPU_FLAG} before JAX starts, or use exchange='padded'")
    return exchange


def resolve_strategy(
    strategy: Strategy, *, n_tokens: int, k: int, num_experts: int, d_in: int, d_out: int, itemsize: int,
    mesh: Mesh, expert_axis: str = "expert", token_axes: Sequence[str] = ("data", "fsdp"),
    exchange: Exchange = "auto", decode_max_tokens: int = 64,
) -> str:
    """The strategy "auto" runs (others are returned as given, after a check)."""
    if strategy not in ("auto", "all_to_all", "allgather", "decode"):
        raise ValueError(f"strategy={strategy!r}: expected 'auto', 'all_to_all', 'allgather' or 'decode'")
    if strategy != "auto":
        return strategy
    ep = mesh.shape[expert_axis]
    n_tok = math.prod(mesh.shape[a] for a in token_axes if a != expert_axis)
    if ep == 1 or -(-n_tokens // n_tok) <= decode_max_tokens:
        return "decode"
    kw = dict(ep=ep, k=k, num_experts=num_experts, d_in=d_in, d_out=d_out, itemsize=itemsize,
              exchange=_resolve_exchange(exchange))
    a2a, ring = dispatch_bytes_per_token("all_to_all", **kw), dispatch_bytes_per_token("allgather", **kw)
    return "all_to_all" if a2a < ring else "allgather"


def _keep_packed(w2: Weights, implementation: str, pairs: int, num_experts: int, f_shards: int | None) -> bool:
    """MXFP4 experts go packed into the local Pallas kernels where `routed_experts` would keep them packed
    (`mxfp4_in_kernels`) and each `tensor` shard of w2's F holds whole 32-input scale blocks."""
    return (isinstance(w2, MXFP4Experts) and mxfp4_in_kernels(implementation, pairs, num_experts)
            and (not f_shards or w2.scale.shape[-1] % f_shards == 0))


def ep_routed_experts(
    x: jax.Array, w1: Weights, w2: Weights, w3: Weights, weights: jax.Array, ids: jax.Array,
    *, mesh: Mesh, beta: float, linear_beta: float | None, strategy: Strategy = "auto",
    expert_axis: str = "expert", token_axes: Sequence[str] = ("data", "fsdp"), tensor_axis: str | None = "tensor",
    exchange: Exchange = "auto", decode_max_tokens: int = 64, implementation: Implementation = "auto",
) -> jax.Array:
    """sum_j weights[n, j] * E_{ids[n, j]}(x[n]) in fp32 [N, out], experts split over `expert_axis`.

    Same math as `pallas_kernels.moe.reference.experts_ragged_dot`; see the module docstring for the
    strategies and the layouts. Static decisions (strategy, padding, buffer sizes) depend on shapes only.
    implementation: the local experts' grouped GEMMs, "xla" (`lax.ragged_dot_general`) or "pallas"
    (`grouped_expert_mlp`); "auto" = "pallas" for bf16 on GPU, as `routed_experts` picks.
    """
    n, k = ids.shape
    num_experts, f = w1.shape[0], w1.shape[1]
    ep = mesh.shape[expert_axis]
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over {expert_axis}={ep}")
    tok_axes = tuple(a for a in token_axes if a != expert_axis and mesh.shape[a] > 1)
    f_axis = tensor_axis if tensor_axis is not None and mesh.shape.get(tensor_axis, 1) > 1 \
        and f % mesh.shape[tensor_axis] == 0 else None
    exchange = _resolve_exchange(exchange)
    strategy = resolve_strategy(
        strategy, n_tokens=n, k=k, num_experts=num_experts, d_in=x.shape[1], d_out=w2.shape[1],
        itemsize=x.dtype.itemsize, mesh=mesh, expert_axis=expert_axis, token_axes=tok_axes,
        exchange=exchange, decode_max_tokens=decode_max_tokens,
    )

    row_axes = tok_axes if strategy == "decode" else (*tok_axes, expert_axis)
    shards = math.prod(mesh.shape[a] for a in row_axes)
    pad = -n % shards
    if pad:  # padded pairs: weight 0, sentinel expert id E (never sent, never computed)
        x = jnp.pad(x, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        ids = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=num_experts)
    ids = ids.astype(jnp.int32)
    weights = weights.astype(F32)

    if implementation == "auto":
        implementation = auto_implementation(x.dtype)
    if implementation not in ("xla", "pallas"):
        raise ValueError(f"implementation={implementation!r}: expected 'auto', 'xla' or 'pallas'")
    if not _keep_packed(w2, implementation, n * k, num_experts, f_axis and mesh.shape[f_axis]):
        w1, w2, w3 = (decode_experts(w, x.dtype) for w in (w1, w2, w3))

    def mlp(rows, group_sizes, a, b, c):
        return _grouped_mlp(rows, group_sizes, a, b, c, beta=beta, linear_beta=linear_beta, f_axis=f_axis,
                            implementation=implementation)

    if strategy == "decode":
        fn = lambda *a: _decode_body(*a, expert_axis=expert_axis, mlp=mlp)  # noqa: E731
    elif strategy == "allgather":
        fn = lambda *a: _allgather_body(*a, expert_axis=expert_axis, mlp=mlp)  # noqa: E731
    else:
        fn = lambda *a: _all_to_all_body(  # noqa: E731
            *a, expert_axis=expert_axis, ep=ep, num_experts=num_experts, exchange=exchange, mlp=mlp)

    def body(x, w1, w2, w3, weights, ids):
        return fn(x, weights, ids, w1, w2, w3)

    rows_spec = P(row_axes if row_axes else None, None)
    up_spec = P(expert_axis, f_axis, None)
    down_spec = P(expert_axis, None, f_axis)
    # A pallas_call's output carries no manual-axis (vma) type, and jax 0.11.2's Pallas interpreter
    # fails the vma check inside the kernel body, so the Pallas path runs the shard_map unchecked
    # (tests/sharding/test_expert_parallel.py checks its forward and gradients on every strategy).
    out = jax.shard_map(
        body, mesh=mesh,
        in_specs=(rows_spec, up_spec, down_spec, up_spec, rows_spec, rows_spec),
        out_specs=rows_spec, check_vma=implementation != "pallas",
    )(x, w1, w2, w3, weights, ids)
    return out[:n]


__all__ = ["dispatch_bytes_per_token", "ep_routed_experts", "resolve_strategy"]

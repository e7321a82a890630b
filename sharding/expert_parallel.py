"""Expert-parallel routed experts under `jax.shard_map`: the op of `pallas_kernels.moe.routed_experts`,
experts split over `expert`.

    out = ep_routed_experts(x, w1, w2, w3, weights, ids, mesh=mesh, beta=b, linear_beta=lb)  # fp32 [N, out]

Shapes and sharding (global arrays in, global array out; call it inside the caller's `jax.jit`):
  x [N, in] (any float dtype), weights [N, k] fp32, ids [N, k] int32 (global expert ids);
  w1, w3 [E, F, in], w2 [E, out, F] dense or `MXFP4Experts`;
  E must be divisible by the size of `expert_axis`; each device holds E/ep experts
  (w1/w3 `P(expert, tensor, None)`, w2 `P(expert, None, tensor)`: exactly DEFAULT_RULES' layout of
  `RoutedExperts`: exp->expert, mlp_moe->tensor, embed_moe replicated). F is split over `tensor_axis`
  when it divides (gate/up/SiTU are elementwise in F, the down GEMM's partial sums are psum'd over
  `tensor` before the cast to x.dtype, as the reference casts after its full fp32 sum); otherwise F is
  replicated. Tokens are split over `token_axes` (and over `expert` too for "all_to_all"/"allgather");
  N is padded internally to a multiple of the token shards (padded pairs carry a sentinel expert id
  and are never computed or sent), so any N works. Inputs already laid out this way are not moved.

Each device's local experts run through the routed experts' own dispatch
(`pallas_kernels.moe.grouped_mlp`: the same implementation names, policy and backend functions as one
device), on the rows routed to them, grouped by local expert. MXFP4 experts stay packed into the local
kernels wherever the single-device path would keep them packed for those rows; they are decoded before
the exchange only when the `tensor` split of F would cut w2's 32-input scale blocks.

Strategies (all dropless, all differentiable w.r.t. x, w1, w2, w3 and weights):
  "all_to_all" tokens on (token_axes..., expert). Each device sorts its N_loc*k (token, expert) pairs by
      expert (hence by destination shard), sends each row to the shard owning its expert, runs the local
      experts on what it received, sends the x.dtype results back, and combines them with the routing
      weights in fp32 at home (`expert_exchange.py`: the ragged or padded exchange).
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

Rows of the local grouped GEMMs are sized for the worst case (dropless, static shapes); rows past the
sum of the local group sizes are zero and masked. XLA:CPU's ragged_dot costs groups x all rows (it
computes every group densely and masks), so CPU timings say nothing about GPU/TPU. A bounded buffer
factor (drop on overflow) is not implemented. Communication per strategy at K3 shapes:
benchmarks/RESULTS.md, "Expert-parallel dispatch".

LatentMoE (`k3jax/nn/moe.py`) calls it in place of `routed_experts` when it holds an expert mesh
(`expert_mesh`), with its expert weights as stored (dense or MXFP4). latent_in [B*T, latent] and
weights/ids [B*T, k] come from the flattened batch, whose rows GSPMD has on ("data", "fsdp"); the
function reshards them to its token layout itself. The expert weights must stay sharded as
DEFAULT_RULES gives them (`embed_moe` replicated); a weight sharded some other way is resharded by the
shard_map's in_specs, i.e. all-gathered, which is correct but slow. The result is fp32 [B*T, latent]
sharded like the tokens. Under a mesh with expert size 1, `routed_experts` is the right call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.moe import grouped_mlp
from pallas_kernels.moe.dispatch import PALLAS_IMPLEMENTATIONS, choose_implementation
from pallas_kernels.moe.reference import Weights, combine_by_token
from pallas_kernels.mxfp4 import MXFP4Experts, decode_experts
from sharding.expert_exchange import RAGGED_GPU_FLAG, all_to_all_body, resolve_exchange

F32 = jnp.float32
Strategy = Literal["auto", "all_to_all", "allgather", "decode"]
Exchange = Literal["auto", "ragged", "padded"]


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


def _local_mlp(rows, group_sizes, w1, w2, w3, *, beta, linear_beta, f_axis, implementation) -> jax.Array:
    """The local experts' SiTU-GLU on rows grouped by local expert -> rows.dtype [M, out]. With F split
    over `tensor` the down products are partial sums over F, added in fp32 before the rounding (kernels
    whose down product already rounds to the rows' dtype hand it over rounded: bf16, 2^-9 relative, the
    size of the output's own rounding)."""
    out = grouped_mlp(rows, group_sizes, w1, w2, w3, beta=beta, linear_beta=linear_beta,
                      implementation=implementation)
    if f_axis is not None:
        out = jax.lax.psum(out.astype(F32), f_axis)
    return out.astype(rows.dtype)


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
              exchange=resolve_exchange(exchange))
    a2a, ring = dispatch_bytes_per_token("all_to_all", **kw), dispatch_bytes_per_token("allgather", **kw)
    return "all_to_all" if a2a < ring else "allgather"


# ---- entry point -----------------------------------------------------------------------------------


def _packed_splits(w2: Weights, f_shards: int | None) -> bool:
    """Whether each `tensor` shard of w2's F (f_shards of them) holds whole 32-input scale blocks."""
    return not f_shards or w2.scale.shape[-1] % f_shards == 0


def ep_routed_experts(
    x: jax.Array, w1: Weights, w2: Weights, w3: Weights, weights: jax.Array, ids: jax.Array,
    *, mesh: Mesh, beta: float, linear_beta: float | None, strategy: Strategy = "auto",
    expert_axis: str = "expert", token_axes: Sequence[str] = ("data", "fsdp"), tensor_axis: str | None = "tensor",
    exchange: Exchange = "auto", decode_max_tokens: int = 64, implementation: str | None = None,
) -> jax.Array:
    """sum_j weights[n, j] * E_{ids[n, j]}(x[n]) in fp32 [N, out], experts split over `expert_axis`.

    Same math as `pallas_kernels.moe.routed_experts`; see the module docstring for the strategies and
    the layouts. Static decisions (strategy, padding, buffer sizes, the implementation) depend on shapes
    only. implementation: the local experts' entry of `pallas_kernels.moe.IMPLEMENTATIONS`, or None for
    its policy, as `routed_experts` takes it.
    """
    n, k = ids.shape
    num_experts, f = w1.shape[0], w1.shape[1]
    ep = mesh.shape[expert_axis]
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over {expert_axis}={ep}")
    tok_axes = tuple(a for a in token_axes if a != expert_axis and mesh.shape[a] > 1)
    f_axis = tensor_axis if tensor_axis is not None and mesh.shape.get(tensor_axis, 1) > 1 \
        and f % mesh.shape[tensor_axis] == 0 else None
    exchange = resolve_exchange(exchange)
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

    if isinstance(w2, MXFP4Experts) and not _packed_splits(w2, f_axis and mesh.shape[f_axis]):
        w1, w2, w3 = (decode_experts(w, x.dtype) for w in (w1, w2, w3))
    impl = choose_implementation(implementation, dtype=x.dtype, packed=isinstance(w1, MXFP4Experts))
    mlp = functools.partial(_local_mlp, beta=beta, linear_beta=linear_beta, f_axis=f_axis,
                            implementation=impl.name)

    if strategy == "decode":
        fn = functools.partial(_decode_body, expert_axis=expert_axis, mlp=mlp)
    elif strategy == "allgather":
        fn = functools.partial(_allgather_body, expert_axis=expert_axis, mlp=mlp)
    else:
        fn = functools.partial(all_to_all_body, expert_axis=expert_axis, ep=ep, num_experts=num_experts,
                               exchange=exchange, mlp=mlp)

    def body(x, w1, w2, w3, weights, ids):
        return fn(x, weights, ids, w1, w2, w3)

    rows_spec = P(row_axes if row_axes else None, None)
    up_spec = P(expert_axis, f_axis, None)
    down_spec = P(expert_axis, None, f_axis)
    # A pallas_call's output carries no manual-axis (vma) type, and jax 0.11.2's Pallas interpreter
    # fails the vma check inside the kernel body, so the Pallas implementations run the shard_map
    # unchecked (tests/sharding/test_expert_parallel.py checks their forward and gradients).
    out = jax.shard_map(
        body, mesh=mesh,
        in_specs=(rows_spec, up_spec, down_spec, up_spec, rows_spec, rows_spec),
        out_specs=rows_spec, check_vma=impl.name not in PALLAS_IMPLEMENTATIONS,
    )(x, w1, w2, w3, weights, ids)
    return out[:n]


__all__ = ["RAGGED_GPU_FLAG", "dispatch_bytes_per_token", "ep_routed_experts", "resolve_strategy"]

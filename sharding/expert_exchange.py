"""The token exchange of the "all_to_all" expert-parallel strategy: each (token, expert) pair goes to
the shard that owns its expert and its result comes back.

Two exchanges. "ragged" uses `jax.lax.ragged_all_to_all`, which moves only the real rows (counts are
all-gathered first, as MaxText's `ra2a_and_route`); its receive buffer has the worst-case size
(MaxText's `ragged_buffer_factor=-1`), and it carries its own VJP (`_ragged_exchange`). "padded" does
the same exchange with a dense `lax.all_to_all` of a buffer [ep, C, in] per device, C = N_loc *
min(k, E/ep), the worst case for one (source, destination) pair, so nothing is ever dropped, at
ep*C/(N_loc*k) times the real traffic. XLA:CPU does not implement the `ragged-all-to-all` HLO (jax
0.11.2), and on GPU XLA's default lowering of it is far slower than a dense all_to_all of the same rows
and has a known corruption bug in its one-shot path; with XLA's decomposer (`RAGGED_GPU_FLAG` in
XLA_FLAGS) the whole layer runs at the padded exchange's speed (benchmarks/RESULTS.md). So "auto" is
ragged on TPU and on GPU with the flag, padded otherwise, and "ragged" on GPU requires the flag.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from pallas_kernels.moe.reference import combine_by_token
from pallas_kernels.platform import current_platform

F32 = jnp.float32
RAGGED_GPU_FLAG = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"


def resolve_exchange(exchange: str) -> str:
    """The exchange "auto" runs on this platform (others are returned as given, after a check)."""
    platform = current_platform()
    decomposed = RAGGED_GPU_FLAG in os.environ.get("XLA_FLAGS", "")
    if exchange == "auto":
        return "ragged" if platform == "tpu" or (platform == "gpu" and decomposed) else "padded"
    if exchange not in ("ragged", "padded"):
        raise ValueError(f"exchange={exchange!r}: expected 'auto', 'ragged' or 'padded'")
    if exchange == "ragged" and platform == "gpu" and not decomposed:
        raise ValueError(
            f"exchange='ragged' on GPU: XLA's default ragged-all-to-all lowering (jax 0.11.2) is far slower "
            f"than a dense all_to_all of the same rows and has a known corruption bug; set "
            f"XLA_FLAGS={RAGGED_GPU_FLAG} before JAX starts, or use exchange='padded'")
    return exchange


def all_to_all_body(x, weights, ids, w1, w2, w3, *, expert_axis, ep, num_experts, exchange, mlp):
    """fp32 [n, out] for this device's n tokens: each pair sent to the shard owning its expert, computed
    there by `mlp` on the shard's local experts, and sent back ("padded" or "ragged" `exchange`)."""
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
    on GPUs (jax 0.11.2) autodiff of the ragged exchange gave wrong x and weight gradients, with and
    without XLA's decomposer, while the forward was exact (benchmarks/RESULTS.md)."""
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

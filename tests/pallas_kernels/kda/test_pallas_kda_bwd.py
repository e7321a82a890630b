"""The GPU KDA backward (``gpu_backward``; interpret mode on CPU) against the pure-JAX analytic
backward.

The kernels recompute the chunk quantities with the forward's own intra kernels (whole-chunk pair
products from a Triton cumsum, 16x16-block inverse) while the pure-JAX backward uses XLA's cumsum
and its own inverse. With in-chunk log decays |G| up to ~160, fp32 rounding of the two cumsums moves
exp(G_last - G) by ~|G| * 6e-8 ~ 1e-5 relative, so the two agree to 2e-5 (both are within that of
autodiff of the reference).
block_v = 8 < V = 24 exercises the V split of the state recurrences, grads_block_k = 8 < K the
key-channel split of the gradient pass (grads_block_k = K: one channel block per chunk).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda.gpu_backward import gpu_chunk_kda_bwd
from pallas_kernels.kda.gpu_config import (
    INVERSE_WARPS, backward_config, chunk_config, default_states,
)
from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda
from pallas_kernels.kda.reference import chunked_kda
from tests.pallas_kernels.h200_lowering import lowered_for_h200
from tests.pallas_kernels.kda.chunk_backward import chunk_kda_bwd
from tests.pallas_kernels.kda.test_chunk_backward import NAMES, B, H, K, V, make_case, rel


def _args(x, with_state: bool) -> tuple:
    s0 = x["s0"] if with_state else jnp.zeros_like(x["s0"])
    return x["q"], x["k"], x["v"], x["g"], x["beta"], s0, x["do"], x["dht"]


@pytest.mark.parametrize("grads_block_k", [8, K])
@pytest.mark.parametrize(("T", "with_state"), [(1, True), (65, True), (150, False), (150, True)])
def test_matches_pure_jax_backward(T: int, with_state: bool, grads_block_k: int) -> None:
    args = _args(make_case(T, seed=T), with_state)
    want = chunk_kda_bwd(*args, scale=K**-0.5)
    got = gpu_chunk_kda_bwd(*args, scale=K**-0.5, config=backward_config(
        args[0], args[2], block_v=8, grads_block_k=grads_block_k))
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel(a, b) <= 2e-5, name


def test_bf16_matches_pure_jax_backward() -> None:
    """bf16 inputs: bf16 intermediates in HBM (kernels) vs fp32 ones (pure JAX), same matmuls;
    measured <= 3e-3."""
    x = make_case(130, seed=3)
    args = tuple(a.astype(jnp.bfloat16) if i in (0, 1, 2, 3, 4, 6) else a
                 for i, a in enumerate(_args(x, True)))
    want = chunk_kda_bwd(*args, scale=K**-0.5)
    got = gpu_chunk_kda_bwd(*args, scale=K**-0.5,
                            config=backward_config(args[0], args[2], block_v=8, grads_block_k=8))
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype, name
        assert rel(a, b) <= 1e-2, name


def test_default_blocks_fit_any_v() -> None:
    """Default V blocks that do not divide V (here 32 and 64 vs V = 24 and 48) fall back to V."""
    for v_dim in (24, 48):
        x = make_case(65, seed=2)
        x["v"], x["do"] = (jnp.concatenate([x[n]] * 2, axis=-1)[..., :v_dim] for n in ("v", "do"))
        x["s0"], x["dht"] = (jnp.concatenate([x[n]] * 2, axis=-1)[..., :v_dim]
                             for n in ("s0", "dht"))
        got = gpu_chunk_kda_bwd(*_args(x, True), scale=K**-0.5)
        assert got[2].shape == x["v"].shape and got[5].shape == x["s0"].shape


def test_validates_block_v() -> None:
    args = _args(make_case(1, seed=0), True)
    with pytest.raises(ValueError, match="^block_v"):
        backward_config(args[0], args[2], block_v=16)
    with pytest.raises(ValueError, match="^grads_block_k"):
        backward_config(args[0], args[2], grads_block_k=0)
    with pytest.raises(ValueError, match="dht: expected shape"):
        gpu_chunk_kda_bwd(*args[:7], args[7][:1], scale=1.0)


def _packed_case(seed: int) -> tuple[tuple, np.ndarray]:
    """Backward arguments of three packed sequences (5, 64 and 70 tokens) and their offsets."""
    lens = [5, 64, 70]
    cu = np.cumsum([0, *lens])
    x = make_case(sum(lens), seed=9)
    rng = np.random.default_rng(seed)
    s0, dht = (jnp.asarray(rng.standard_normal((len(lens), H, K, V)), jnp.float32) for _ in "ab")
    q, k, v, g, beta, do = (x[n][:1] for n in ("q", "k", "v", "g", "beta", "do"))
    return (q, k, v, g, beta, s0, do, dht), cu


def test_packed_sequences_match_reference_autodiff() -> None:
    """cu_seqlens: per-sequence recurrences on the chunk-aligned layout, one state per sequence."""
    args, cu = _packed_case(seed=10)
    _, vjp = jax.vjp(lambda *a: chunked_kda(*a[:5], scale=K**-0.5, initial_state=a[5],
                                            cu_seqlens=cu), *args[:6])
    want = vjp(args[6:])
    got = gpu_chunk_kda_bwd(*args, scale=K**-0.5, cu_seqlens=cu, config=backward_config(
        args[0], args[2], cu_seqlens=cu, block_v=8, grads_block_k=8))
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape, name
        assert rel(a, b) <= 2e-5, name


D_GPU = 32  # head size of the lowering tests: Triton widths are powers of two


def _abstract_bwd_args() -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes of the backward's arguments (bf16 tokens, fp32 gate, beta and states) for lowering."""
    f = jax.ShapeDtypeStruct
    tok, st = (1, 128, H, D_GPU), (1, H, D_GPU, D_GPU)
    return (f(tok, jnp.bfloat16), f(tok, jnp.bfloat16), f(tok, jnp.bfloat16), f(tok, jnp.float32),
            f((1, 128, H), jnp.float32), f(st, jnp.float32), f(tok, jnp.bfloat16), f(st, jnp.float32))


def test_warps_reach_only_their_stages() -> None:
    """``grads_warps`` sets the gradient pass's num_warps, ``states_warps`` the state recurrences',
    and the recompute keeps ``num_warps`` (lowered for an abstract H200 on CPU: the Triton custom
    calls carry their launch parameters)."""
    args = _abstract_bwd_args()
    config = backward_config(args[0], args[2], grads_warps=2, states_warps=1)
    fn = lambda *a: gpu_chunk_kda_bwd(*a, scale=D_GPU**-0.5, config=config)  # noqa: E731
    text = lowered_for_h200(fn, *args)
    warps = {re.search(r'name = "([^"]+)"', line).group(1): int(re.search(r"num_warps = (\d+)", line).group(1))
             for line in text.splitlines() if "__gpu$xla.gpu.triton" in line}
    assert {name: w for name, w in warps.items() if "grads" in name} == {
        "kda_bwd_grads_v_chunk": 2, "kda_bwd_grads_channels": 2}
    assert {name: w for name, w in warps.items() if "states" in name} == {
        "kda_states": 1, "kda_bwd_dstates": 1}
    others = {name: w for name, w in warps.items() if "grads" not in name and "states" not in name}
    assert others.pop("kda_intra_inverse") == INVERSE_WARPS  # its own launch parameter
    assert set(others.values()) == {8}  # the default


def _kept_intra(args: tuple, cu_seqlens=None) -> tuple:
    """The forward's ``(X, Aqk)`` for these backward arguments."""
    *_, intra = gpu_chunk_kda(*args[:5], scale=K**-0.5, initial_state=args[5],
                              cu_seqlens=cu_seqlens, return_intra=True)
    return intra


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_intra_from_the_forward_changes_nothing(dtype) -> None:
    """With the forward's X and Aqk the backward skips the pair products and the inverse; its
    one kernel for the rest of the intra stage makes the same values bit for bit, so every
    gradient is identical to the recomputing backward's (T = 130: a padded last chunk)."""
    x = make_case(130, seed=5)
    args = tuple(a.astype(dtype) if i in (0, 1, 2, 3, 4, 6) else a
                 for i, a in enumerate(_args(x, True)))
    intra = _kept_intra(args)
    assert all(a.shape == (B, 192, H, 64) and a.dtype == dtype for a in intra)
    kw = dict(scale=K**-0.5, config=backward_config(args[0], args[2], block_v=8, grads_block_k=8))
    got = gpu_chunk_kda_bwd(*args, intra=intra, **kw)
    want = gpu_chunk_kda_bwd(*args, **kw)
    for name, a, b in zip(NAMES, got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_intra_from_the_forward_packed_sequences() -> None:
    """Packed sequences: X and Aqk come in the chunk-aligned layout and are used as they come."""
    args, cu = _packed_case(seed=11)
    intra = _kept_intra(args, cu)
    assert intra[0].shape == (1, 64 * 4, H, 64)  # chunks of 5, 64, 70 tokens: 1 + 1 + 2
    kw = dict(scale=K**-0.5, cu_seqlens=cu, config=backward_config(
        args[0], args[2], cu_seqlens=cu, block_v=8, grads_block_k=8))
    got = gpu_chunk_kda_bwd(*args, intra=intra, **kw)
    want = gpu_chunk_kda_bwd(*args, **kw)
    for name, a, b in zip(NAMES, got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_intra_shape_is_checked() -> None:
    args = _args(make_case(65, seed=0), True)
    intra = _kept_intra(args)
    with pytest.raises(ValueError, match=r"^intra\[1\] \(Aqk\): expected shape \(2, 128, "):
        gpu_chunk_kda_bwd(*args, scale=1.0, intra=(intra[0], intra[1][:, :64]))


def test_kept_intra_lowers_without_a_second_pair_kernel() -> None:
    """Forward with ``return_intra`` and backward with ``intra``, lowered for an abstract H200:
    the pair and inverse kernels run once (in the forward, here the two-pass stage with its W/U
    kernel); the backward's intra stage is the one ``kda_intra_saved_parts`` kernel."""
    args = _abstract_bwd_args()

    def fwd_bwd(q, k, v, g, beta, s0, do, dht):
        config = chunk_config(q, k, v, g, inter="two_pass")
        *_, intra = gpu_chunk_kda(q, k, v, g, beta, initial_state=s0, config=config,
                                  return_intra=True)
        return gpu_chunk_kda_bwd(q, k, v, g, beta, s0, do, dht, scale=D_GPU**-0.5, intra=intra)

    text = lowered_for_h200(fwd_bwd, *args)
    names = re.findall(r'name = "(kda_[a-z_]+)"', text)
    assert names.count("kda_intra_pairs") == 1 and names.count("kda_intra_inverse") == 1
    assert names.count("kda_intra_wu") == 1 and names.count("kda_intra_saved_parts") == 1


@pytest.mark.parametrize("heads", [2, 128])
def test_default_states_by_sequence_heads(heads: int) -> None:
    """Without ``block_v`` / ``states_warps`` the state recurrences take ``default_states``: narrow
    blocks at 4 warps for few (sequence, head) pairs, whole 128-wide ones at 8 for many (checked on
    the Triton IR lowered for an abstract H200)."""
    f = jax.ShapeDtypeStruct
    tok, val, st = (1, 64, heads, 16), (1, 64, heads, 128), (1, heads, 16, 128)
    args = (f(tok, jnp.bfloat16), f(tok, jnp.bfloat16), f(val, jnp.bfloat16), f(tok, jnp.float32),
            f((1, 64, heads), jnp.float32), f(st, jnp.float32), f(val, jnp.bfloat16),
            f(st, jnp.float32))
    fn = lambda *a: gpu_chunk_kda_bwd(*a, scale=0.25)  # noqa: E731
    text = lowered_for_h200(fn, *args)
    block_v, warps = default_states(heads)
    assert (block_v, warps) == ((16, 4) if heads < 128 else (128, 8))
    for name in ("kda_states", "kda_bwd_dstates"):
        line = next(x for x in text.splitlines() if f'name = "{name}"' in x)
        assert f"num_warps = {warps} " in line and f"grid_z = {128 // block_v} " in line, name

"""Expert-parallel routed experts (sharding/expert_parallel.py) against `experts_ragged_dot`, on 8 fake CPU devices.

Tolerance, fp32: every strategy computes each (token, expert) row with the same per-row fp32 GEMMs as the
reference; what differs is the order of a few fp32 additions: the k contributions of a token are summed
on different devices and then psum / psum_scatter'ed (reference: one scatter-add in expert order), and
with F split over `tensor` the down GEMM's F-contraction is two partial sums plus a psum. Each reordering
costs ~1 ulp (6e-8) of the largest term, so the result is within a few 1e-7 of the reference (measured
max |diff| / max |ref| <= 3.1e-7, rel-RMS ~1e-7). The bound is 1e-6 rel-RMS (and 2e-6 max-abs relative);
a routing or sharding bug (a lost, duplicated or misrouted pair) costs >= 1e-2.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe.reference import experts_ragged_dot
from pallas_kernels.mxfp4 import MXFP4Experts, encode_mxfp4
from pallas_kernels.platform import current_platform, target
from sharding import make_mesh
from sharding.expert_exchange import resolve_exchange
from sharding.expert_parallel import RAGGED_GPU_FLAG, dispatch_bytes_per_token, ep_routed_experts, resolve_strategy
from tests.conftest import rel_rms

CPU = current_platform() == "cpu"
needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (jax_num_cpu_devices=8 on CPU)")

MESHES = ["expert=8", "data=2,expert=4", "data=2,expert=2,tensor=2"]
STRATEGIES = ["all_to_all", "allgather", "decode"]
E, K, D, F = 16, 4, 32, 24
BETA, LINEAR_BETA = 2.0, 3.0
REL_RMS, MAX_REL = 1e-6, 2e-6


def problem(n: int, routing: str, seed: int = 0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, D)).astype(np.float32)
    w1 = (r.normal(size=(E, F, D)) * 1.5 / D**0.5).astype(np.float32)
    w3 = (r.normal(size=(E, F, D)) / D**0.5).astype(np.float32)
    w2 = (r.normal(size=(E, D, F)) / F**0.5).astype(np.float32)
    if routing == "random":
        ids = np.stack([r.choice(E, K, replace=False) for _ in range(n)])
    elif routing == "skewed":  # every token on experts 0..K-1: all load on the first shard(s), the rest idle
        ids = np.tile(np.arange(K), (n, 1))
    elif routing == "sparse":  # four experts on three shards take everything; most experts get no token
        ids = np.stack([r.permutation([3, 4, 10, 15]) for _ in range(n)])
    else:
        raise ValueError(routing)
    weights = r.uniform(0.1, 1.0, size=(n, K)).astype(np.float32)
    return tuple(map(jnp.asarray, (x, w1, w2, w3, weights, ids.astype(np.int32))))


def reference(*args):
    return experts_ragged_dot(*args, beta=BETA, linear_beta=LINEAR_BETA)


def close(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == np.float32
    assert rel_rms(actual, expected) <= REL_RMS
    assert np.abs(actual - expected).max() <= MAX_REL * np.abs(expected).max()


def run(mesh, strategy, **kw):
    return jax.jit(lambda *a: ep_routed_experts(*a, mesh=mesh, beta=BETA, linear_beta=LINEAR_BETA,
                                                strategy=strategy, **kw))


def check_gradients(mesh, args, ct, variants):
    """d/d(x, w1, w2, w3, weights) of <out, ct> for each variant (ep_routed_experts keyword arguments),
    jitted, against the reference's gradients."""
    argnums = (0, 1, 2, 3, 4)
    want = jax.grad(lambda *a: jnp.sum(reference(*a) * ct), argnums)(*args)
    for kw in variants:
        loss = lambda *a, kw=kw: jnp.sum(ep_routed_experts(  # noqa: E731
            *a, mesh=mesh, beta=BETA, linear_beta=LINEAR_BETA, **kw) * ct)
        for g, w in zip(jax.jit(jax.grad(loss, argnums))(*args), want, strict=True):
            close(g, w)


@needs8
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_forward_matches_ragged_dot(mesh_spec):
    """All strategies x routings x awkward token counts (37: not a multiple of 8; 3: fewer tokens than shards)."""
    mesh = make_mesh(mesh_spec)
    for strategy in STRATEGIES:
        f = run(mesh, strategy)
        for routing in ("random", "skewed", "sparse"):
            for n in (37, 3):
                args = problem(n, routing)
                close(f(*args), reference(*args))


@needs8
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_gradients_match_ragged_dot(mesh_spec):
    """d/d(x, w1, w2, w3, weights) of <out, cotangent>: every path is differentiable and exact."""
    ct = jnp.asarray(np.random.default_rng(2).normal(size=(37, D)).astype(np.float32))
    check_gradients(make_mesh(mesh_spec), problem(37, "random", seed=1), ct,
                    [dict(strategy=strategy) for strategy in STRATEGIES])


@needs8
def test_layout_and_auto_choice():
    """Weights stay expert/tensor-split (nothing is gathered), outputs come out token-sharded; auto picks
    decode for few tokens and the cheaper dispatch otherwise."""
    mesh = make_mesh("data=2,expert=2,tensor=2")
    args = problem(64, "random")
    out = run(mesh, "auto", decode_max_tokens=4)(*args)
    close(out, reference(*args))
    assert out.sharding.spec[0] in (("data", "expert"), "data")
    common = dict(k=K, num_experts=E, d_in=D, d_out=D, itemsize=4, mesh=mesh)
    assert resolve_strategy("auto", n_tokens=8, **common) == "decode"
    # K3: top-16 of 896, latent 3584, bf16, EP=64: the ragged all-to-all moves ~6x less than the ring
    k3 = dict(k=16, num_experts=896, d_in=3584, d_out=3584, itemsize=2)
    a2a = dispatch_bytes_per_token("all_to_all", ep=64, exchange="ragged", **k3)
    ring = dispatch_bytes_per_token("allgather", ep=64, **k3)
    assert 200e3 < a2a < 250e3 and 1.3e6 < ring < 1.4e6
    # the padded (CPU) exchange is never cheaper than the ring at these shapes
    assert dispatch_bytes_per_token("all_to_all", ep=64, exchange="padded", **k3) > ring


@pytest.mark.skipif(CPU, reason="XLA:CPU has no ragged-all-to-all (jax 0.11.2: UNIMPLEMENTED in ThunkEmitter)")
@pytest.mark.skipif(current_platform() == "gpu" and RAGGED_GPU_FLAG not in os.environ.get("XLA_FLAGS", ""),
                    reason=f"GPU ragged exchange needs XLA_FLAGS={RAGGED_GPU_FLAG} (see expert_parallel.py)")
def test_ragged_all_to_all_exchange():
    """The real `ragged_all_to_all` exchange, forward and gradients (GPU/TPU, expert over all devices).

    On two H200s JAX's autodiff of the exchange gave gradients off by 100-200% (with or without the flag);
    the exchange's own VJP fixed that. benchmarks/ep_h200x2.py runs this test with the flag set."""
    mesh = make_mesh(f"expert={jax.device_count()}")
    for routing in ("random", "skewed", "sparse"):
        args = problem(37, routing)
        close(run(mesh, "all_to_all", exchange="ragged")(*args), reference(*args))
    check_gradients(mesh, problem(37, "random", seed=1), jnp.ones((37, D), jnp.float32),
                    [dict(strategy="all_to_all", exchange="ragged")])


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name, axis_index_groups=None):
    """`lax.ragged_all_to_all`'s documented contract built from a dense all_to_all (for XLA:CPU tests):
    rows operand[input_offsets[j] : + send_sizes[j]] go to peer j, landing at its output[output_offsets[j] :]."""
    ep = input_offsets.shape[0]
    rows = operand.shape[0]
    r = jnp.arange(rows)
    idx = jnp.clip(input_offsets[:, None] + r[None, :], 0, rows - 1)
    chunks = jnp.where((r[None, :] < send_sizes[:, None]).reshape(ep, rows, *[1] * (operand.ndim - 1)),
                       operand[idx], 0)
    a2a = lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)  # noqa: E731
    got, offsets, sizes = a2a(chunks), a2a(output_offsets), a2a(send_sizes)  # from each source s
    dest = jnp.where(r[None, :] < sizes[:, None], offsets[:, None] + r[None, :], output.shape[0])  # OOB: dropped
    out = output.at[dest.reshape(-1)].set(got.reshape(ep * rows, *operand.shape[1:]), mode="drop")
    # the contract's recv_sizes == all_to_all(send_sizes): a wrong recv_sizes poisons the result
    ok = jnp.all(sizes == recv_sizes) & jnp.all(output_offsets + send_sizes <= output.shape[0])
    return jnp.where(ok, out, jnp.asarray(-(2**30) if out.dtype == jnp.int32 else jnp.nan, out.dtype))


@needs8
@pytest.mark.parametrize("mesh_spec", ["expert=8", "data=2,expert=2,tensor=2"])
def test_ragged_exchange_offsets_on_cpu(mesh_spec, monkeypatch):
    """The ragged path's counts/offsets bookkeeping, on CPU, with ragged_all_to_all emulated per its contract."""
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    mesh = make_mesh(mesh_spec)
    f = run(mesh, "all_to_all", exchange="ragged")
    for routing in ("random", "skewed", "sparse"):
        for n in (37, 3):
            args = problem(n, routing)
            close(f(*args), reference(*args))
    # gradients through the exchange's own VJP (the reverse exchange, also emulated here)
    ct = jnp.asarray(np.random.default_rng(2).normal(size=(37, D)).astype(np.float32))
    check_gradients(mesh, problem(37, "random", seed=1), ct, [dict(strategy="all_to_all", exchange="ragged")])


@needs8
@pytest.mark.parametrize("mesh_spec", ["expert=8", "data=2,expert=2,tensor=2"])
def test_pallas_local_experts(mesh_spec):
    """implementation="pallas_gpu": each device's local experts run on the Pallas grouped GEMMs (interpret mode
    here), forward and gradients, every strategy. The kernel computes the same fp32 row products as
    ragged_dot; only the SiTU's sigmoid is written differently (1 / (1 + e^-g)), a few ulp. With F split
    over `tensor` the partial down projections are handed over in x's dtype, fp32 here, so the bound
    above holds unchanged."""
    mesh = make_mesh(mesh_spec)
    args = problem(37, "random", seed=3)
    for strategy in STRATEGIES:
        close(run(mesh, strategy, implementation="pallas_gpu")(*args), reference(*args))
    ct = jnp.asarray(np.random.default_rng(4).normal(size=(37, D)).astype(np.float32))
    check_gradients(mesh, args, ct, [dict(strategy=strategy, implementation="pallas_gpu") for strategy in STRATEGIES])


@needs8
@pytest.mark.parametrize(("strategy", "implementation"), [(s, "pallas_gpu") for s in STRATEGIES] + [("decode", "xla")])
def test_mxfp4_experts(strategy, implementation, monkeypatch):
    """MXFP4 experts of a decode-sized batch (37 tokens x top-4 over 16 experts) stay packed into each
    device's Pallas kernels, with F split over `tensor` (each shard holds one 32-input scale block of
    w2); the XLA local experts get them decoded. Either way the same values as the reference on the
    decoded weights (the tile decode is exact)."""
    decoded = []
    real_decode = MXFP4Experts.decode
    monkeypatch.setattr(MXFP4Experts, "decode", lambda w, dtype: decoded.append(w) or real_decode(w, dtype))
    r = np.random.default_rng(5)
    f = 64  # F a multiple of 32 x tensor, so w2's scale blocks split over the two tensor shards
    packed = [MXFP4Experts(*map(jnp.asarray, encode_mxfp4(r.normal(size=shape) * std)))
              for shape, std in (((E, f, D), 1.5 / D**0.5), ((E, D, f), 1 / f**0.5), ((E, f, D), 1 / D**0.5))]
    x, _, _, _, weights, ids = problem(37, "random", seed=6)
    mesh = make_mesh("data=2,expert=2,tensor=2")
    got = run(mesh, strategy, implementation=implementation)(x, *packed, weights, ids)
    assert len(decoded) == (0 if implementation == "pallas_gpu" else 3)
    close(got, reference(x, *(w.decode(jnp.float32) for w in packed), weights, ids))


def test_unknown_implementation_is_named():
    mesh = make_mesh(f"expert={jax.device_count()}")
    with pytest.raises(ValueError, match="implementation 'triton' is unknown"):
        ep_routed_experts(*problem(4, "random"), mesh=mesh, beta=BETA, linear_beta=LINEAR_BETA,
                          implementation="triton")


def test_ragged_exchange_on_gpu_demands_the_decomposer_flag(monkeypatch):
    """Without the flag the GPU ragged exchange runs XLA's slow, bug-prone default lowering: it must refuse."""
    mesh = make_mesh(f"expert={jax.device_count()}")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    with target("gpu"), pytest.raises(ValueError, match="xla_gpu_unsupported_enable_ragged_all_to_all_decomposer"):
        ep_routed_experts(*problem(8, "random"), mesh=mesh, beta=BETA, linear_beta=LINEAR_BETA,
                          strategy="all_to_all", exchange="ragged", implementation="xla")


@needs8
def test_ragged_exchange_gradient_lowers_with_the_real_collective():
    """The gradient program with the real `ragged_all_to_all` traces and lowers on CPU (only XLA:CPU's
    compiler lacks the op): the exchange's VJP gives cotangents of the primal's manual-axis type."""
    mesh = make_mesh("expert=8")
    loss = lambda *a: jnp.sum(ep_routed_experts(  # noqa: E731
        *a, mesh=mesh, beta=BETA, linear_beta=LINEAR_BETA, strategy="all_to_all", exchange="ragged"))
    text = jax.jit(jax.grad(loss, (0, 1, 2, 3, 4))).trace(*problem(37, "random")).lower().as_text()
    assert text.count("ragged_all_to_all") >= 4  # two exchanges forward, their two reverses backward


@pytest.mark.parametrize(("backend", "flags", "want"), [
    ("cpu", "", "padded"), ("gpu", "", "padded"), ("gpu", RAGGED_GPU_FLAG, "ragged"), ("tpu", "", "ragged")])
def test_auto_exchange_per_platform(monkeypatch, backend, flags, want):
    """exchange="auto": the ragged collective where it runs well (TPU; GPU with XLA's decomposer)."""
    monkeypatch.setenv("XLA_FLAGS", flags)
    with target(backend):
        assert resolve_exchange("auto") == want

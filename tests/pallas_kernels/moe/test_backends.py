"""Every implementation of the routed experts that runs on CPU, against the XLA reference, through the
public entry point: forward and gradients, dense bf16 / fp32 and MXFP4-packed weights; the policy's
defaults per platform; the dispatch's errors; the memory stand-in.

On CPU "pallas_gpu" runs its Triton kernels in Pallas interpret mode and "mosaic_tpu" its kernels in the
TPU interpreter. The problem is small (24 tokens x top-2 over 4 experts, widths 64 -> 64 -> 32): a
decode-sized batch, so "pallas_gpu" keeps MXFP4 weights packed into its tile decode.

Tolerances. fp32 and MXFP4 with fp32 rows (the decode is exact): every implementation computes the same
fp32 products as the reference in another summation order (tiled k loops, einsum vs ragged dot, the
SiTU's sigmoid written 1 / (1 + e^-g)), a few fp32 ulps, ~1e-7 relative; 1e-5 leaves two orders of
margin while a wrong expert, row or derivative term costs O(1e-1). bf16: the kernels round the hidden
state once where the reference also rounds gate and up, and every output and gradient passes two or
three bf16 roundings (2^-9 relative each), so both sit a few 1e-3 from the fp32 oracle; 2e-2 bounds that
with room, still far below a wrong term.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import IMPLEMENTATIONS, choose_implementation, experts_ragged_dot, routed_experts
from pallas_kernels.mxfp4 import MXFP4Experts, encode_mxfp4
from pallas_kernels.platform import target

F32, BF16 = jnp.float32, jnp.bfloat16
BETA, LINEAR_BETA = 4.0, 25.0
N, K, E, D_IN, F, D_OUT = 24, 2, 4, 64, 64, 32
ON_CPU = ["xla", "dense", "pallas_gpu", "mosaic_tpu"]  # the entries with meaningful values on CPU
WEIGHTS = ["fp32", "bf16", "mxfp4"]
TOL = {"fp32": 1e-5, "mxfp4": 1e-5, "bf16": 2e-2}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@functools.lru_cache(maxsize=None)
def problem(kind: str):
    """(x, w1, w2, w3, weights, ids) with weights of `kind`, and the fp32 arrays the oracle uses."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, D_IN)) * 2.0
    w1 = rng.standard_normal((E, F, D_IN)) / np.sqrt(D_IN) * 2.0  # gates reach the SiTU cap
    w3 = rng.standard_normal((E, F, D_IN)) / np.sqrt(D_IN) * 10.0  # ups reach theirs
    w2 = rng.standard_normal((E, D_OUT, F)) / np.sqrt(F)
    ids = np.stack([rng.choice(E - 1, K, replace=False) for _ in range(N)])  # the last expert gets no rows
    weights = jnp.asarray(rng.uniform(0.05, 1.0, (N, K)), F32)
    ids = jnp.asarray(ids, jnp.int32)
    if kind == "mxfp4":
        packed = [MXFP4Experts(*map(jnp.asarray, encode_mxfp4(w))) for w in (w1, w2, w3)]
        oracle_weights = [w.decode(F32) for w in packed]
        return (jnp.asarray(x, F32), *packed, weights, ids), (jnp.asarray(x, F32), *oracle_weights, weights, ids)
    dtype = BF16 if kind == "bf16" else F32
    args = tuple(jnp.asarray(a, dtype) for a in (x, w1, w2, w3))
    return (*args, weights, ids), (*(a.astype(F32) for a in args), weights, ids)


def run(implementation: str | None, *args) -> jax.Array:
    return routed_experts(*args, beta=BETA, linear_beta=LINEAR_BETA, implementation=implementation)


@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize("implementation", ON_CPU)
def test_forward_matches_the_reference(implementation: str, kind: str) -> None:
    args, oracle_args = problem(kind)
    out = jax.jit(functools.partial(run, implementation))(*args)
    want = experts_ragged_dot(*oracle_args, beta=BETA, linear_beta=LINEAR_BETA)  # fp32 throughout
    assert out.shape == (N, D_OUT) and out.dtype == F32
    assert rel(out, want) <= TOL[kind], rel(out, want)
    assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize("implementation", ON_CPU)
def test_gradients_match_the_reference(implementation: str, kind: str) -> None:
    """d/d(x, weights) always; d/d(w1, w2, w3) for dense weights (MXFP4 codes get no gradient)."""
    args, oracle_args = problem(kind)
    argnums = (0, 4) if kind == "mxfp4" else (0, 1, 2, 3, 4)
    ct = jax.random.normal(jax.random.key(3), (N, D_OUT), F32)

    def grads(fn, operands):
        def loss(*diff):
            full = list(operands)
            for i, value in zip(argnums, diff):
                full[i] = value
            return jnp.sum(fn(*full) * ct)
        return jax.jit(jax.grad(loss, argnums=tuple(range(len(argnums)))))(*(operands[i] for i in argnums))

    got = grads(functools.partial(run, implementation), args)
    want = grads(functools.partial(run, "xla"), oracle_args)  # fp32 autodiff of the reference
    for i, g, w in zip(argnums, got, want, strict=True):
        assert g.shape == args[i].shape and g.dtype == args[i].dtype, i
        assert rel(g, w) <= TOL[kind], (i, rel(g, w))


# ---- the policy and the dispatch's errors ---------------------------------------------------------


@pytest.mark.parametrize(("platform", "dtype", "packed", "want"), [
    ("cpu", BF16, False, "xla"), ("cpu", F32, False, "xla"), ("cpu", BF16, True, "xla"),
    ("gpu", BF16, False, "pallas_gpu"), ("gpu", BF16, True, "pallas_gpu"), ("gpu", F32, False, "xla"),
    ("tpu", BF16, False, "xla"), ("tpu", F32, True, "xla"),
])
def test_policy_defaults(platform: str, dtype, packed: bool, want: str) -> None:
    """The Pallas GPU kernels for bf16 on a GPU; the XLA path on CPU, on TPU (the Mosaic TPU kernels have
    not run on hardware) and for fp32 (which must stay exact)."""
    with target(platform):
        assert choose_implementation(None, dtype=dtype, packed=packed).name == want


def test_policy_runs_the_reference_on_cpu() -> None:
    args, _ = problem("fp32")
    np.testing.assert_array_equal(np.asarray(run(None, *args)), np.asarray(run("xla", *args)))


def test_memory_standin_is_never_a_default() -> None:
    for platform in ("cpu", "gpu", "tpu"):
        assert not IMPLEMENTATIONS["xla_memory_standin"].default_on
        with target(platform):
            assert choose_implementation(None, dtype=BF16, packed=False).name != "xla_memory_standin"


@pytest.mark.parametrize(("platform", "requested", "error", "match"), [
    ("cpu", "pallas", ValueError, r"routed_experts: implementation 'pallas' is unknown; expected one of "
                                  r"\('pallas_gpu', 'mosaic_tpu', 'xla', 'dense', 'xla_memory_standin'\)"),
    ("gpu", "mosaic_tpu", NotImplementedError, r"'mosaic_tpu' runs on \['cpu', 'tpu'\], not 'gpu'"),
    ("tpu", "pallas_gpu", NotImplementedError, r"'pallas_gpu' runs on \['cpu', 'gpu'\], not 'tpu'"),
    ("gpu", "xla_memory_standin", NotImplementedError, r"'xla_memory_standin' runs on \['cpu'\], not 'gpu'"),
])
def test_dispatch_errors_name_the_choice(platform, requested, error, match) -> None:
    with target(platform), pytest.raises(error, match=match):
        choose_implementation(requested, dtype=BF16, packed=False)


def test_pallas_gpu_refuses_fp32_on_a_gpu() -> None:
    with target("gpu"), pytest.raises(NotImplementedError, match="float32 on a GPU: the kernels run bfloat16"):
        choose_implementation("pallas_gpu", dtype=F32, packed=False)
    assert choose_implementation("pallas_gpu", dtype=F32, packed=False).name == "pallas_gpu"  # interpret mode


def test_entry_validates_its_operands() -> None:
    (x, w1, w2, w3, weights, ids), _ = problem("fp32")
    with pytest.raises(ValueError, match=r"w1, w3 must be \[E, F, 64\] and w2 \[E, out, F\]"):
        run("xla", x, w1, w2[:, :, :32], w3, weights, ids)
    packed = problem("mxfp4")[0]
    with pytest.raises(ValueError, match="all MXFP4Experts or all arrays, got MXFP4Experts, ArrayImpl"):
        run("xla", x, packed[1], w2, packed[3], weights, ids)
    with pytest.raises(ValueError, match=r"weights and ids \[N, k\]"):
        run("xla", x, w1, w2, w3, weights[:, :1], ids)


# ---- the memory stand-in ----------------------------------------------------------------------------


def test_memory_standin_has_the_shapes_and_not_the_cpu_expansion() -> None:
    """Same output and gradient shapes and dtypes as the XLA path; without the dense [groups, rows, K]
    operand XLA:CPU builds for a ragged dot (here 64 experts x 2048 rows x 256 bf16, 64 MiB), so the
    program's temporaries are a small fraction of the CPU lowering's."""
    rng = np.random.default_rng(1)
    n, k, e, d, f = 1024, 2, 64, 256, 256
    x = jnp.asarray(rng.standard_normal((n, d)), BF16)
    w1, w3 = (jnp.asarray(rng.standard_normal((e, f, d)) * 0.05, BF16) for _ in range(2))
    w2 = jnp.asarray(rng.standard_normal((e, d, f)) * 0.05, BF16)
    weights = jnp.asarray(rng.uniform(size=(n, k)), F32)
    ids = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
    args = (x, w1, w2, w3, weights, ids)

    def program(implementation):
        loss = lambda *a: jnp.sum(run(implementation, *a))  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

    standin, xla = (jax.eval_shape(program(i), *args) for i in ("xla_memory_standin", "xla"))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), standin) == jax.tree.map(lambda a: (a.shape, a.dtype), xla)
    temps = {i: program(i).lower(*args).compile().memory_analysis().temp_size_in_bytes
             for i in ("xla_memory_standin", "xla")}
    assert temps["xla_memory_standin"] * 4 < temps["xla"], temps

"""The routed experts' implementations, in policy order (`pallas_kernels.dispatch`).

Each entry's `run(rows, group_sizes, w1, w2, w3, *, beta, linear_beta)` is the SiTU-GLU MLP on rows
grouped by expert (the part of the op that differs between backends; sorting the pairs and combining
the outputs are the same for all, and expert parallelism runs it on each device's local experts). It
returns [M, out] in rows.dtype or fp32 (callers round to rows.dtype after any sum over devices), takes
dense or `MXFP4Experts` weights and decodes what its kernels do not read packed.

The policy: "pallas_gpu" on a GPU for bf16 (where its kernels are compiled and verified), "xla" for
everything else (CPU; TPU until the Mosaic TPU kernels have run on hardware; fp32, which must stay
exact). The problem each `supports` sees: `dtype` (the rows') and `packed` (MXFP4 weights).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.dispatch import Implementation, choose
from pallas_kernels.moe import pallas_gpu, reference
from pallas_kernels.moe.memory_standin import grouped_mlp_memory_standin
from pallas_kernels.moe.mosaic_tpu import experts as mosaic_tpu
from pallas_kernels.platform import current_platform

OP = "routed_experts"


def _pallas_gpu_supports(*, dtype, packed: bool) -> str | None:
    """On a GPU the kernels run bf16 only: fp32 dots would be TF32 there, not exact (interpret mode on
    CPU runs any float dtype exactly)."""
    del packed
    if current_platform() == "gpu" and jnp.dtype(dtype) != jnp.bfloat16:
        return f"rows of dtype {jnp.dtype(dtype).name} on a GPU: the kernels run bfloat16 only (use 'xla')"
    return None


IMPLEMENTATIONS: dict[str, Implementation] = {
    "pallas_gpu": Implementation(
        "pallas_gpu", pallas_gpu.grouped_mlp, platforms=frozenset({"gpu", "cpu"}),
        default_on=frozenset({"gpu"}), supports=_pallas_gpu_supports),
    "mosaic_tpu": Implementation(
        "mosaic_tpu", mosaic_tpu.grouped_mlp, platforms=frozenset({"tpu", "cpu"})),
    "xla": Implementation(
        "xla", reference.grouped_mlp_ragged_dot, platforms=frozenset({"cpu", "gpu", "tpu"}),
        default_on=frozenset({"cpu", "gpu", "tpu"})),
    # every expert on every row: the oracle, for tests (tiny configs only)
    "dense": Implementation(
        "dense", reference.grouped_mlp_dense, platforms=frozenset({"cpu", "gpu", "tpu"})),
    # right shapes and dtypes, the device kernels' memory footprint, meaningless values: for memory
    # planning only (`memory_standin`)
    "xla_memory_standin": Implementation(
        "xla_memory_standin", grouped_mlp_memory_standin, platforms=frozenset({"cpu"})),
}

# implementations whose results come from `pallas_call`s, which carry no manual-axis (vma) type
PALLAS_IMPLEMENTATIONS = frozenset({"pallas_gpu", "mosaic_tpu"})


def choose_implementation(requested: str | None, *, dtype, packed: bool) -> Implementation:
    """The implementation that runs rows of `dtype` (weights MXFP4 when `packed`): `requested` by name,
    or the policy's when None."""
    return choose(OP, IMPLEMENTATIONS, requested, dtype=jnp.dtype(dtype), packed=packed)

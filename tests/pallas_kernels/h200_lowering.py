"""Lowering for an abstract NVIDIA H200 on a machine without a GPU, shared by the kernel tests."""

from __future__ import annotations

import jax

from pallas_kernels.platform import target


def lowered_for_h200(fn, *args: jax.ShapeDtypeStruct) -> str:
    """``fn``'s StableHLO lowered for an abstract H200 on CPU: every Pallas-Triton kernel passes
    the Pallas -> Triton IR step (no PTX compile) and appears as a custom call carrying its name,
    grid and launch parameters. Kernels are chosen as for a GPU (``platform.target``)."""
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
    with target("gpu"), jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

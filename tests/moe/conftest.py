"""Shared fixtures of the MoE kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def h200_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make Pallas-Triton lower for an H200 on a machine without a GPU (Triton IR only, no PTX)."""
    try:
        from jax._src.pallas.triton import gpu_info, pallas_call_registration
    except ImportError:  # private modules: only a guard against JAX moving them
        pytest.skip("Pallas-Triton internals not available in this JAX")
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))

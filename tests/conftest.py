"""Shared fixtures: the golden tiny checkpoint (exact release format) and its reference outputs.

fp32 comparisons need full-precision matmuls (GPU would otherwise use TF32).
"""

from __future__ import annotations

import os

# One OpenBLAS thread: with 8 fake CPU devices on 2 cores, the chunked KDA's triangular solves run
# on all devices at once and spinning BLAS threads make the suite many times slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import jax
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_num_cpu_devices", 8)  # fake CPU devices for tests/sharding; set before any backend starts

GOLDEN_DIR = Path(__file__).resolve().parent / "golden" / "k3-tiny-a"


def rel_rms(actual: np.ndarray, expected: np.ndarray) -> float:
    """||a - b||_2 / ||b||_2 — the error measure the golden README's tolerances use."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.sqrt(np.mean((actual - expected) ** 2)) / np.sqrt(np.mean(expected**2)))


def write_variant(root: Path, golden_dir: Path, tensors: dict[str, np.ndarray]) -> Path:
    """The golden config with `tensors` as a single-file checkpoint (an edited copy of the release)."""
    from safetensors.numpy import save_file

    root.mkdir(parents=True)
    (root / "config.json").write_bytes((golden_dir / "config.json").read_bytes())
    save_file(tensors, str(root / "model.safetensors"))
    return root


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with a `slow` test run first: `--dist loadfile` hands each module whole to one worker in
    collection order, and a long module handed out last would keep one worker busy while the other idles."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Drop each test module's compiled programs when it ends. XLA:CPU maps every executable's code into
    memory; a worker that runs hundreds of modules would otherwise pass the kernel's limit on memory
    mappings (vm.max_map_count, 65530 by default) and abort inside the compiler."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN_DIR


@pytest.fixture(scope="session")
def golden_reference():
    """Loader for reference/*.npz by stem: golden_reference('text_fp32')['logits']."""
    return lambda name: np.load(GOLDEN_DIR / "reference" / f"{name}.npz")


@pytest.fixture(scope="session")
def golden_model_fp32():
    import k3jax

    return k3jax.from_pretrained(GOLDEN_DIR, dtype="float32")


@pytest.fixture(scope="session")
def golden_model_bf16():
    import k3jax

    return k3jax.from_pretrained(GOLDEN_DIR, dtype="bfloat16")

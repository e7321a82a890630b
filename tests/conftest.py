"""Shared fixtures: the golden tiny checkpoint (exact release format) and its reference outputs.

fp32 comparisons need full-precision matmuls (GPU would otherwise use TF32).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cache_bytes(folder: Path) -> int:
    """Bytes of the files under `folder`."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


# One OpenBLAS thread: with 8 fake CPU devices on 2 cores, the chunked KDA's triangular solves run
# on all devices at once and spinning BLAS threads make the suite many times slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Most of the suite's time is XLA:CPU compiling small programs, and most of that is LLVM. Its -O1
# compiles them about a fifth faster than the default and gives the same results on every exactness
# test here (-O0 does not: it changes rounding, so bitwise jit-vs-eager comparisons fail). Set in the
# environment, so the CLI, README and notebook subprocesses the tests start compile the same way.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=1".strip()

# A compilation cache on disk, shared by the test workers and their subprocesses (the same tiny-model
# programs are compiled by many of them) and kept between runs. Entries are keyed by the program, the
# flags and the jax version, so a stale one is never used, only left behind: the folder is emptied
# when it passes CACHE_LIMIT_BYTES (jax evicts only with the optional `filelock` package).
XLA_CACHE_DIR = Path(__file__).resolve().parent.parent / ".cache" / "xla-tests"
CACHE_LIMIT_BYTES = 2 << 30
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    if XLA_CACHE_DIR.is_dir() and cache_bytes(XLA_CACHE_DIR) > CACHE_LIMIT_BYTES:
        shutil.rmtree(XLA_CACHE_DIR, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(XLA_CACHE_DIR)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

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

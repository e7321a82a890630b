"""The wheel works without the checkout: built from a copy of the tree, installed into a fresh venv, run
from a folder outside the repository, it finds its tiny checkpoint (with the official reference outputs
the notebooks read) and configs and runs the demo.

Isolation: the fresh venv has no site packages of its own but a .pth file listing this environment's
site-packages, so the dependencies (jax, flax, ...) come from here with no network. Directories named in
a .pth file are put on sys.path without processing the .pth files inside them, so the editable install's
`__editable__` finder (which would point `import k3jax` back at the checkout) is never loaded; PYTHONPATH
is cleared too. Building needs pip's build isolation to fetch the setuptools backend (pyproject.toml).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOT_SOURCES = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "out", "device_carry")


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    run = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{args}: {run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    return run


def test_wheel_installs_into_a_fresh_venv_and_runs_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"JAX_PLATFORMS": "cpu", "OPENBLAS_NUM_THREADS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    source = tmp_path / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    _run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(tmp_path / "dist")],
         tmp_path, env)
    wheel = next((tmp_path / "dist").glob("k3jax-*.whl"))

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    site_packages = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              tmp_path, env).stdout.strip())
    (site_packages / "outer_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q", str(wheel)], tmp_path, env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = ("import sys, k3jax, k3jax.assets, sharding, pallas_kernels; "
             "assert not [f for f in sys.meta_path if 'editable' in repr(f).lower()], sys.meta_path; "
             "print(k3jax.__file__); print(sharding.__file__); print(pallas_kernels.__file__); "
             "print(k3jax.assets.tiny_checkpoint()); print(len(k3jax.assets.packaged_config('kimi_k3')))")
    lines = _run([str(python), "-c", probe], elsewhere, env).stdout.splitlines()
    assert all(Path(line).is_relative_to(site_packages) for line in lines[:4]), lines
    tiny = Path(lines[3])
    assert (tiny / "config.json").is_file() and list(tiny.glob("*.safetensors")), sorted(tiny.iterdir())
    # The official outputs the notebooks check themselves against ship too (tests/notebooks runs them).
    assert {"generate_fp32.npz", "text_fp32.npz", "multimodal_fp32.npz"} <= {p.name for p in (tiny / "reference").iterdir()}
    assert int(lines[4]) > 0

    demo = _run([str(python), "-m", "k3jax", "demo", "--max-new-tokens", "2"], elsewhere, env).stdout
    assert "compiling prefill and decode..." in demo and "streaming: " in demo and "tokens/s" in demo, demo
    assert demo.index("compiling prefill and decode...") < demo.index("streaming: ") < demo.index("ids: "), demo
    version = _run([str(venv / "bin" / "k3jax"), "--version"], elsewhere, env).stdout
    assert version.strip() == f"k3jax {wheel.name.split('-')[1]}", version

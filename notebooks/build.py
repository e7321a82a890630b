"""Execute the notebooks in a fresh Jupyter kernel and save them with their outputs, so they render on a
code host without being run.

    python notebooks/build.py                            # every notebook
    python notebooks/build.py 02_architecture_tour       # some, by name

Each notebook runs as a reader's would: a new `python3` kernel whose working directory is an empty
temporary folder, so the notebook reads nothing from the checkout but the k3jax package (its tiny
checkpoint and golden references included). The kernel's PYTHONPATH starts with the checkout, so an
uninstalled checkout runs too; with `pip install -e .`, as CI does, that is the same code. A failing
cell stops the build and leaves the notebook file unchanged.

The digest of the code cells goes into the notebook's metadata (`k3jax.code_sha256`): a test compares
it with the committed code, so committed outputs always come from the committed code.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent
REPO = NOTEBOOK_DIR.parent
CELL_TIMEOUT_S = 600  # the longest cell (`k3jax plan` of the full model, twice) takes well under this


def notebooks() -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def code_digest(nb: nbformat.NotebookNode) -> str:
    """sha256 over the code cells' sources, in order (markdown edits need no rebuild)."""
    digest = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            digest.update(cell.source.encode())
            digest.update(b"\0")
    return digest.hexdigest()


def kernel_env() -> dict[str, str]:
    """The kernel's environment: this one, the checkout first on PYTHONPATH, and one BLAS thread
    (the sharding notebook runs 8 simulated CPU devices, whose BLAS threads would otherwise spin
    against each other on a small CI machine)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def execute(path: Path) -> nbformat.NotebookNode:
    """The notebook at `path`, run top to bottom in a new kernel; raises nbclient's
    CellExecutionError (naming the cell and the error) when a cell fails."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="k3jax-notebook-") as workdir:
        client = NotebookClient(
            nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", record_timing=False,
            resources={"metadata": {"path": workdir}},
        )
        client.execute(env=kernel_env())
    nb.metadata.setdefault("k3jax", {})["code_sha256"] = code_digest(nb)
    return nb


def _select(names: list[str]) -> list[Path]:
    if not names:
        return notebooks()
    chosen = []
    for name in names:
        path = NOTEBOOK_DIR / (name if name.endswith(".ipynb") else f"{name}.ipynb")
        if not path.is_file():
            known = ", ".join(p.stem for p in notebooks())
            raise SystemExit(f"error: no notebook {path.name} in {NOTEBOOK_DIR} (known: {known})")
        chosen.append(path)
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Execute notebooks and save them with their outputs.")
    parser.add_argument("names", nargs="*", help="notebook names (default: all), e.g. 01_quickstart")
    args = parser.parse_args(argv)
    for path in _select(args.names):
        print(f"running {path.name} ...", flush=True)
        nbformat.write(execute(path), path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

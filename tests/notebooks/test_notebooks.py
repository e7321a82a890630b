"""The notebooks: committed with outputs from their committed code, and every one runs top to bottom in a
real Jupyter kernel.

Each notebook asserts what it shows (numbers against the golden references packaged with the tiny
checkpoint, shapes, the router's choices, exact MXFP4 bytes), so running it is its test: nbclient
stops at the first failing cell and names it. The kernel starts in an empty temporary folder, so a
notebook reads nothing from the checkout except the k3jax package; `notebooks/build.py` puts the
checkout first on the kernel's PYTHONPATH (the same code as CI's editable install).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]


def _load_build():
    """notebooks/build.py, the script that executes and saves the notebooks (not a package module)."""
    spec = importlib.util.spec_from_file_location("notebook_build", NOTEBOOK_DIR / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def _setup_block(nb) -> str:
    """The shared part of a notebook's first code cell: from its setup comment to the end."""
    first = _code_cells(nb)[0].source
    start = first.find("# Setup:")
    return first[start:] if start >= 0 else ""


def test_notebooks_are_listed_and_numbered():
    assert len(NOTEBOOKS) >= 4
    readme = (NOTEBOOK_DIR / "README.md").read_text()
    for path in NOTEBOOKS:
        assert re.fullmatch(r"\d\d_[a-z0-9_]+", path.stem), f"{path.name}: expected NN_name.ipynb"
        assert path.name in readme, f"notebooks/README.md does not describe {path.name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_outputs_come_from_the_committed_code(path: Path):
    """Outputs present, from a clean top-to-bottom run of exactly this code (`python notebooks/build.py`)."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    rebuild = f"rebuild it: python notebooks/build.py {path.stem}"
    recorded = nb.metadata.get("k3jax", {}).get("code_sha256")
    assert recorded == build.code_digest(nb), f"{path.name}: code changed since its outputs were saved; {rebuild}"
    cells = _code_cells(nb)
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1)), f"{path.name}: not run in order; {rebuild}"
    for number, cell in enumerate(cells, 1):
        assert cell.outputs, f"{path.name}: code cell {number} shows nothing (every cell prints or plots what it did)"
        assert not [o for o in cell.outputs if o.output_type == "error"], f"{path.name}: code cell {number} failed"
    assert "assert " in "".join(c.source for c in cells), f"{path.name}: checks nothing it shows"


def test_every_notebook_starts_with_the_same_setup():
    """The first cell installs k3jax when it does not import (Colab) and prints the accelerator."""
    blocks = {path.name: _setup_block(nbformat.read(path, as_version=4)) for path in NOTEBOOKS}
    reference = blocks[NOTEBOOKS[0].name]
    assert "pip" in reference and "install" in reference and "jax.default_backend()" in reference
    assert all(block == reference for block in blocks.values()), {n: b == reference for n, b in blocks.items()}


def test_plots_are_committed():
    """The notebooks that plot carry their figures, so they render unrun."""
    for path in NOTEBOOKS:
        source = json.loads(path.read_text())
        code = "".join("".join(c["source"]) for c in source["cells"] if c["cell_type"] == "code")
        if "plt." in code:
            images = [o for c in source["cells"] if c["cell_type"] == "code" for o in c["outputs"]
                      if "image/png" in o.get("data", {})]
            assert images, f"{path.name} plots but carries no image output"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_in_a_kernel(path: Path):
    """Top to bottom in a fresh python3 kernel outside the checkout; any failing cell (a failed assert
    included) raises CellExecutionError naming it."""
    nb = build.execute(path)
    for number, cell in enumerate(_code_cells(nb), 1):
        assert not [o for o in cell.outputs if o.output_type == "error"], f"{path.name}: code cell {number} failed"

"""Every notebook's code cells run top to bottom (shell lines starting with '!' are skipped)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path):
    namespace: dict = {}
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("!"))
            exec(compile(code, f"{path.name}", "exec"), namespace)

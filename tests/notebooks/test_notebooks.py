"""Every notebook runs top to bottom, and what its cells show is right.

Cells run in one namespace as Jupyter would (shell lines starting with '!' are skipped); a cell's
last bare expression is evaluated separately and kept as what the cell shows, so the checks below
judge exactly what a reader sees. Every notebook needs a check: one that only runs is not tested.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import GOLDEN_DIR, rel_rms

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))

# Golden README §6: a float32 implementation with full-precision matmuls lands below these on the logits.
LOGITS_REL_RMS, LOGITS_MAX_ABS = 1e-4, 1e-3


def run_notebook(path: Path) -> tuple[dict, list[object]]:
    """Run the code cells; -> (the namespace, per code cell the value it shows or None)."""
    namespace: dict = {}
    shown: list[object] = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("!"))
        tree = ast.parse(code, path.name)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, path.name, "exec"), namespace)
        shown.append(None if last is None else eval(compile(ast.Expression(last.value), path.name, "eval"), namespace))
    return namespace, shown


def check_quickstart(namespace: dict, shown: list[object]) -> None:
    """01_quickstart: the golden tiny model's logits, greedy generation and hand-stepped cache."""
    import jax.numpy as jnp

    model, ids = namespace["model"], np.asarray(namespace["ids"])
    reference = np.load(GOLDEN_DIR / "reference" / "generate_fp32.npz")
    golden_prompt = reference["prompt_ids"]
    assert model.config.num_hidden_layers == 13 and model.config.mixer_kinds.count("mla") == 4

    # The notebook's prompt is the start of the golden generation prompt, and the model is causal, so
    # its logits are the reference prefill's first rows.
    assert np.array_equal(ids[0], golden_prompt[0, : ids.shape[1]]), "the notebook's prompt changed"
    shape, dtype = shown[2]
    assert tuple(shape) == (1, ids.shape[1], model.config.vocab_size) and dtype == jnp.float32
    logits = np.asarray(model(ids))[0]
    expected = reference["prefill_logits"][: ids.shape[1]]
    assert rel_rms(logits, expected) < LOGITS_REL_RMS
    assert np.max(np.abs(logits - expected)) < LOGITS_MAX_ABS

    # Greedy generation: the first token is the reference's argmax after the prompt; every token is the
    # argmax of a cache-free forward over the prompt and the tokens before it (teacher forcing).
    generated = np.asarray(shown[3])
    assert generated.shape == (1, 8)
    assert generated[0, 0] == np.argmax(expected[-1])
    full = np.asarray(model(jnp.concatenate([ids, generated[:, :-1]], axis=1)))[0]
    np.testing.assert_array_equal(generated[0], np.argmax(full[ids.shape[1] - 1 :], axis=-1))

    # The cache stepped by hand gives the same tokens as generate.
    assert shown[4] == generated[0].tolist()


CHECKS: dict[str, Callable[[dict, list[object]], None]] = {"01_quickstart.ipynb": check_quickstart}


def test_every_notebook_has_a_check():
    assert {p.name for p in NOTEBOOKS} == set(CHECKS), "add a check of what the new notebook shows"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_shows_the_right_results(path: Path):
    namespace, shown = run_notebook(path)
    CHECKS[path.name](namespace, shown)

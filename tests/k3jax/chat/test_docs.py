"""docs/chat.md: the format example runs as written, and so does the command line (with no input it
loads the model and quits). The multi-turn `Chat` example is the flow test_session.py checks on the
same tiny model; it is not run again here (its compilations are the slow part of those tests)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import k3jax.assets
from k3jax.cli import main

DOC = (Path(__file__).resolve().parents[3] / "docs" / "chat.md").read_text()


def test_the_format_example_runs(capsys):
    block = re.findall(r"^```python\n(.*?)^```", DOC, flags=re.S | re.M)[0]
    namespace: dict = {}
    exec(compile(block, "docs/chat.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "18 C, sunny" in out and "Easy. | Sunny. | True" in out
    assert sum(namespace["loss_mask"]) > 0


def test_the_command_line_example_runs(monkeypatch, capsys):
    line = re.search(r"^k3jax (chat .*?) < /dev/null$", DOC, flags=re.M).group(1)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    args = line.replace("$TINY", str(k3jax.assets.tiny_checkpoint())).split()
    assert main(args) == 0
    assert capsys.readouterr().out == "> \n"

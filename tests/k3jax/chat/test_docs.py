"""docs/chat.md: its Python examples run as written, in order (the chat example has the shapes of
test_session.py's first test, so either compiles the programs the other uses), and so does the
command line (with no input it loads the model and quits)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import k3jax.assets
from k3jax.cli import main

DOC = (Path(__file__).resolve().parents[3] / "docs" / "chat.md").read_text()


def test_the_python_examples_run(capsys):
    format_block, chat_block = re.findall(r"^```python\n(.*?)^```", DOC, flags=re.S | re.M)
    namespace: dict = {}
    exec(compile(format_block, "docs/chat.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "18 C, sunny" in out and "Easy. | Sunny. | True" in out
    assert sum(namespace["loss_mask"]) > 0
    exec(compile(chat_block, "docs/chat.md", "exec"), namespace)
    assert namespace["chat"].messages == [namespace["SystemMessage"]("Be brief.")]  # after reset


def test_the_command_line_example_runs(monkeypatch, capsys):
    line = re.search(r"^k3jax (chat .*?) < /dev/null$", DOC, flags=re.M).group(1)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    args = line.replace("$TINY", str(k3jax.assets.tiny_checkpoint())).split()
    assert main(args) == 0
    assert capsys.readouterr().out == "> \n"

"""`k3jax chat` in a pseudo-terminal on the tiny model: two turns streamed, /reset, the same first turn
again (greedy: the same reply, so /reset cleared the cache and the conversation), end of input quits."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pexpect

from tests.conftest import GOLDEN_DIR

REPO = Path(__file__).resolve().parents[3]


def test_two_turns_reset_and_eof_in_a_terminal():
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    args = ["-m", "k3jax", "chat", "--model", str(GOLDEN_DIR), "--max-new-tokens", "5", "--temperature", "0",
            "--dtype", "float32", "--thinking", "high", "--system", "Be brief."]
    term = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=400, cwd=str(REPO))
    try:
        term.expect_exact("> ")
        assert "/reset starts over" in term.before
        turns = []
        for line in ("Hi", "More", "/reset", "Hi"):
            term.sendline(line)
            term.expect_exact("> ")
            turns.append(term.before.replace("\r\n", "\n"))
        term.sendeof()
        term.expect(pexpect.EOF)
    finally:
        term.close()
    assert term.exitstatus == 0
    first, second, reset, again = turns
    for turn, line in ((first, "Hi"), (second, "More")):
        # The echo of the line, the reasoning dimmed under its heading (the tiny model never closes its
        # think channel within 5 tokens), then the note that the reply was cut off.
        assert turn.startswith(f"{line}\nthinking: \x1b[2m"), turn
        assert turn.endswith("\x1b[0m\n[cut off at --max-new-tokens 5]\n"), turn
    assert reset == "/reset\n[conversation cleared]\n"
    assert again == first

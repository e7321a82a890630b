"""`k3jax chat` in a pseudo-terminal on the tiny model: a first message with an image (--image), a text
turn, /reset, the same first turn again with the image attached by /image (greedy: the same reply, so
/reset cleared the cache and the conversation), end of input quits."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pexpect
from PIL import Image

from tests.conftest import GOLDEN_DIR

REPO = Path(__file__).resolve().parents[3]


def test_two_turns_reset_and_eof_in_a_terminal(tmp_path):
    image = tmp_path / "picture.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(image)
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    args = ["-m", "k3jax", "chat", "--model", str(GOLDEN_DIR), "--max-new-tokens", "5", "--temperature", "0",
            "--dtype", "float32", "--thinking", "high", "--system", "Be brief.", "--image", str(image)]
    term = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=400, cwd=str(REPO))
    try:
        term.expect_exact("> ")
        assert "/reset starts over" in term.before
        turns = []
        for line in ("Hi", "More", "/reset", f"/image {image}", "Hi"):
            term.sendline(line)
            term.expect_exact("> ")
            turns.append(term.before.replace("\r\n", "\n"))
        term.sendeof()
        term.expect(pexpect.EOF)
    finally:
        term.close()
    assert term.exitstatus == 0
    first, second, reset, attached, again = turns
    for turn, line in ((first, "Hi"), (second, "More")):
        # The echo of the line, any reasoning dimmed under its heading (the tiny model's random weights
        # never close the think channel within 5 tokens), then the note that the reply was cut off.
        assert turn.startswith(f"{line}\n"), turn
        assert turn.endswith("\n[cut off at --max-new-tokens 5]\n"), turn
        body = turn.removeprefix(f"{line}\n").removesuffix("[cut off at --max-new-tokens 5]\n")
        assert body == "" or (body.startswith("thinking: \x1b[2m") and body.endswith("\x1b[0m\n")), turn
    assert "thinking: " in first + second
    assert reset == "/reset\n[conversation cleared]\n"
    assert attached == f"/image {image}\n[1 image(s) for the next message]\n"
    assert again == first

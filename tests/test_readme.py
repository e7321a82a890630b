"""README.md's examples run as written, on the tiny model that ships with k3jax; the commands that
docs/multihost.md launches exist, and `k3jax generate` joins a multi-process job before anything else.

Rules:
* Every ```python block runs, in order, in one namespace, in a fresh interpreter (as a user would run
  them: its first block sets `jax_num_cpu_devices` before JAX starts). The README uses
  `k3jax.assets.tiny_checkpoint()` itself; a block naming the release as `"path/to/Kimi-K3"` would get
  the tiny checkpoint in its place (`SUBSTITUTIONS`).
* In ```sh blocks, each `k3jax ...` line runs in-process through `k3jax.cli.main` with `$TINY` replaced by
  the tiny checkpoint and `$OUT` by a temporary directory, and must exit 0. Skipped: other commands
  (`make`, `pip`, shell assignments) and `k3jax` lines that need the real release or the full config
  (they name `path/to/Kimi-K3` or `configs/kimi_k3.json`).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import k3jax.assets
import k3jax.cli
from k3jax.cli import main

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
MULTIHOST = (REPO / "docs" / "multihost.md").read_text()
SUBSTITUTIONS = {'"path/to/Kimi-K3"': "str(k3jax.assets.tiny_checkpoint())"}
NEEDS_REAL_MODEL = ("path/to/Kimi-K3", "configs/kimi_k3.json")


def blocks(language: str, text: str = README) -> list[str]:
    """The fenced code blocks of `language` in `text` (default: the README), in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def cli_lines() -> list[str]:
    """The `k3jax` command lines of the sh blocks that run on the tiny model."""
    lines = [line.split("  #")[0].strip() for block in blocks("sh") for line in block.splitlines()]
    return [line for line in lines if line.startswith("k3jax ") and not any(m in line for m in NEEDS_REAL_MODEL)]


def test_python_blocks_run_in_order_on_the_tiny_model(tmp_path):
    code = blocks("python")
    assert len(code) >= 5 and "tiny_checkpoint()" in code[0]
    for old, new in SUBSTITUTIONS.items():
        code = [block.replace(old, new) for block in code]
    script = tmp_path / "readme_blocks.py"
    script.write_text("namespace = {}\n" + "".join(f"exec({block!r}, namespace)\n" for block in code)
                      + "print('README OK', namespace['jax'].device_count())\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "OPENBLAS_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "README OK 8" in run.stdout  # the mesh example ran on 8 simulated devices


@pytest.mark.parametrize("line", cli_lines())
def test_sh_block_commands_run_on_the_tiny_model(line, tmp_path, capsys):
    line = line.replace("$TINY", str(k3jax.assets.tiny_checkpoint())).replace("$OUT", str(tmp_path / "out"))
    assert main(shlex.split(line)[1:]) == 0, capsys.readouterr().err


def test_sh_blocks_show_the_commands_the_walk_through_promises():
    commands = {line.split()[1] for line in cli_lines()}
    assert {"generate", "convert", "plan"} <= commands
    assert any("--stop" in line and "--bos" in line for line in cli_lines())


def test_version_flag_the_readme_names(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("k3jax ")


def multihost_commands() -> list[list[str]]:
    """Every `k3jax SUBCOMMAND ...` that docs/multihost.md's bash blocks run (continuations joined)."""
    found = []
    for block in blocks("bash", MULTIHOST):
        for line in block.replace("\\\n", " ").splitlines():
            match = re.search(r"(?:^|[\s/])(?:k3jax|-m k3jax) (\w.*)", line.split("  #")[0])
            if match:
                found.append(shlex.split(match.group(1).rstrip("'")))
    return found


def test_multihost_doc_launches_only_commands_and_flags_that_exist(capsys):
    commands = multihost_commands()
    assert {command[0] for command in commands} == {"generate", "convert"}
    for command in commands:
        with pytest.raises(SystemExit):
            main([command[0], "--help"])
        usage = capsys.readouterr().out
        flags = [arg.split("=")[0] for arg in command if arg.startswith("--")]
        assert all(flag in usage for flag in flags), (command, usage)


def test_generate_joins_the_job_before_reading_the_model(tmp_path, monkeypatch, capsys):
    """`initialize()` runs first (a no-op on one process), even when the model directory is wrong."""
    calls = []
    monkeypatch.setattr(k3jax.cli.distributed, "initialize", lambda: calls.append("initialize"))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 1
    assert calls == ["initialize"] and "config.json" in capsys.readouterr().err

"""`k3jax serve` refuses what it cannot serve with one line and a non-zero status, before loading a model."""

from __future__ import annotations

from k3jax import cli
from k3jax.serving import command
from tests.conftest import GOLDEN_DIR


def test_without_the_web_server(monkeypatch, capsys):
    monkeypatch.setattr(command, "_WEB_SERVER_MISSING", ImportError("No module named 'uvicorn'"))
    assert cli.main(["serve", "--model", str(GOLDEN_DIR)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs starlette and uvicorn (pip install 'k3jax[serve]')" in err


def test_a_missing_checkpoint(tmp_path, capsys):
    assert cli.main(["serve", "--model", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "nothing" in err


def test_flags_are_checked(capsys):
    for flags in (["--max-batch", "0"], ["--max-prefill-tokens", "0"],
                  ["--max-len", "1"], ["--port", "-1"], ["--prefix-cache-mib", "x"]):
        try:
            cli.main(["serve", "--model", str(GOLDEN_DIR), *flags])
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{flags} was accepted")
        assert capsys.readouterr().err.count("\n") == 1


def test_several_processes_need_a_mesh(monkeypatch, capsys):
    monkeypatch.setattr(command.jax, "process_count", lambda: 2)
    assert cli.main(["serve", "--model", str(GOLDEN_DIR)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "one of 2 processes" in err and "--mesh SPEC" in err

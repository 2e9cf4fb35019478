"""The command line: help everywhere, recipes listed, data command prints shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpeft.cli import main


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["recipes", "--help"], ["data", "--help"]])
def test_help_everywhere(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_recipes_lists_lora_and_full(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "lora" in out and "full" in out


def test_data_prints_partition(toy_files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    train, eval_ = toy_files
    argv = ["data", "file", "--partition", "dirichlet", "--alpha", "0.3", "--num-clients", "5",
            "--set", f"task.train_file={train}", "--set", f"task.eval_file={eval_}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "160 train" in out and "neg" in out and "pos" in out
    # with nearly one class per client the command says so; an iid split it does not
    assert main([*argv[:5], "0.01", *argv[6:]]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "label skew: " in out and "of the 5 clients hold 90% or more of one class" in out
    assert main(["data", "file", "--partition", "iid", "--num-clients", "5", *argv[-4:]]) == 0
    assert "label skew" not in capsys.readouterr().out


def test_data_bad_task_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "nosuchtask"]) == 2
    assert "task.name" in capsys.readouterr().out

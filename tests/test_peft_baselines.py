"""BitFit and (IA)^3: exactly the right parameters are trainable, the output starts unchanged, each learns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedpeft.adapters.base import build_adapter
from fedpeft.cli import main
from fedpeft.config import ConfigError, build_config
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import load_data, prepare
from fedpeft.models.backbone import load_backbone
from tests.conftest import tiny_raw_config

# a wider tiny BERT: biases and IA3 vectors of a 32-wide random model carry too little signal to learn fast
WIDER = {"name": "tiny-bert", "tiny_hidden_size": 64}
MY_RECIPES = ("federa", "ffa_lora", "rolora", "hetlora", "bitfit", "ia3")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run far faster on one thread on a shared machine; restore the count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def raw_for(kind: str, toy: tuple[Path, Path], run_dir: Path, **sections: object) -> dict:
    train, eval_ = toy
    return tiny_raw_config(train, eval_, run_dir, method=kind, **{"adapter": {"kind": kind}, **sections})


def assert_learns(records: list[dict]) -> None:
    losses = [r["train_loss"] for r in records]
    assert sum(losses[-3:]) / 3 < 0.85 * losses[0], losses


def test_bitfit_trains_exactly_the_biases_and_head(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    exp = prepare(build_config(raw_for("bitfit", toy_files, tmp_path / "run")))
    model = exp.backbone.model
    biases = {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    expected = biases | {"classifier.weight"}
    assert set(exp.slot.trainable) == expected
    assert any("LayerNorm.bias" in n for n in biases) and any("attention.self.query.bias" in n for n in biases)
    assert exp.trainable_params == sum(p.numel() for n, p in model.named_parameters() if n in expected)


def test_bitfit_learns(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("bitfit", toy_files, tmp_path / "run", rounds=10, model=WIDER,
                  client={"local_epochs": 3, "lr": 0.01})
    assert_learns(LocalEngine(prepare(build_config(raw)), tmp_path / "run").run())


def test_bitfit_needs_biases(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("bitfit", toy_files, tmp_path / "run", model={"name": "tiny-llama"})
    with pytest.raises(ConfigError, match=r"adapter\.kind"):
        prepare(build_config(raw))


def test_ia3_trains_scaling_vectors_and_starts_unchanged(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    cfg = build_config(raw_for("ia3", toy_files, tmp_path / "run"))
    task, _ = load_data(cfg)
    backbone = load_backbone(cfg.model, task, cfg.seed)
    backbone.model.eval()
    batch = backbone.tokenizer([ex.texts[0] for ex in task.eval[:8]], padding=True, return_tensors="pt")
    with torch.no_grad():
        before = backbone.model(**batch).logits
    build_adapter(cfg.adapter).apply(backbone)
    with torch.no_grad():
        after = backbone.model(**batch).logits
    torch.testing.assert_close(before, after)
    trainable = [n for n, p in backbone.model.named_parameters() if p.requires_grad]
    vectors = [n for n in trainable if ".ia3_l." in n]
    # per layer: key, value, attention output and FFN output (PEFT's BERT mapping)
    assert len(vectors) == 2 * 4 and set(trainable) - set(vectors) == {"classifier.weight", "classifier.bias"}


def test_ia3_learns(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("ia3", toy_files, tmp_path / "run", rounds=10, model=WIDER, client={"local_epochs": 3, "lr": 0.02})
    assert_learns(LocalEngine(prepare(build_config(raw)), tmp_path / "run").run())


def test_recipes_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in MY_RECIPES)
    for name in MY_RECIPES:  # every recipe's defaults validate
        build_config({"method": name})

"""The ``mpnet`` alias: a split zip from five PyPI packages assembled once into the cache, a clear
error when the extra is missing, and (when installed) the real all-mpnet-base-v2 at paper width."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from fedpeft.adapters.base import build_adapter
from fedpeft.adapters.bottleneck import AdaptedLayer
from fedpeft.adapters.lora import default_target_modules
from fedpeft.adapters.tt import TTLinear
from fedpeft.config import AdapterConfig, ConfigError, ModelConfig
from fedpeft.data.types import TaskData
from fedpeft.models import mpnet
from fedpeft.models.backbone import load_backbone
from fedpeft.models.mpnet import assemble_split_zip, mpnet_parts

TASK = TaskData(name="toy", problem_type="classification", label_names=("neg", "pos"), metrics=("accuracy",))


def split_zip(tmp_path: Path, pieces: int) -> tuple[list[Path], dict[str, bytes]]:
    """A zip of a small model folder, cut into ``pieces`` files of (nearly) equal size."""
    files = {"model/config.json": b'{"model_type": "mpnet"}', "model/weights.bin": bytes(range(256)) * 40}
    archive = tmp_path / "whole.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for name, data in files.items():
            zipped.writestr(name, data)
    data = archive.read_bytes()
    cut = -(-len(data) // pieces)
    parts = []
    for index in range(pieces):
        part = tmp_path / f"model.zip.{index + 1:03d}"
        part.write_bytes(data[index * cut : (index + 1) * cut])
        parts.append(part)
    return parts, files


def test_split_zip_is_assembled_once_into_the_cache(tmp_path: Path) -> None:
    parts, files = split_zip(tmp_path, 3)
    cache = tmp_path / "cache"
    folder = assemble_split_zip(parts, cache, "model")
    assert folder == cache / "model"
    for name, data in files.items():
        assert (cache / name).read_bytes() == data
    assert [p.name for p in cache.iterdir()] == ["model"]  # no scratch files left behind
    for part in parts:  # the second call reads nothing: the pieces may even be gone
        part.unlink()
    assert assemble_split_zip(parts, cache, "model") == folder


def test_pieces_out_of_order_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    parts, _ = split_zip(tmp_path, 3)
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as err:
        assemble_split_zip(list(reversed(parts)), cache, "model")
    assert err.value.field == "model.name" and "fedpeft[mpnet]" in str(err.value)
    assert list(cache.iterdir()) == []


def test_missing_extra_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mpnet, "MPNET_PACKAGES", ("fedpeft-no-such-package-001",))
    with pytest.raises(ConfigError) as err:
        mpnet_parts(mpnet.MPNET_PACKAGES)
    assert err.value.field == "model.name"
    assert "pip install 'fedpeft[mpnet]'" in str(err.value) and "\n" not in str(err.value)


def installed() -> bool:
    try:
        mpnet_parts()
    except ConfigError:
        return False
    return True


@pytest.mark.real
@pytest.mark.skipif(not installed(), reason="all-mpnet-base-v2 is not installed: pip install 'fedpeft[mpnet]'")
def test_real_mpnet_loads_at_paper_width(single_torch_thread: None) -> None:
    backbone = load_backbone(ModelConfig(name="mpnet"), TASK, 0)
    config = backbone.model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
        "mpnet", 768, 12, 12)
    assert set(backbone.new_parameters) == {"classifier.dense.weight", "classifier.dense.bias",
                                            "classifier.out_proj.weight", "classifier.out_proj.bias"}
    assert default_target_modules(backbone) == ["q", "v"]
    assert backbone.pooling == "mean"  # auto: a mean-pooled sentence encoder, no pretrained pooler
    batch = backbone.tokenizer(["a fine film", "dull"], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert backbone.model(**batch).logits.shape == (2, 2)
    build_adapter(AdapterConfig(kind="tt")).apply(backbone)  # FedTT's placement: after attention and FFN
    adapted = [name for name, m in backbone.model.named_modules() if isinstance(m, AdaptedLayer)]
    assert len(adapted) == 24 and sum(name.endswith("attention.attn.o") for name in adapted) == 12
    # the new dense + out_proj head: tt_classifier auto tensorizes its 768 x 768 dense layer (Table 10's shape)
    assert isinstance(backbone.model.classifier.dense, TTLinear)
    assert backbone.model.classifier.dense.modes == [12, 8, 8, 8, 8, 12]


@pytest.mark.real
def test_real_minilm_keeps_its_pretrained_pooler(single_torch_thread: None) -> None:
    """MiniLM's head is BERT's: a pretrained pooler and a linear classifier, so auto leaves it dense."""
    try:
        backbone = load_backbone(ModelConfig(name="minilm"), TASK, 0)
    except ConfigError as err:
        pytest.skip(str(err))
    assert set(backbone.new_parameters) == {"classifier.weight", "classifier.bias"}
    assert backbone.pooling == "mean_no_pooler"  # auto: a mean-pooled sentence encoder with BERT's pooler
    build_adapter(AdapterConfig(kind="tt")).apply(backbone)
    assert isinstance(backbone.model.bert.pooler.dense, torch.nn.Linear)
    assert not backbone.model.bert.pooler.dense.weight.requires_grad

"""Every architecture family runs a federated round on a tiny random-weight model (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedpeft.config import ModelConfig, build_config
from fedpeft.data.types import Example, TaskData
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.models.backbone import load_backbone
from fedpeft.models.encoding import encode_examples, predict, training_batch
from tests.conftest import SHARED_DATA, tiny_raw_config

CASES = [
    ("tiny-bert", "sequence_classification"),
    ("tiny-roberta", "sequence_classification"),
    ("tiny-gpt2", "sequence_classification"),
    ("tiny-gpt2", "causal_lm"),
    ("tiny-llama", "sequence_classification"),
    ("tiny-llama", "causal_lm"),
    ("tiny-t5", "seq2seq"),
    ("tiny-bart", "seq2seq"),
]


@pytest.mark.parametrize("name,head", CASES)
def test_one_round_each_architecture(toy_files: tuple[Path, Path], tmp_path: Path, name: str, head: str) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=2, model={"name": name, "head": head},
                          task={"max_train_examples": 48, "max_eval_examples": 16})
    exp = prepare(build_config(raw))
    assert exp.backbone.head == head
    assert any(".lora_" in k for k in exp.initial_state)
    records = LocalEngine(exp, tmp_path / "run").run()
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in records)
    assert 0.0 <= records[-1]["eval"]["accuracy"] <= 1.0


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-t5"])
def test_generative_rank_classification_scores_label_texts(name: str) -> None:
    task = TaskData("toy", "classification", ("negative", "positive"), ("accuracy",),
                    train=[Example(("a fine film",), 1), Example(("a dull film",), 0)])
    backbone = load_backbone(ModelConfig(name=name), task, seed=0)
    data = encode_examples(task.train, backbone.tokenizer, backbone.head, task, 32)
    batch = training_batch(data, [0, 1])
    loss = backbone.model(**batch).loss
    assert torch.isfinite(loss)
    backbone.model.eval()
    assert predict(backbone.model, data, [0, 1]).shape == (2,)


def test_seq2seq_head_refuses_a_decoder() -> None:
    from fedpeft.config import ConfigError

    task = TaskData("toy", "classification", ("a", "b"), ("accuracy",))
    with pytest.raises(ConfigError, match=r"model\.head"):
        load_backbone(ModelConfig(name="tiny-gpt2", head="seq2seq"), task, seed=0)


@pytest.mark.real
def test_multiple_choice_copa_runs(tmp_path: Path) -> None:
    if not (SHARED_DATA / "superglue" / "COPA").exists():
        pytest.skip(f"COPA data not found under {SHARED_DATA}")
    raw = {
        "method": "lora", "rounds": 1,
        "task": {"name": "copa", "data_dir": str(SHARED_DATA), "max_train_examples": 32, "max_eval_examples": 16},
        "partition": {"num_clients": 2}, "model": {"name": "tiny-bert"},
        "client": {"batch_size": 8}, "output": {"run_dir": str(tmp_path / "run"), "progress": False},
    }
    exp = prepare(build_config(raw))
    assert exp.backbone.head == "multiple_choice"
    records = LocalEngine(exp, tmp_path / "run").run()
    assert 0.0 <= records[0]["eval"]["accuracy"] <= 1.0


@pytest.mark.parametrize("name", ["tiny-bart", "tiny-t5"])
def test_encoder_decoder_classification_head_is_trained(toy_files: tuple[Path, Path], tmp_path: Path,
                                                       name: str) -> None:
    """BART/T5 put their sequence-classification head in ``classification_head``: it must train."""
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", model={"name": name, "head": "sequence_classification"})
    exp = prepare(build_config(raw))
    head = [k for k in exp.slot.trainable if k.startswith("classification_head.")]
    assert head and len(head) == len([k for k, _ in exp.backbone.model.named_parameters()
                                      if k.startswith("classification_head.")])


def test_parameters_missing_from_the_checkpoint_are_trained(tmp_path: Path) -> None:
    """A checkpoint without a pooler (saved from BertModel(add_pooling_layer=False)) loads with a random
    pooler and classifier: both train with the head instead of staying frozen at their random init."""
    from transformers import BertConfig, BertModel

    from fedpeft.adapters.base import build_adapter
    from fedpeft.config import AdapterConfig

    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64)
    BertModel(config, add_pooling_layer=False).save_pretrained(tmp_path / "ckpt")
    task = TaskData("toy", "classification", ("a", "b"), ("accuracy",))
    backbone = load_backbone(ModelConfig(name=str(tmp_path / "ckpt"), tokenizer="minilm"), task, seed=0)
    assert set(backbone.new_parameters) == {"bert.pooler.dense.weight", "bert.pooler.dense.bias",
                                            "classifier.weight", "classifier.bias"}
    build_adapter(AdapterConfig(kind="lora", r=2, target_modules=["query", "value"])).apply(backbone)
    trainable = {n for n, p in backbone.model.named_parameters() if p.requires_grad}
    assert set(backbone.new_parameters) <= trainable
    assert not any(n.startswith("bert.encoder") and ".lora_" not in n for n in trainable)

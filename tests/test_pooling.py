"""``model.pooling: mean``: the encoder's classifier reads the masked mean of its last layer, whatever
head the model class has, with or without soft prompts; refused where it has no meaning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedpeft.config import ConfigError, ModelConfig, build_config
from fedpeft.data.types import Example, TaskData
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import build_model, prepare
from fedpeft.export import ExportError, export_run, load
from fedpeft.models.backbone import load_backbone
from fedpeft.models.pooling import masked_mean
from tests.conftest import tiny_raw_config

TASK = TaskData("toy", "classification", ("neg", "pos"), ("accuracy",))
TEXTS = ["a good film", "the plot was really quite a dreadful story from start to end"]


def _batch(backbone) -> dict[str, torch.Tensor]:
    return dict(backbone.tokenizer(TEXTS, padding=True, return_tensors="pt"))


@pytest.mark.parametrize("name,pooling", [("tiny-bert", "mean"), ("tiny-roberta", "mean"),
                                          ("tiny-bert", "mean_no_pooler")])
def test_the_head_reads_the_masked_mean_of_the_last_layer(name: str, pooling: str) -> None:
    """BERT's pooler and RoBERTa's head, which read position 0, read the mean over real tokens;
    with ``mean_no_pooler`` BERT's classifier reads the mean itself."""
    backbone = load_backbone(ModelConfig(name=name, pooling=pooling), TASK, seed=0)
    model = backbone.model.eval()
    batch = _batch(backbone)
    assert batch["attention_mask"][0].sum() < batch["attention_mask"].shape[1]  # the first row is padded
    plain = load_backbone(ModelConfig(name=name), TASK, seed=0).model.eval()  # the same weights, first token
    with torch.no_grad():
        logits = model(**batch).logits
        last = plain.base_model(**batch).last_hidden_state  # the encoder's own output
        mean = masked_mean(last, batch["attention_mask"])
        manual = (last * batch["attention_mask"].unsqueeze(-1)).sum(1) / batch["attention_mask"].sum(1, keepdim=True)
        torch.testing.assert_close(mean, manual)
        if pooling == "mean_no_pooler":
            expected = model.classifier(mean)  # BERT's classifier on the mean itself
        elif name == "tiny-bert":
            expected = model.classifier(torch.tanh(model.bert.pooler.dense(mean)))  # the pooler's dense + tanh
        else:
            expected = model.classifier(mean.unsqueeze(1))  # RoBERTa's head reads position 0 of (B, L, H)
        plain_logits = plain(**batch).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(logits, plain_logits, atol=1e-4)  # the same weights read the first token otherwise


def test_masked_mean_leaves_out_padding() -> None:
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    torch.testing.assert_close(masked_mean(hidden, torch.tensor([[1, 1, 0]])), torch.tensor([[2.0, 3.0]]))
    torch.testing.assert_close(masked_mean(hidden, None), hidden.mean(dim=1))


@pytest.mark.parametrize("adapter", [{"kind": "lora", "r": 4}, {"kind": "prompt_tuning", "num_virtual_tokens": 3},
                                     {"kind": "p_tuning_v2", "num_virtual_tokens": 3}])
def test_padding_does_not_change_a_sentences_logits(adapter: dict, tmp_path: Path) -> None:
    """Scored alone or beside a longer sentence (so padded), a sentence gets the same logits: the
    mean leaves out padding, a soft prompt's positions count and a deep prompt's prefix columns
    of the mask are not taken for tokens."""
    raw = tiny_raw_config(tmp_path / "t.csv", tmp_path / "e.csv", tmp_path / "run", model={"pooling": "mean"},
                          adapter=adapter)
    backbone, _ = build_model(build_config(raw), TASK)
    model = backbone.model.eval()
    with torch.no_grad():
        both = model(**_batch(backbone)).logits
        alone = model(**dict(backbone.tokenizer(TEXTS[:1], return_tensors="pt"))).logits
    torch.testing.assert_close(both[:1], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,head", [("tiny-gpt2", "sequence_classification"), ("tiny-bert", "masked_lm"),
                                       ("tiny-t5", "seq2seq")])
def test_refused_where_the_head_does_not_read_an_encoders_first_token(name: str, head: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.pooling"):
        load_backbone(ModelConfig(name=name, head=head, pooling="mean"), TASK, seed=0)


def test_skipping_the_pooler_is_refused_where_there_is_none() -> None:
    with pytest.raises(ConfigError, match=r"model\.pooling: mean_no_pooler skips a pretrained pooler"):
        load_backbone(ModelConfig(name="tiny-roberta", pooling="mean_no_pooler"), TASK, seed=0)


# mean_no_pooler plateaus near 0.73 on the tiny random BERT (its classifier reads the un-squashed
# mean); 0.70 is 3.2 standard errors above chance (0.5 on 64 balanced examples)
@pytest.mark.parametrize("pooling,bound", [("mean", 0.75), ("mean_no_pooler", 0.70)])
def test_learns_and_exports_as_a_bundle_only(pooling: str, bound: float, toy_files: tuple[Path, Path], tmp_path: Path,
                                             single_torch_thread: None) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=10, client={"local_epochs": 2},
                          model={"pooling": pooling})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    accuracies = [r["eval"]["accuracy"] for r in records]
    assert records[-1]["train_loss"] < 0.8 * records[0]["train_loss"]
    assert max(accuracies[-3:]) >= bound, str(accuracies)
    for fmt in ("peft", "merged"):
        with pytest.raises(ExportError, match=f"--format {fmt}: model.pooling {pooling} "):
            export_run(tmp_path / "run", tmp_path / fmt, fmt)
    loaded = load(export_run(tmp_path / "run", tmp_path / "bundle", "bundle"))
    run = load(tmp_path / "run")
    batch = dict(loaded.tokenizer(TEXTS, padding=True, return_tensors="pt"))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(**batch).logits, run.model(**batch).logits)


def test_a_sentence_encoder_example_is_scored_the_same_by_evaluation_and_by_hand() -> None:
    """The hook also serves the batched evaluation path (a direct forward with the padded batch)."""
    from fedpeft.models.encoding import encode_examples, output_scores

    task = TaskData("toy", "classification", ("neg", "pos"), ("accuracy",),
                    eval=[Example((text,), 0) for text in TEXTS])
    backbone = load_backbone(ModelConfig(name="tiny-bert", pooling="mean"), task, seed=0)
    model = backbone.model.eval()
    data = encode_examples(task.eval, backbone.tokenizer, backbone.head, task, 32)
    scores = output_scores(model, data, range(len(data)))
    with torch.no_grad():
        by_hand = torch.cat([model(**dict(backbone.tokenizer([t], return_tensors="pt"))).logits for t in TEXTS])
    torch.testing.assert_close(scores, by_hand, rtol=1e-5, atol=1e-6)

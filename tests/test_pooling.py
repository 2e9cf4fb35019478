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
from fedpeft.export import export_run, load
from fedpeft.models.backbone import load_backbone
from fedpeft.models.pooling import masked_mean, resolve_pooling, sentence_pooling_mode
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
def test_learns_and_every_export_loads_back_the_same_model(pooling: str, bound: float, toy_files: tuple[Path, Path],
                                                          tmp_path: Path, single_torch_thread: None) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=10, client={"local_epochs": 2},
                          model={"pooling": pooling})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    accuracies = [r["eval"]["accuracy"] for r in records]
    assert records[-1]["train_loss"] < 0.8 * records[0]["train_loss"]
    assert max(accuracies[-3:]) >= bound, str(accuracies)
    run = load(tmp_path / "run")
    batch = dict(run.tokenizer(TEXTS, padding=True, return_tensors="pt"))
    for fmt in ("peft", "merged", "bundle"):
        loaded = load(export_run(tmp_path / "run", tmp_path / fmt, fmt))
        with torch.no_grad():
            torch.testing.assert_close(loaded.model(**batch).logits, run.model(**batch).logits, atol=1e-5, rtol=0)


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


def _sentence_encoder(folder: Path, modes: dict[str, bool] | None, arch: str = "bert") -> Path:
    """A tiny BERT (or RoBERTa, whose classifier has no pretrained pooler) saved as a sentence-transformers
    checkpoint pooling by ``modes`` (None: a plain checkpoint)."""
    import json

    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    shape = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
             "intermediate_size": 64}
    if arch == "bert":
        BertModel(BertConfig(**shape)).save_pretrained(folder)
    else:
        RobertaModel(RobertaConfig(**shape), add_pooling_layer=False).save_pretrained(folder)
    if modes is not None:
        (folder / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, **{f"pooling_mode_{k}": v for k, v in modes.items()}}))
    return folder


MEAN = {"cls_token": False, "mean_tokens": True, "max_tokens": False, "mean_sqrt_len_tokens": False}
CLS = {"cls_token": True, "mean_tokens": False, "max_tokens": False, "mean_sqrt_len_tokens": False}


@pytest.mark.parametrize("modes,expected", [(MEAN, "mean"), (CLS, "cls"), (None, None)])
def test_sentence_pooling_mode_is_read_from_the_checkpoint(modes: dict | None, expected: str | None,
                                                           tmp_path: Path) -> None:
    assert sentence_pooling_mode(str(_sentence_encoder(tmp_path / "ckpt", modes))) == expected
    assert sentence_pooling_mode(None) is None


@pytest.mark.parametrize("modes,head,expected", [
    (MEAN, "auto", "mean_no_pooler"),  # MiniLM's case: mean-pooled, with BERT's pooler
    (CLS, "auto", "head"), (None, "auto", "head"),
    (MEAN, "token_classification", "head"),  # pooling is for sequence classifiers only: auto leaves others alone
])
def test_auto_pooling_reads_a_mean_pooled_sentence_encoder_and_leaves_the_rest(
        modes: dict | None, head: str, expected: str, tmp_path: Path) -> None:
    folder = _sentence_encoder(tmp_path / "ckpt", modes)
    task = TaskData("toy", "classification" if head == "auto" else "token_classification", ("a", "b"), ("accuracy",))
    backbone = load_backbone(ModelConfig(name=str(folder), tokenizer="minilm", head=head), task, seed=0)
    assert backbone.pooling == expected
    explicit = load_backbone(ModelConfig(name=str(folder), tokenizer="minilm", pooling="head"),
                             TaskData("toy", "classification", ("a", "b"), ("accuracy",)), seed=0)
    assert explicit.pooling == "head"
    if expected != "head":  # auto gives the same model as asking for the resolved pooling
        asked = load_backbone(ModelConfig(name=str(folder), tokenizer="minilm", pooling=expected), task, seed=0)
        inputs = _batch(backbone)
        with torch.no_grad():
            torch.testing.assert_close(backbone.model.eval()(**inputs).logits, asked.model.eval()(**inputs).logits)
            assert not torch.allclose(backbone.model(**inputs).logits, explicit.model.eval()(**inputs).logits)


def test_auto_pooling_without_a_pretrained_pooler_is_the_mean_through_the_head(tmp_path: Path) -> None:
    """MPNet's case (a mean-pooled sentence encoder whose classifier has no pooler): ``mean``."""
    folder = _sentence_encoder(tmp_path / "ckpt", MEAN, arch="roberta")
    backbone = load_backbone(ModelConfig(name=str(folder), tokenizer="minilm"), TASK, seed=0)
    assert backbone.pooling == "mean"
    assert resolve_pooling("auto", backbone.model, None, "encoder", "sequence_classification") == "head"


def test_auto_is_head_for_tiny_random_models() -> None:
    task = TaskData("toy", "classification", ("a", "b"), ("accuracy",))
    assert load_backbone(ModelConfig(name="tiny-bert"), task, seed=0).pooling == "head"

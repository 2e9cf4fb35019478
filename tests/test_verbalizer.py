"""LM-BFF template + label words on a tiny masked LM: encoding, logits by hand, errors, learning with prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedpeft.adapters import build_adapter
from fedpeft.config import AdapterConfig, ConfigError, ModelConfig
from fedpeft.data.types import Example, TaskData
from fedpeft.models.backbone import load_backbone
from fedpeft.models.encoding import encode_examples, predict, training_batch
from fedpeft.models.verbalizer import encode_with_template, label_word_ids
from tests.test_prompts import learnable_experiment, learning_config

SENTIMENT = TaskData("sst2", "classification", ("negative", "positive"), ("accuracy",),
                     train=[Example(("a fine and moving film",), 1), Example(("dull",), 0)])
PAIRS = TaskData("rte", "classification", ("entailment", "not_entailment"), ("accuracy",),
                 train=[Example(("the cat sat on the mat", "a cat sat"), 0)])


def test_lm_bff_templates_and_label_words() -> None:
    backbone = load_backbone(ModelConfig(name="tiny-bert", head="masked_lm"), SENTIMENT, 0)
    tok = backbone.tokenizer
    assert backbone.template == "{0} It was {mask} ."
    ids = encode_examples(SENTIMENT.train, tok, "masked_lm", SENTIMENT, 64, template=backbone.template).features[0]
    assert tok.decode(ids["input_ids"]) == "[CLS] a fine and moving film it was [MASK]. [SEP]"
    assert label_word_ids(tok, SENTIMENT.label_names, None) == tok.convert_tokens_to_ids(["terrible", "great"])
    pair = encode_with_template(tok, PAIRS.train[0].texts, "{0} ? {mask} , {1}", 64)
    assert tok.decode(pair) == "[CLS] the cat sat on the mat? [MASK], a cat sat [SEP]"


def test_long_texts_are_cut_so_the_mask_survives() -> None:
    tok = load_backbone(ModelConfig(name="tiny-bert", head="masked_lm"), SENTIMENT, 0).tokenizer
    long = ("word " * 200).strip()
    ids = encode_with_template(tok, (long, long), "{0} ? {mask} , {1}", 32)
    assert len(ids) == 32 and ids.count(tok.mask_token_id) == 1
    assert ids[-1] == tok.sep_token_id


def test_verbalizer_logits_are_the_label_words_at_the_mask() -> None:
    backbone = load_backbone(ModelConfig(name="tiny-roberta", head="masked_lm"), SENTIMENT, 0)
    model = backbone.model.eval()
    data = encode_examples(SENTIMENT.train, backbone.tokenizer, "masked_lm", SENTIMENT, 64,
                           template=backbone.template)
    batch = training_batch(data, [0, 1])
    out = model(**batch)
    words = label_word_ids(backbone.tokenizer, SENTIMENT.label_names, None)
    with torch.no_grad():
        lm = model.language_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    rows = torch.arange(2)
    positions = (batch["input_ids"] == backbone.tokenizer.mask_token_id).int().argmax(1)
    expected = lm[rows, positions][:, words]
    assert torch.allclose(out.logits, expected, atol=1e-5)
    assert torch.allclose(out.loss, torch.nn.functional.cross_entropy(expected, batch["labels"]), atol=1e-5)
    assert predict(model, data, [0, 1]).tolist() == expected.argmax(1).tolist()


def test_masked_lm_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"model\.head"):
        load_backbone(ModelConfig(name="tiny-gpt2", head="masked_lm"), SENTIMENT, 0)
    with pytest.raises(ConfigError, match=r"model\.label_words"):
        load_backbone(ModelConfig(name="tiny-bert", head="masked_lm", label_words=["good", "good"]), SENTIMENT, 0)
    tok = load_backbone(ModelConfig(name="tiny-bert", head="masked_lm"), SENTIMENT, 0).tokenizer
    with pytest.raises(ConfigError, match=r"model\.template"):
        encode_with_template(tok, ("text",), "{0} is nice", 32)
    with pytest.raises(ConfigError, match=r"model\.template"):
        encode_with_template(tok, ("text",), "{0} {2} {mask}", 32)


@pytest.mark.parametrize("kind", ["p_tuning_v2", "prompt_tuning"])
def test_prompts_and_verbalizer_only_train_prompts(kind: str) -> None:
    backbone = load_backbone(ModelConfig(name="tiny-bert", head="masked_lm"), SENTIMENT, 0)
    build_adapter(AdapterConfig(kind=kind, num_virtual_tokens=3)).apply(backbone)
    trainable = [n for n, p in backbone.model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith(("prefix_encoder", "prompt_encoder")) for n in trainable)
    data = encode_examples(SENTIMENT.train, backbone.tokenizer, "masked_lm", SENTIMENT, 64,
                           template=backbone.template)
    out = backbone.model(**training_batch(data, [0, 1]))
    assert out.logits.shape == (2, 2)
    out.loss.backward()


def test_deep_prompts_learn_through_the_verbalizer(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = learning_config(train, eval_, tmp_path / "run", "p_tuning_v2",
                          model={"head": "masked_lm", "label_words": ["bad", "good"]})
    records = learnable_experiment(raw).run()
    accuracies = [r["eval"]["accuracy"] for r in records]
    assert records[-1]["train_loss"] < 0.6 * records[0]["train_loss"]
    assert accuracies[-1] >= 0.75, accuracies

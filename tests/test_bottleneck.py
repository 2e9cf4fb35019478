"""Houlsby bottleneck adapters: exact math, placement on every architecture, learning, bad input."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fedpeft.adapters.base import build_adapter
from fedpeft.adapters.bottleneck import AdaptedLayer, Bottleneck, dense_linear
from fedpeft.config import AdapterConfig, ConfigError, ModelConfig, build_config
from fedpeft.data.types import TaskData
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.models.backbone import load_backbone
from tests.conftest import tiny_raw_config


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a shared CPU two spinning threads cost 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TASK = TaskData(name="toy", problem_type="classification", label_names=("neg", "pos"), metrics=("accuracy",))


def test_output_and_input_placement_math() -> None:
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    x = torch.randn(3, 4, 6)
    adapter = Bottleneck(5, 2, dense_linear, "relu", 0.0, 0.5)
    out = AdaptedLayer(base, adapter, "output")(x)
    h = base(x)
    expected = h + 0.5 * (torch.relu(h @ adapter.down.weight.T + adapter.down.bias) @ adapter.up.weight.T
                          + adapter.up.bias)
    torch.testing.assert_close(out, expected)

    adapter_in = Bottleneck(6, 3, dense_linear, "tanh", 0.0, 1.0)
    out_in = AdaptedLayer(base, adapter_in, "input")(x)
    branch = torch.tanh(x @ adapter_in.down.weight.T + adapter_in.down.bias) @ adapter_in.up.weight.T
    torch.testing.assert_close(out_in, base(x + branch + adapter_in.up.bias))


# model -> (head, number of adapted layers with 2 tiny layers per stack)
PLACEMENTS = {
    "tiny-bert": ("sequence_classification", 4, "attention.output.dense"),
    "tiny-roberta": ("sequence_classification", 4, "output.dense"),
    "tiny-gpt2": ("sequence_classification", 4, "mlp.c_proj"),
    "tiny-llama": ("sequence_classification", 6, "mlp.gate_proj"),
    "tiny-t5": ("seq2seq", 10, "EncDecAttention.o"),
    "tiny-bart": ("seq2seq", 10, "encoder_attn.out_proj"),
}


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_placement_and_trainable_set(name: str) -> None:
    head, count, example_suffix = PLACEMENTS[name]
    backbone = load_backbone(ModelConfig(name=name, head=head), TASK, 0)
    build_adapter(AdapterConfig(kind="houlsby", bottleneck_size=4, train_head=False)).apply(backbone)
    adapted = {n: m for n, m in backbone.model.named_modules() if isinstance(m, AdaptedLayer)}
    assert len(adapted) == count, sorted(adapted)
    assert any(n.endswith(example_suffix) for n in adapted)
    trainable = [n for n, p in backbone.model.named_parameters() if p.requires_grad]
    assert trainable and all(".adapter." in n for n in trainable)
    assert len(trainable) == 4 * count  # down/up weight + bias per adapter
    if name == "tiny-llama":
        placements = {n.rsplit(".", 1)[-1]: m.placement for n, m in adapted.items()}
        assert placements == {"gate_proj": "input", "up_proj": "input", "down_proj": "output"}


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-t5"])
def test_runs_a_round_on_decoder_and_encoder_decoder(toy_files: tuple[Path, Path], tmp_path: Path,
                                                     name: str) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="adapter", rounds=1, model={"name": name},
                          adapter={"kind": "houlsby", "bottleneck_size": 8},
                          task={"max_train_examples": 32, "max_eval_examples": 16})
    exp = prepare(build_config(raw))
    before = {k: v.clone() for k, v in exp.initial_state.items()}
    engine = LocalEngine(exp, tmp_path / "run")
    records = engine.run()
    assert torch.isfinite(torch.tensor(records[0]["train_loss"]))
    assert any(not torch.equal(before[k], engine.final_state[k]) for k in before if ".adapter." in k)


def test_adapter_recipe_learns(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    # tiny-llama: its input adapters reach the polar word; on the tiny random BERT (attention
    # saturated by the wide init) per-token adapters barely move the [CLS] representation.
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="adapter", rounds=5, model={"name": "tiny-llama"},
                          adapter={"kind": "houlsby", "bottleneck_size": 16})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    assert records[-1]["train_loss"] < 0.8 * records[0]["train_loss"]
    assert max(r["eval"]["accuracy"] for r in records[-3:]) >= 0.75  # chance: 0.5


@pytest.mark.parametrize("extra,field", [
    ({"bottleneck_size": 0}, "adapter.bottleneck_size"),
    ({"non_linearity": "sine"}, "adapter.non_linearity"),
    ({"bottleneck_sise": 8}, "adapter.bottleneck_sise"),
])
def test_bad_options_name_the_field(extra: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_adapter(AdapterConfig(kind="houlsby", **extra))
    assert err.value.field == field


def test_unmatched_targets_name_the_field() -> None:
    backbone = load_backbone(ModelConfig(name="tiny-bert"), TASK, 0)
    adapter = build_adapter(AdapterConfig(kind="houlsby", target_modules=["no_such_module"]))
    with pytest.raises(ConfigError, match="no module") as err:
        adapter.apply(backbone)
    assert err.value.field == "adapter.target_modules"

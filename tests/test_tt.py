"""FedTT's tensor-train layer and tensorized adapters: exact math against tensorly, shapes,
initialisation, placement on encoder / decoder / encoder-decoder models, bad input."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tensorly as tl
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig

from fedpeft.adapters.base import build_adapter
from fedpeft.adapters.bottleneck import AdaptedLayer
from fedpeft.adapters.tt import TTLinear, factorize, tt_contract, tt_layers, tt_shape
from fedpeft.adapters.tt.layer import contraction_flops
from fedpeft.config import AdapterConfig, ConfigError, ModelConfig, build_config
from fedpeft.data.types import Example, TaskData
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.models.backbone import Backbone, load_backbone
from fedpeft.models.encoding import encode_examples, training_batch
from tests.conftest import tiny_raw_config


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a shared CPU two spinning threads cost 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TASK = TaskData(name="toy", problem_type="classification", label_names=("neg", "pos"), metrics=("accuracy",))


def dense_reference(layer: TTLinear) -> np.ndarray:
    """W rebuilt independently: tensorly's TT-to-full, then the row-major IN x OUT reshape."""
    cores = [c.detach().double().numpy() for c in layer.cores]
    return tl.tt_to_tensor(cores).reshape(layer.in_features, layer.out_features)


@pytest.mark.parametrize("in_features,out_features,modes,rank", [
    (12, 6, [3, 4, 2, 3], 3),
    (6, 12, [2, 3, 4, 3], 2),
    (384, 64, [6, 8, 8, 8, 8], 5),
    (64, 768, [8, 8, 12, 8, 8], 5),
    (10, 10, [100], 4),  # one core: W is the core itself
])
def test_tt_layer_equals_x_times_dense_w_plus_b(in_features: int, out_features: int, modes: list[int],
                                               rank: int) -> None:
    torch.manual_seed(0)
    layer = TTLinear(in_features, out_features, modes, rank).double()
    with torch.no_grad():  # move the cores off their init so every entry matters
        for core in layer.cores:
            core.add_(torch.randn_like(core))
    x = torch.randn(2, 3, in_features, dtype=torch.float64)
    expected = x.numpy() @ dense_reference(layer) + layer.bias.detach().numpy()
    np.testing.assert_allclose(layer(x).detach().numpy(), expected, rtol=1e-10, atol=1e-10)
    assert [tuple(c.shape) for c in layer.cores] == [
        (layer.ranks[j], k, layer.ranks[j + 1]) for j, k in enumerate(modes)
    ]
    assert layer.ranks[0] == layer.ranks[-1] == 1


def test_contraction_is_eq1_on_small_cores() -> None:
    # G_1 (1x2x2), G_2 (2x3x1): W[i1, i2] = sum_a G_1[0, i1, a] G_2[a, i2, 0]
    g1 = torch.arange(4.0).reshape(1, 2, 2)
    g2 = torch.arange(6.0).reshape(2, 3, 1) - 2
    expected = torch.einsum("xia,ajy->ij", g1, g2).reshape(-1)
    torch.testing.assert_close(tt_contract([g1, g2]), expected)


def test_parameter_count_is_sum_of_core_sizes() -> None:
    layer = TTLinear(768, 64, [8, 8, 12, 8, 8], 5)
    cores = sum(c.numel() for c in layer.cores)
    assert cores == 1 * 8 * 5 + 5 * 8 * 5 + 5 * 12 * 5 + 5 * 8 * 5 + 5 * 8 * 1
    assert cores < 768 * 64 / 40


def test_loretta_initialisation_scale() -> None:
    """Every rebuilt entry has variance sigma^2 = 1 / (IN + OUT); the bias is U(+-1/sqrt(OUT))."""
    mean_squares = []
    for seed in range(8):
        torch.manual_seed(seed)
        layer = TTLinear(384, 64, [6, 8, 8, 8, 8], 5)
        mean_squares.append(float(layer.weight_matrix().detach().pow(2).mean()))
        assert float(layer.bias.detach().abs().max()) <= 1 / math.sqrt(64)
    assert np.mean(mean_squares) == pytest.approx(1 / (384 + 64), rel=0.3)


def test_shape_table_and_factorization_rule() -> None:
    assert tt_shape(768, 64) == [8, 8, 12, 8, 8]
    assert tt_shape(64, 768) == [8, 8, 12, 8, 8]
    assert tt_shape(4096, 64) == [16, 16, 16, 4, 4, 4]
    assert tt_shape(64, 4096) == [4, 4, 4, 16, 16, 16]
    assert tt_shape(64, 1024) == [4, 8, 8, 8, 8, 4]
    assert tt_shape(768, 768) == [12, 8, 8, 8, 8, 12]
    # the rule reproduces the table's factors and covers MiniLM, GPT-2 and tiny sizes
    assert factorize(768, 16) == [8, 8, 12]
    assert factorize(4096, 16) == [16, 16, 16]
    assert tt_shape(384, 64) == [6, 8, 8, 8, 8]
    assert tt_shape(64, 384) == [8, 8, 6, 8, 8]
    assert tt_shape(32, 8, max_mode=4) == [2, 4, 4, 2, 4]
    for n in (384, 768, 4096, 32, 100, 1536):
        assert math.prod(factorize(n, 16)) == n and max(factorize(n, 16)) <= 16
    assert tt_shape(384, 64, overrides={"384x64": [24, 16, 64]}) == [24, 16, 64]


def test_unfactorizable_size_names_the_field() -> None:
    with pytest.raises(ConfigError, match="prime factor 17") as err:
        tt_shape(34, 64)
    assert err.value.field == "adapter.tt_shapes"
    assert tt_shape(34, 64, max_mode=17)[:2] == [2, 17]


@pytest.mark.parametrize("extra,field", [
    ({"tt_rank": 0}, "adapter.tt_rank"),
    ({"tt_shapes": {"384x64": [6, 8, 8]}}, "adapter.tt_shapes"),
    ({"tt_shapes": {"384-64": [6, 8, 8, 8, 8]}}, "adapter.tt_shapes"),
    ({"tt_max_mode": 1}, "adapter.tt_max_mode"),
    ({"tt_up_init_scale": 0.0}, "adapter.tt_up_init_scale"),
    ({"tt_ranks": 5}, "adapter.tt_ranks"),
    ({"tt_contraction": "fast"}, "adapter.tt_contraction"),
    ({"decoder_layout": "middle"}, "adapter.decoder_layout"),
])
def test_bad_options_name_the_field(extra: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_adapter(AdapterConfig(kind="tt", **extra))
    assert err.value.field == field


# model -> (head, number of adapted layers) with 2 tiny layers per stack
ARCHITECTURES = {
    "tiny-bert": ("sequence_classification", 4),
    "tiny-gpt2": ("sequence_classification", 4),
    "tiny-llama": ("sequence_classification", 6),
    "tiny-t5": ("seq2seq", 10),
    "tiny-bart": ("seq2seq", 10),
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_tensorized_adapters_on_every_architecture(name: str) -> None:
    head, count = ARCHITECTURES[name]
    backbone = load_backbone(ModelConfig(name=name, head=head), TASK, 0)
    build_adapter(AdapterConfig(kind="tt", bottleneck_size=8, tt_rank=3, train_head=False)).apply(backbone)
    model = backbone.model
    adapted = [m for m in model.modules() if isinstance(m, AdaptedLayer)]
    layers = tt_layers(model)
    assert len(adapted) == count and len(layers) == 2 * count
    assert all(isinstance(m.adapter.down, TTLinear) and isinstance(m.adapter.up, TTLinear) for m in adapted)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    expected = {f"{layer}.cores.{j}" for layer, m in layers.items() for j in range(m.num_cores)}
    expected |= {f"{layer}.bias" for layer in layers}
    assert trainable == expected  # the cores and biases only: no dense adapter weight anywhere
    assert not any(n.endswith("adapter.down.weight") for n, _ in model.named_parameters())

    examples = [Example(texts=("the movie was good",), label=1), Example(texts=("awful plot",), label=0)]
    data = encode_examples(examples, backbone.tokenizer, backbone.head, TASK, 16)
    loss = model(**training_batch(data, [0, 1])).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_up_init_scale_starts_the_adapters_near_identity() -> None:
    """``tt_up_init_scale`` scales every Up matrix (not Down) and zeroes its bias; outputs barely move."""
    outputs, ups, downs = {}, {}, {}
    examples = [Example(texts=("the movie was good",), label=1), Example(texts=("awful plot",), label=0)]
    for scale in (1.0, 1e-3):
        torch.manual_seed(0)
        backbone = load_backbone(ModelConfig(name="tiny-bert"), TASK, 0)
        backbone.model.eval()
        plain = backbone.model(**training_batch(encode_examples(examples, backbone.tokenizer, backbone.head,
                                                                TASK, 16), [0, 1])).logits.detach()
        torch.manual_seed(1)
        build_adapter(AdapterConfig(kind="tt", bottleneck_size=8, tt_up_init_scale=scale)).apply(backbone)
        backbone.model.eval()
        adapted = [m for m in backbone.model.modules() if isinstance(m, AdaptedLayer)]
        ups[scale] = [m.adapter.up for m in adapted]
        downs[scale] = [m.adapter.down.weight_matrix().detach() for m in adapted]
        data = encode_examples(examples, backbone.tokenizer, backbone.head, TASK, 16)
        outputs[scale] = (backbone.model(**training_batch(data, [0, 1])).logits.detach() - plain).abs().max()
    for up, reference in zip(ups[1e-3], ups[1.0], strict=True):
        assert torch.allclose(up.weight_matrix(), reference.weight_matrix() * 1e-3, atol=1e-9)
        assert float(up.bias.detach().abs().max()) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(downs[1e-3], downs[1.0], strict=True))
    assert float(outputs[1e-3]) < 1e-2 * float(outputs[1.0])


def test_tensorized_classifier() -> None:
    backbone = load_backbone(ModelConfig(name="tiny-bert"), TASK, 0)
    build_adapter(AdapterConfig(kind="tt", bottleneck_size=8, tt_classifier=True)).apply(backbone)
    pooler = backbone.model.bert.pooler.dense
    assert isinstance(pooler, TTLinear) and pooler.in_features == pooler.out_features == 32
    assert all(p.requires_grad for p in pooler.parameters())
    assert backbone.model.classifier.weight.requires_grad  # train_head

    roberta = load_backbone(ModelConfig(name="tiny-roberta"), TASK, 0)
    build_adapter(AdapterConfig(kind="tt", bottleneck_size=8, tt_classifier=True)).apply(roberta)
    assert isinstance(roberta.model.classifier.dense, TTLinear)

    gpt2 = load_backbone(ModelConfig(name="tiny-gpt2"), TASK, 0)
    with pytest.raises(ConfigError) as err:
        build_adapter(AdapterConfig(kind="tt", bottleneck_size=8, tt_classifier=True)).apply(gpt2)
    assert err.value.field == "adapter.tt_classifier"


def test_fedtt_round_on_encoder_decoder(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="fedtt", rounds=1, model={"name": "tiny-t5"},
                          adapter={"kind": "tt", "bottleneck_size": 8},
                          task={"max_train_examples": 32, "max_eval_examples": 16})
    exp = prepare(build_config(raw))
    before = {k: v.clone() for k, v in exp.initial_state.items()}
    engine = LocalEngine(exp, tmp_path / "run")
    records = engine.run()
    assert torch.isfinite(torch.tensor(records[0]["train_loss"]))
    assert len(records[0]["clients"]) == 2  # cross-device: 2 of the 4 clients sampled
    assert all(".cores." in k or k.endswith(".bias") for k in before)
    assert any(not torch.equal(before[k], engine.final_state[k]) for k in before)


@pytest.mark.parametrize("in_features,out_features,modes,rank", [
    (12, 6, [3, 4, 2, 3], 3),
    (6, 12, [2, 3, 4, 3], 2),
    (64, 16, [4, 4, 4, 4, 4], 3),
    (16, 64, [2, 8, 8, 4, 2], 4),
])
def test_direct_contraction_equals_rebuild_in_outputs_and_gradients(in_features: int, out_features: int,
                                                                    modes: list[int], rank: int) -> None:
    torch.manual_seed(0)
    rebuild = TTLinear(in_features, out_features, modes, rank, contraction="rebuild")
    direct = TTLinear(in_features, out_features, modes, rank, contraction="direct")
    direct.load_state_dict(rebuild.state_dict())
    x = torch.randn(3, 5, in_features)
    target = torch.randn(3, 5, out_features)
    outputs, grads = [], []
    for layer in (rebuild, direct):
        inputs = x.clone().requires_grad_(True)
        out = layer(inputs)
        ((out - target) ** 2).sum().backward()
        outputs.append(out.detach())
        grads.append([inputs.grad, *(p.grad for p in layer.parameters())])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-5)
    for got, expected in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # gradients of order 10-100


def test_flop_estimate_picks_the_cheaper_contraction() -> None:
    modes, rank = [8, 8, 12, 8, 8], 5
    ranks = [1, 5, 5, 5, 5, 1]
    flops = contraction_flops(modes, ranks, 768, tokens=1)
    # counted by hand: the chain 2 * (8*5*8*5 + 64*5*12*5 + 768*5*8*5 + 6144*5*8*1), then x @ W
    assert flops["rebuild"] == 2 * (1600 + 19200 + 153600 + 245760) + 2 * 768 * 64
    # absorb 8, 8, 12 (N x 768 x 1 -> x 96 x 5 -> x 12 x 5 -> x 1 x 5), expand 8, 8
    assert flops["direct"] == 2 * (768 * 5 + 96 * 25 + 12 * 25 + 5 * 8 * 5 + 8 * 5 * 8)
    wide = TTLinear(768, 64, modes, rank, contraction="auto")
    assert wide.uses_direct(1) and wide.uses_direct(10**6)  # per token 2 x 7,060 vs 2 x 49,152, and no chain
    # a small matrix with a high rank: direct's per-token cost (2 x 108) is 1.5x x @ W's (2 x 72), but
    # rebuild pays the chain (1,080) once: direct for few tokens, rebuild from the crossover on
    small_modes, small_ranks = [3, 4, 2, 3], [1, 3, 3, 3, 1]
    small = TTLinear(12, 6, small_modes, 3, contraction="auto")
    assert contraction_flops(small_modes, small_ranks, 12, 1) == {"rebuild": 1080 + 144, "direct": 216}
    assert small.uses_direct(1) and not small.uses_direct(100)
    crossover = next(n for n in range(1, 100) if not small.uses_direct(n))
    at = contraction_flops(small_modes, small_ranks, 12, crossover)
    before = contraction_flops(small_modes, small_ranks, 12, crossover - 1)
    assert at["rebuild"] <= at["direct"] and before["direct"] < before["rebuild"]
    assert crossover == 15  # 1,080 + 144 N <= 216 N from N = 15 on
    # a mode list with no prefix multiplying to IN: only the rebuild can apply it
    assert contraction_flops([100], [1, 1], 10, 4)["direct"] is None
    assert not TTLinear(10, 10, [100], 4, contraction="auto").uses_direct(10**6)
    with pytest.raises(ConfigError) as err:
        build_adapter(AdapterConfig(kind="tt", tt_contraction="direct", bottleneck_size=8,
                                    tt_shapes={"32x8": [16, 16]})).apply(
            load_backbone(ModelConfig(name="tiny-bert"), TASK, 0))
    assert err.value.field == "adapter.tt_contraction"


@pytest.mark.parametrize("layout,placements", [
    ("loretta", {"gate_proj": "input", "up_proj": "input", "down_proj": "output"}),
    ("after_blocks", {"o_proj": "output", "down_proj": "output"}),
])
def test_decoder_layout_on_a_tiny_llama(layout: str, placements: dict[str, str]) -> None:
    """LoRETTA's MLP adapters vs the paper's text (after attention and after the MLP), on a random
    LLaMA with a 64-token vocabulary; every adapter core gets a gradient through the model."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, pad_token_id=0,
                         num_labels=2)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    backbone = Backbone(model=model, tokenizer=None, architecture="decoder",  # type: ignore[arg-type]
                        head="sequence_classification", name="llama-64")
    build_adapter(AdapterConfig(kind="tt", bottleneck_size=8, tt_rank=3, decoder_layout=layout)).apply(backbone)
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, AdaptedLayer)}
    assert len(adapted) == 2 * len(placements)
    assert {name.rsplit(".", 1)[-1]: m.placement for name, m in adapted.items()} == placements
    ids = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=torch.tensor([0, 1, 1])).loss.backward()
    cores = [p for name, p in model.named_parameters() if ".cores." in name]
    assert cores and all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in cores)


@pytest.mark.parametrize("arch,dense,tensorized", [
    ("roberta", "classifier.dense", True),  # the checkpoint has no head: a new 32 x 32 dense layer
    ("bert", "bert.pooler.dense", False),  # BERT's pooler is in the checkpoint (as in MiniLM)
])
def test_tensorized_classifier_by_default_where_the_dense_layer_is_new(tmp_path: Path, arch: str, dense: str,
                                                                      tensorized: bool) -> None:
    """``tt_classifier: auto`` tensorizes the head's hidden x hidden layer only where it was not pretrained."""
    tiny = load_backbone(ModelConfig(name=f"tiny-{arch}"), TASK, 0)
    encoder = getattr(tiny.model, arch)  # save the encoder alone: a checkpoint without a task head
    encoder.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    backbone = load_backbone(ModelConfig(name=str(tmp_path)), TASK, 0)
    assert (f"{dense}.weight" in backbone.new_parameters) == tensorized
    build_adapter(AdapterConfig(kind="tt", bottleneck_size=8)).apply(backbone)  # tt_classifier: auto
    assert isinstance(backbone.model.get_submodule(dense), TTLinear) == tensorized
    forced = load_backbone(ModelConfig(name=str(tmp_path)), TASK, 0)
    build_adapter(AdapterConfig(kind="tt", bottleneck_size=8, tt_classifier=not tensorized)).apply(forced)
    assert isinstance(forced.model.get_submodule(dense), TTLinear) != tensorized
    # tiny random models have no checkpoint: auto keeps their dense layer, as before
    build_adapter(AdapterConfig(kind="tt", bottleneck_size=8)).apply(tiny)
    assert not isinstance(tiny.model.get_submodule(dense), TTLinear)

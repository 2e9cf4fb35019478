"""FeDeRA: SVD init math (Eq. 6-10), unchanged output, identical residual everywhere, Eq. 11-14, learning."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from fedpeft.adapters.base import build_adapter
from fedpeft.adapters.federa import svd_lora_factors
from fedpeft.config import ConfigError, build_config
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import load_data, prepare
from fedpeft.methods.federa import direction_variation, lora_variation, magnitude_variation
from fedpeft.models.backbone import load_backbone
from tests.conftest import SHARED_DATA, tiny_raw_config

SVD = {"kind": "lora", "init": "svd", "r": 4, "alpha": 8}
TOY = {"partition": {"kind": "iid", "num_clients": 4}, "strategy": {"name": "fedavg", "clients_per_round": 2}}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run far faster on one thread on a shared machine; restore the count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def federa_raw(toy: tuple[Path, Path], run_dir: Path, **sections: object) -> dict:
    train, eval_ = toy
    return tiny_raw_config(train, eval_, run_dir, method="federa", **{"adapter": SVD, **TOY, **sections})


@pytest.mark.parametrize(("scale", "absorb"), [(1.0, False), (2.0, False), (2.0, True)])
def test_svd_factors_follow_eq_8_to_10(scale: float, absorb: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(6, 5, dtype=torch.float64)
    a, b, residual = svd_lora_factors(weight, 2, scale, absorb)
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    s_r = s[:2] / scale if absorb else s[:2]
    assert a.shape == (2, 5) and b.shape == (6, 2)
    torch.testing.assert_close(a, torch.diag(s_r.sqrt()) @ vh[:2])  # Eq. 8
    torch.testing.assert_close(b, u[:, :2] @ torch.diag(s_r.sqrt()))  # Eq. 9
    torch.testing.assert_close(residual + scale * b @ a, weight)  # Eq. 10: output unchanged
    if absorb or scale == 1.0:  # the residual is exactly the rest of the spectrum
        torch.testing.assert_close(residual, u[:, 2:] @ torch.diag(s[2:]) @ vh[2:])
    else:
        assert not torch.allclose(residual, u[:, 2:] @ torch.diag(s[2:]) @ vh[2:])


def test_svd_factors_do_not_depend_on_thread_count() -> None:
    """Machines differ in thread count; multi-threaded LAPACK differs in the last bits (MiniLM-sized W)."""
    torch.manual_seed(0)
    weight = 0.05 * torch.randn(384, 384)
    results = []
    for threads in (1, 2, 4):
        torch.set_num_threads(threads)
        results.append(svd_lora_factors(weight, 32, 1.0))
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other))


def test_svd_rank_above_matrix_size_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"adapter\.r"):
        svd_lora_factors(torch.randn(3, 5), 4, 1.0)


def test_absorbed_scale_equals_peft_pissa() -> None:
    """With ``svd_absorb_scale`` the product and residual equal HF PEFT's PiSSA init (sign-free check)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = nn.Linear(12, 10)

    torch.manual_seed(0)
    ours, theirs = Block(), Block()
    theirs.load_state_dict(ours.state_dict())
    inject_adapter_in_model(LoraConfig(r=3, lora_alpha=6, target_modules=["query"], init_lora_weights="pissa"), theirs)
    w0 = ours.query.weight.detach().clone()
    a, b, residual = svd_lora_factors(w0, 3, 2.0, absorb_scale=True)
    their_layer = theirs.query
    torch.testing.assert_close(residual, their_layer.base_layer.weight.detach(), atol=1e-5, rtol=1e-5)
    their_product = their_layer.lora_B["default"].weight @ their_layer.lora_A["default"].weight
    torch.testing.assert_close(b @ a, their_product.detach(), atol=1e-5, rtol=1e-5)


def _logits_before_after(raw: dict) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    cfg = build_config(raw)
    task, _ = load_data(cfg)
    backbone = load_backbone(cfg.model, task, cfg.seed)
    backbone.model.eval()
    batch = backbone.tokenizer([ex.texts[0] for ex in task.eval[:16]], padding=True, return_tensors="pt")
    with torch.no_grad():
        before = backbone.model(**batch).logits
        base = {n: p.detach().clone() for n, p in backbone.model.named_parameters()}
    build_adapter(cfg.adapter).apply(backbone)
    backbone.model.eval()
    with torch.no_grad():
        after = backbone.model(**batch).logits
    query = backbone.model.bert.encoder.layer[0].attention.self.query
    name = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.allclose(query.base_layer.weight, base[name])  # the frozen weight really is W0 - scale*BA
    assert query.lora_B["default"].weight.abs().sum() > 0  # B is not LoRA's zero init
    return before, after, backbone.model


def test_svd_init_keeps_logits_and_every_party_holds_the_same_residual(toy_files: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    raw = federa_raw(toy_files, tmp_path / "run")
    before, after, _ = _logits_before_after(raw)
    assert torch.max(torch.abs(before - after)) < 1e-5
    # two independent builds (a client and the server, on different thread counts) derive
    # bit-identical A, B and residual
    first = prepare(build_config(raw))
    torch.set_num_threads(2)
    second = prepare(build_config(raw))
    first_params = dict(first.backbone.model.named_parameters())
    for name, param in second.backbone.model.named_parameters():
        assert torch.equal(param, first_params[name]), name


def test_svd_init_rejects_bad_option(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = federa_raw(toy_files, tmp_path / "run", adapter={**SVD, "svd_absorb_scale": "sometimes"})
    with pytest.raises(ConfigError, match=r"adapter\.svd_absorb_scale"):
        prepare(build_config(raw))


def test_federa_recipe_defaults_follow_the_paper() -> None:
    cfg = build_config({"method": "federa", "task": {"name": "sst2"}})
    assert (cfg.adapter.init, cfg.adapter.r, cfg.adapter.lora_alpha, cfg.adapter.target_modules) == \
        ("svd", 32, 32.0, None)
    assert (cfg.partition.kind, cfg.partition.alpha, cfg.partition.num_clients) == ("dirichlet", 0.1, 100)
    assert cfg.clients_per_round() == 10


def test_federa_alpha_follows_r_unless_set(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """The paper's beta = r at any rank: r = 8 gives alpha 8 (scale 1), not the recipe's 32."""
    cfg = build_config({"method": "federa", "adapter": {"r": 8}})
    assert cfg.adapter.alpha is None and cfg.adapter.lora_alpha == 8.0
    assert build_config({"method": "federa", "adapter": {"r": 8, "alpha": 16}}).adapter.lora_alpha == 16.0
    # every other LoRA recipe keeps the alpha it names, whatever r
    for method, alpha in (("lora", 16.0), ("flasc", 16.0), ("hetlora", 16.0), ("headprune", 16.0),
                          ("ffa_lora", 16.0), ("rolora", 16.0), ("sparse_adapter", 16.0)):
        assert build_config({"method": method, "adapter": {"r": 2}}).adapter.lora_alpha == alpha, method
    # and the built model really has scale alpha / r = 1
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="federa", **TOY)
    raw["adapter"] = {"r": 2}  # nothing else: the recipe's kind, init and (unset) alpha
    layer = prepare(build_config(raw)).backbone.model.bert.encoder.layer[0].attention.self.query
    assert layer.r["default"] == 2 and layer.scaling["default"] == 1.0


def test_variation_eq_13_and_14_on_a_small_matrix() -> None:
    w1 = torch.tensor([[3.0, 0.0], [4.0, 1.0]])  # column norms 5, 1
    w2 = torch.tensor([[0.0, 0.0], [5.0, 2.0]])  # column norms 5, 2
    assert magnitude_variation(w1, w2) == pytest.approx((0.0 + 1.0) / 2)
    # column 1: cos((.6,.8),(0,1)) = .8; column 2: same direction
    assert direction_variation(w1, w2) == pytest.approx((0.2 + 0.0) / 2)
    assert direction_variation(w1, -w1) == pytest.approx(2.0)


def test_lora_variation_names_matrices_and_treats_zero_columns_as_full_turn() -> None:
    key_a = "m.layer.0.query.lora_A.default.weight"
    key_b = "m.layer.0.query.lora_B.default.weight"
    previous = {key_a: torch.ones(2, 3), key_b: torch.zeros(3, 2), "classifier.weight": torch.ones(2, 2)}
    current = {key_a: 2 * torch.ones(2, 3), key_b: torch.ones(3, 2), "classifier.weight": torch.zeros(2, 2)}
    metrics = lora_variation(previous, current)
    assert set(metrics["magnitude_variation"]) == {"m.layer.0.query.lora_A", "m.layer.0.query.lora_B"}
    assert metrics["magnitude_variation_A"] == pytest.approx(math.sqrt(2))  # norms sqrt2 -> 2 sqrt2
    assert metrics["direction_variation_A"] == pytest.approx(0.0)
    assert metrics["magnitude_variation_B"] == pytest.approx(math.sqrt(3))
    assert metrics["direction_variation_B"] == pytest.approx(1.0)  # B = 0 has no direction


def test_federa_learns_and_logs_variation_of_every_lora_matrix(toy_files: tuple[Path, Path],
                                                               tmp_path: Path) -> None:
    raw = federa_raw(toy_files, tmp_path / "run", rounds=8, client={"local_epochs": 2, "lr": 0.01})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    losses = [r["train_loss"] for r in records]
    assert sum(losses[-3:]) / 3 < 0.85 * losses[0], losses
    assert max(r["eval"]["accuracy"] for r in records[-3:]) >= 0.65  # chance is 0.5
    for record in records:
        method = record["method"]
        assert len(method["magnitude_variation"]) == 8  # 2 layers x (query, value) x (A, B)
        assert all(v >= 0 and math.isfinite(v) for v in method["direction_variation"].values())

    one = federa_raw(toy_files, tmp_path / "one", rounds=1)
    exp = prepare(build_config(one))
    initial = dict(exp.initial_state)
    engine = LocalEngine(exp, tmp_path / "one")
    logged = engine.run()[0]["method"]
    expected = lora_variation(initial, engine.final_state)
    for field in ("magnitude_variation", "direction_variation"):
        assert logged[field] == pytest.approx(expected[field], rel=1e-9)


@pytest.mark.real
@pytest.mark.skipif(not (SHARED_DATA / "glue" / "SST-2").is_dir(), reason="needs ../shared/data")
def test_svd_init_keeps_minilm_logits_at_paper_rank(tmp_path: Path) -> None:
    raw = {"method": "federa", "task": {"name": "sst2", "max_train_examples": 20, "max_eval_examples": 16,
                                        "max_length": 64},
           "partition": {"kind": "iid", "num_clients": 2}, "strategy": {"clients_per_round": 1},
           "model": {"name": "minilm"}, "output": {"run_dir": str(tmp_path / "run"), "progress": False}}
    before, after, model = _logits_before_after(raw)
    assert torch.max(torch.abs(before - after)) < 1e-5
    assert sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n) == 6 * 2 * 32 * (384 + 384)

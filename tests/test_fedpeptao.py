"""FedPepTAO: Eq. 2-4 scores, Hessian-vector products and Lanczos against a dense Hessian, Alg. 1's ratio
rules and layer choice, Alg. 2's server update by hand, partial exchange on the wire, resume, learning."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpeft.adapters import build_adapter
from fedpeft.adapters.prompts import prefix_layer_keys
from fedpeft.config import AdapterConfig, ConfigError, ModelConfig, build_config
from fedpeft.data.types import TaskData
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.methods.fedpeptao.algorithm import LAYER_SCORES_KEY, RATIO_PROBE_KEY, parse_options
from fedpeft.methods.fedpeptao.hessian import (
    RATIO_PROBE_FIELDS,
    Spectrum,
    density_ratio,
    eigengap_ratio,
    extreme_eigenvalues,
    flat,
    gap_ratio,
    hessian_vector_product,
    lanczos,
    prompt_spectrum,
    secant_lipschitz,
    spectrum_from_density,
)
from fedpeft.methods.fedpeptao.scoring import (
    aggregate_scores,
    batch_kernel_scores,
    layer_kernel_scores,
    select_layers,
)
from fedpeft.methods.fedpeptao.server import AdaptiveServer, AdaptiveServerOptions, ClientDelta
from fedpeft.metrics.recorder import CHECKPOINT, load_metrics
from fedpeft.sweep import load_sweep
from tests.conftest import tiny_raw_config
from tests.test_prompts import learnable_experiment, learning_config

EPS = 1e-5


def summand(lam: float) -> float:
    return math.log(lam + EPS) + 1.0 / (lam + EPS)


# ----- Eq. 2-4 ----------------------------------------------------------------------------------------
def hand_hidden_states() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Two layers, batch of two, two positions (the second of example 1 is padding), width 2."""
    garbage = [9.0, -7.0]
    layer0 = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[0.0, 1.0], garbage]])  # orthogonal examples
    layer1 = torch.tensor([[[2.0, 0.0], [0.0, 0.0]], [[3.0, 0.0], garbage]])  # parallel examples
    mask = torch.tensor([[1, 1], [1, 0]])
    return [layer0, layer1], mask


def test_batch_kernel_score_by_hand() -> None:
    hidden, mask = hand_hidden_states()
    scores = batch_kernel_scores(hidden, mask, EPS)
    # layer 0: kernel I -> eigenvalues 1, 1; layer 1: kernel [[1,1],[1,1]] -> eigenvalues 0, 2 (padding ignored)
    assert scores[0].item() == pytest.approx(2 * summand(1.0), rel=1e-6)
    assert scores[1].item() == pytest.approx(summand(0.0) + summand(2.0), rel=1e-6)
    assert scores[1] > scores[0]  # similar hidden states = harder to separate = more important


def test_layer_kernel_score_by_hand() -> None:
    hidden, mask = hand_hidden_states()
    scores = layer_kernel_scores(hidden, mask, EPS)
    # example 0: h0 = (1,0,0,0), h1 = (2,0,0,0) -> kernel [[1,1],[1,1]] -> eigenvalues (0, 2)
    # example 1: h0 = (0,1,0,0), h1 = (3,0,0,0) -> kernel I            -> eigenvalues (1, 1)
    assert scores[0].item() == pytest.approx((summand(0.0) + summand(1.0)) / 2, rel=1e-6)
    assert scores[1].item() == pytest.approx((summand(2.0) + summand(1.0)) / 2, rel=1e-6)


def test_global_scores_and_layer_choice() -> None:
    scores = aggregate_scores([torch.tensor([1.0, 4.0, 2.0]), torch.tensor([3.0, 0.0, 2.0])], [1, 3])
    assert torch.allclose(scores, torch.tensor([2.5, 1.0, 2.0]))  # Eq. 4: (1*a + 3*b) / 4
    sizes = [10, 10, 10]
    assert select_layers(scores, 0.3, sizes) == [0]
    assert select_layers(scores, 0.5, sizes) == [0, 2]  # 1/3 < 0.5 -> add the next best layer
    assert select_layers(scores, 1.0, sizes) == [0, 1, 2]
    assert select_layers(scores, 0.01, sizes, min_layers=2) == [0, 2]


# ----- Alg. 1: Hessian -----------------------------------------------------------------------------------
def tiny_prompt_model() -> tuple[torch.nn.Module, list[torch.nn.Parameter], dict[str, torch.Tensor]]:
    task = TaskData("toy", "classification", ("neg", "pos"), ("accuracy",))
    from fedpeft.models.backbone import load_backbone

    backbone = load_backbone(ModelConfig(name="tiny-bert", tiny_hidden_size=8, tiny_heads=2,
                                         attn_implementation="eager"), task, 0)
    torch.manual_seed(0)
    build_adapter(AdapterConfig(kind="p_tuning_v2", num_virtual_tokens=1, dropout=0.0)).apply(backbone)
    model = backbone.model.eval()
    params = [dict(model.named_parameters())[k] for k in prefix_layer_keys(model)]
    batch = {"input_ids": torch.randint(1000, 2000, (4, 5)), "attention_mask": torch.ones(4, 5, dtype=torch.long),
             "labels": torch.tensor([0, 1, 1, 0])}
    return model, params, batch


def dense_hessian(model: torch.nn.Module, params: list[torch.nn.Parameter], batch: dict) -> torch.Tensor:
    """The full (K x K) Hessian by forward-over-reverse autodiff of a function of the flat prompt vector."""
    names = prefix_layer_keys(model)
    shapes = [p.shape for p in params]
    sizes = [p.numel() for p in params]

    def loss_of(vector: torch.Tensor) -> torch.Tensor:
        pieces = dict(zip(names, (v.view(s) for v, s in zip(vector.split(sizes), shapes))))
        return torch.func.functional_call(model, pieces, kwargs=batch).loss

    return torch.func.hessian(loss_of)(flat([p.detach() for p in params])).detach()


@pytest.fixture(scope="module")
def tiny_hessian() -> tuple[torch.nn.Module, list[torch.nn.Parameter], dict, torch.Tensor]:
    model, params, batch = tiny_prompt_model()
    return model, params, batch, dense_hessian(model, params, batch)


def test_hessian_vector_product_equals_dense_hessian_times_v(tiny_hessian: tuple) -> None:
    model, params, batch, dense = tiny_hessian
    gradient, matvec = hessian_vector_product(model(**batch).loss, params)
    assert dense.shape == (32, 32)  # 2 layers x 1 token x (keys + values) x width 8
    vector = torch.randn(32, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(matvec(vector), dense @ vector, atol=1e-5)
    vectors = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))  # batched: one product per row
    assert torch.allclose(matvec(vectors), vectors @ dense, atol=1e-5)
    assert gradient.shape == (32,)


def test_lanczos_and_eigsh_recover_the_dense_spectrum(tiny_hessian: tuple) -> None:
    model, params, batch, dense = tiny_hessian
    exact = torch.linalg.eigvalsh(dense.double()).numpy()
    _, matvec = hessian_vector_product(model(**batch).loss, params)
    ritz, weights = lanczos(matvec, 32, 32, torch.Generator().manual_seed(0))
    assert weights.sum() == pytest.approx(1.0)
    scale = max(1.0, float(np.abs(exact).max()))
    # every Ritz value is an eigenvalue, and every distinct eigenvalue is found (Lanczos sees each once)
    assert np.abs(ritz[:, None] - exact[None, :]).min(axis=1).max() < 1e-4 * scale
    distinct = exact[np.concatenate([[True], np.diff(exact) > 1e-3 * scale])]
    assert np.abs(distinct[:, None] - ritz[None, :]).min(axis=1).max() < 1e-4 * scale
    assert ritz.min() == pytest.approx(exact.min(), abs=1e-4 * scale)
    assert ritz.max() == pytest.approx(exact.max(), abs=1e-4 * scale)
    top = extreme_eigenvalues(matvec, 32, k=3)
    assert np.allclose(top, exact[-3:], atol=1e-4 * scale)


def test_eigengap_ratio_is_algorithm_1_on_an_exact_spectrum() -> None:
    eigenvalues = np.array([0.0, 0.01, 0.02, 0.03, 0.5, 0.52, 3.0, 3.1])
    # 4L = 0.4: the first gap above it is 0.03 -> 0.5, after k = 4 eigenvalues: r = (8 - 4) / 8
    assert gap_ratio(eigenvalues, lipschitz=0.1) == pytest.approx(0.5)
    # 4L = 2: first gap above it is 0.52 -> 3.0 (k = 6): r = 2 / 8
    assert gap_ratio(eigenvalues[::-1], lipschitz=0.5) == pytest.approx(0.25)  # order does not matter
    assert gap_ratio(eigenvalues, lipschitz=10.0) == 1.0  # no split: keep everything
    # an SLQ density of K = 10: cells [-.5, .5], [.5, 3], [3, 7] hold 7, 2 and 1 eigenvalues
    nodes, mass = np.array([0.0, 1.0, 5.0]), np.array([0.7, 0.2, 0.1])
    spectrum = spectrum_from_density(nodes, mass, 10)
    assert np.allclose(spectrum, [*(-0.5 + (np.arange(7) + 0.5) / 7), 1.125, 2.375, 5.0])
    assert eigengap_ratio(nodes, mass, 0.5, dimension=10) == pytest.approx(0.1)  # the gap 2.375 -> 5 (k = 9)
    assert eigengap_ratio(nodes, mass, 0.05, dimension=10) == pytest.approx(0.3)  # .43 -> 1.125 (k = 7)
    # a bulk of 1000 eigenvalues behind 3 Ritz values has no gap wider than 4 L = 0.04 inside it
    assert eigengap_ratio(np.array([0.0, 0.1, 0.2, 3.0]), np.array([0.33, 0.33, 0.333, 0.007]), 0.01,
                          dimension=1000) == pytest.approx(0.007)


def synthetic_operator(eigenvalues: np.ndarray, seed: int = 0) -> tuple:
    """v -> Q diag(eigenvalues) Q^T v for a random orthogonal Q (float32 in and out, rows of a 2-D input
    each multiplied, like an HVP)."""
    size = len(eigenvalues)
    q, _ = torch.linalg.qr(torch.randn(size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    dense = (q * torch.from_numpy(eigenvalues)) @ q.T
    return lambda v: (v.to(torch.float64) @ dense).to(torch.float32)


@pytest.mark.parametrize(("name", "eigenvalues", "exact_ratio"), [
    ("no gap", np.linspace(0.0, 1.0, 300), 1.0),  # spacing 0.0033 < 4 L everywhere
    ("gap", np.concatenate([np.linspace(0.0, 0.3, 200), np.linspace(0.8, 1.0, 100)]), 1 / 3),
])
def test_lanczos_ratio_converges_to_the_exact_one(name: str, eigenvalues: np.ndarray, exact_ratio: float) -> None:
    lipschitz = 0.01
    assert gap_ratio(eigenvalues, lipschitz) == pytest.approx(exact_ratio)
    matvec = synthetic_operator(eigenvalues)

    def ratio_of(spectrum: Spectrum) -> float:
        return eigengap_ratio(spectrum.nodes, spectrum.weights, lipschitz, len(eigenvalues))

    exact = prompt_spectrum(matvec, 300, ratio_of, 300, 4, 300, 1, 0.01, seed=0)
    assert exact.exact and exact.converged and exact.steps == 300
    assert np.allclose(np.sort(exact.nodes), eigenvalues, atol=1e-5)
    # from 4 Lanczos steps, doubled until the ratio is stable; 4 steps alone put gaps into the gapless bulk
    products: list[int] = []

    def counted(vector: torch.Tensor) -> torch.Tensor:
        products.append(1)
        return matvec(vector)

    approx = prompt_spectrum(counted, 300, ratio_of, 0, 4, 256, 1, 0.01, seed=0)
    assert not approx.exact and approx.converged and approx.steps > 4
    assert len(products) == approx.steps  # each doubling extends the same run instead of restarting it
    assert ratio_of(approx) == pytest.approx(exact_ratio, abs=0.04), name
    if name == "no gap":
        assert ratio_of(approx) == 1.0  # no spurious gap


def test_exact_spectrum_of_a_real_prompt_hessian(tiny_hessian: tuple) -> None:
    model, params, batch, dense = tiny_hessian
    exact = torch.linalg.eigvalsh(dense.double()).numpy()
    _, matvec = hessian_vector_product(model(**batch).loss, params)
    lipschitz = float(np.diff(exact).max()) / 8  # 4 L sits below the widest gap: Alg. 1 finds a split
    expected = gap_ratio(exact, lipschitz)
    assert expected < 1.0

    def ratio_of(spectrum: Spectrum) -> float:
        if spectrum.exact:
            return gap_ratio(spectrum.nodes, lipschitz)
        return eigengap_ratio(spectrum.nodes, spectrum.weights, lipschitz, 32)

    built = prompt_spectrum(matvec, 32, ratio_of, 32, 8, 32, 1, 0.0, seed=0)
    scale = max(1.0, float(np.abs(exact).max()))
    assert built.exact and np.allclose(built.nodes, exact, atol=1e-4 * scale)
    assert ratio_of(built) == pytest.approx(expected)
    lanczos_path = prompt_spectrum(matvec, 32, ratio_of, 0, 8, 32, 1, 0.0, seed=0)
    assert lanczos_path.converged and not lanczos_path.exact
    assert ratio_of(lanczos_path) == pytest.approx(expected)
    assert lanczos_path.nodes.min() == pytest.approx(exact.min(), abs=1e-4 * scale)
    assert lanczos_path.nodes.max() == pytest.approx(exact.max(), abs=1e-4 * scale)


def test_secant_lipschitz_of_a_quadratic_is_zero_and_of_a_cubic_is_not() -> None:
    hessian = torch.tensor([[2.0, 0.0], [0.0, 4.0]])
    w, delta = torch.tensor([1.0, -1.0]), torch.tensor([0.5, 0.25])
    assert secant_lipschitz(hessian @ delta, hessian @ w, hessian @ (w + delta), delta) == pytest.approx(0.0)
    # F = sum x^4 / 4: grad = x^3, H = diag(3 x^2)
    lip = secant_lipschitz(3 * w**2 * delta, w**3, (w + delta) ** 3, delta)
    expected = torch.linalg.norm(3 * w**2 * delta - ((w + delta) ** 3 - w**3)) / torch.linalg.norm(delta)
    assert lip == pytest.approx(float(expected))


def test_density_ratio_follows_the_released_threshold_scan() -> None:
    # half the mass at 0, half at 5: from t = 0 the ratio drops to ~0.5 and stays there
    assert density_ratio(np.array([0.0, 5.0]), np.array([0.5, 0.5])) == pytest.approx(0.5, abs=0.01)
    assert density_ratio(np.array([4.0, 9.0]), np.array([0.5, 0.5])) == pytest.approx(1.0, abs=1e-3)
    assert density_ratio(np.array([-2.0, -1.0]), np.array([0.5, 0.5])) == pytest.approx(0.0, abs=1e-3)
    # mass just above 0: a step of 0.1 jumps past it (ratio below half its start), so the scan restarts
    # with ever smaller steps until it settles on the plateau before the mass
    assert density_ratio(np.array([0.01, 0.02]), np.array([0.5, 0.5])) > 0.95


# ----- Alg. 2 ---------------------------------------------------------------------------------------------
def options(**kw: object) -> AdaptiveServerOptions:
    base = {"beta": 0.5, "lr": 0.1, "local_lr": 0.5, "num_devices": 4}
    return AdaptiveServerOptions(**{**base, **kw})  # type: ignore[arg-type]


def reply(client: int, delta: float, n: int, steps: int) -> ClientDelta:
    return ClientDelta(client, {"w": torch.tensor([delta])}, n, steps)


def test_algorithm_2_server_update_by_hand_two_clients_two_rounds() -> None:
    server = AdaptiveServer(options())
    w1 = server.step(1, {"w": torch.tensor([1.0])}, [reply(0, 0.4, 1, 2), reply(1, -0.4, 3, 1)])
    # Dw = .25*.4 + .75*(-.4) = -.2; c0 = -.4/(2*.5) = -.4; c1 = .4/(1*.5) = .8
    # Dc = .25*(-.4) + .75*.8 = .5; cg = .5 * 2/4 = .25; g = 0 - (-.2) = .2
    # m0 = .5*.2 + .25 + .4 = .75; m1 = .1 + .25 - .8 = -.45; base = 1 - .2 = .8
    # w = .25*(.8 - .075) + .75*(.8 + .045) = .815; m = .25*.75 + .75*(-.45) = -.15
    assert w1["w"].item() == pytest.approx(0.815)
    assert server.momentum["w"].item() == pytest.approx(-0.15)
    assert server.global_control["w"].item() == pytest.approx(0.25)
    assert server.client_controls[0]["w"].item() == pytest.approx(-0.4)
    w2 = server.step(2, w1, [reply(1, 0.2, 3, 1), reply(2, -0.2, 1, 1)])
    # Dw = .75*.2 + .25*(-.2) = .1; c1 = .8 - .25 - .2/.5 = .15; c2 = 0 - .25 + .2/.5 = .15
    # Dc = .75*(.15-.8) + .25*.15 = -.45; cg = .25 - .45*.5 = .025; g = -.2 - .1 = -.3
    # m_i = .5*(-.15) + .5*(-.3) + .025 - .15 = -.35; base = .815 + .1 = .915; w = .915 + .1*.35 = .95
    assert server.global_control["w"].item() == pytest.approx(0.025)
    assert server.client_controls[1]["w"].item() == pytest.approx(0.15)
    assert server.client_controls[0]["w"].item() == pytest.approx(-0.4)  # not sampled: unchanged
    assert server.momentum["w"].item() == pytest.approx(-0.35)
    assert w2["w"].item() == pytest.approx(0.95)


def test_algorithm_2_variants() -> None:
    start = {"w": torch.tensor([1.0]), "frozen": torch.tensor([7.0])}
    literal = AdaptiveServer(options(control_variates=False, base="previous"))
    # line 22 as printed: w = w^{r-1} - eta m with m = (1-beta) g, g = 0 - (-.2): 1 - .1 * .1
    assert literal.step(1, start, [reply(0, 0.4, 1, 2), reply(1, -0.4, 3, 1)])["w"].item() == pytest.approx(0.99)
    released = AdaptiveServer(options(variant="released", lr=0.05, lr_decay=0.99, lr_min=1e-4, beta=0.9))
    first = released.step(1, start, [reply(0, 0.4, 1, 2), reply(1, -0.4, 3, 1)])
    assert first["w"].item() == pytest.approx(0.8)  # round 1: plain average, Delta recorded
    assert first["frozen"].item() == 7.0  # keys nobody sent stay
    second = released.step(2, first, [reply(0, 0.2, 1, 1)])
    # Delta_1 = .2, Delta_2 = -.2 (released sign), g = .2 - (-.2) = .4; c0: -.4 -> -.4 - .25 - .2/.5 = -1.05
    # cg: .25 + (-.65) * 1/4 = .0875; v = .9*0 + .1*.4 + .0875 + 1.05 = 1.1775; eta = .05*.99
    expected = 0.8 + 0.2 - 0.05 * 0.99 * 1.1775
    assert second["w"].item() == pytest.approx(expected)


def test_server_state_round_trips_through_a_checkpoint() -> None:
    server = AdaptiveServer(options())
    server.step(1, {"w": torch.tensor([1.0])}, [reply(0, 0.4, 1, 2), reply(1, -0.4, 3, 1)])
    copy = AdaptiveServer(options())
    copy.load_state_dict(server.state_dict())
    a = server.step(2, {"w": torch.tensor([0.5])}, [reply(1, 0.1, 2, 1)])
    b = copy.step(2, {"w": torch.tensor([0.5])}, [reply(1, 0.1, 2, 1)])
    assert torch.equal(a["w"], b["w"])


# ----- end to end -----------------------------------------------------------------------------------------
def fedpeptao_raw(train: Path, eval_: Path, run_dir: Path, rounds: int, **strategy: object) -> dict:
    raw = tiny_raw_config(train, eval_, run_dir, method="fedpeptao", rounds=rounds,
                          model={"tiny_layers": 3}, task={"max_train_examples": 48, "max_eval_examples": 16})
    raw["adapter"] = {"kind": "p_tuning_v2", "num_virtual_tokens": 2}
    raw["client"] = {"optimizer": "adam", "lr": 0.01, "batch_size": 8, "local_epochs": 1}
    raw["strategy"] = {"name": "fedavg", "clients_per_round": 2, "selection_round": 1, "lanczos_iterations": 8,
                       "score_batch_size": 4, "hessian_batch_size": 4, **strategy}
    return raw


def test_only_selected_layers_cross_the_wire_after_selection(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    exp = prepare(build_config(fedpeptao_raw(train, eval_, tmp_path / "run", 4, fixed_ratio=0.3,
                                             personalized_eval=True)))
    engine = LocalEngine(exp, tmp_path / "run")
    records = engine.run()
    algorithm = exp.algorithm
    layers = prefix_layer_keys(exp.backbone.model)
    head = ["classifier.bias", "classifier.weight"]
    assert algorithm.selected is not None and len(algorithm.selected) == 1  # 0.3 of 3 equal layers -> 1
    chosen = [layers[i] for i in algorithm.selected]
    state = engine.final_state
    full = len(exp.up_codec.encode({k: state[k] for k in [*layers, *head]}))
    partial = len(exp.up_codec.encode({k: state[k] for k in [*chosen, *head]}))
    # round t: everything, with the layer scores inside the message (the ratio is fixed here: no probe)
    scored = len(exp.up_codec.encode({**{k: state[k] for k in [*layers, *head]}, LAYER_SCORES_KEY: torch.zeros(3)}))
    assert records[0]["bytes_up"] == [scored, scored] and scored > full
    seen = set(records[0]["clients"])
    for record in records[1:]:
        assert record["bytes_up"] == [partial, partial]
        expected_down = [full if c not in seen else partial for c in record["clients"]]
        assert record["bytes_down"] == expected_down  # a newcomer gets its full prompt once
        seen |= set(record["clients"])
        assert record["method"]["exchanged_layers"] == algorithm.selected
    assert partial < full
    # personalised evaluation: every sampled device that already held a prompt, beside the global eval
    joined: set[int] = set()
    for record in records:
        returning = sorted(str(c) for c in record["clients"] if c in joined)
        assert sorted(record["method"].get("personalized_eval", {})) == returning
        if returning:
            accuracies = [m["accuracy"] for m in record["method"]["personalized_eval"].values()]
            assert record["method"]["personalized_mean"]["accuracy"] == pytest.approx(np.mean(accuracies))
        joined |= set(record["clients"])
    assert any("personalized_eval" in r["method"] for r in records)
    # layers that are not exchanged stay on the devices and differ between them
    left = next(k for k in layers if k not in chosen)
    owners = [c for c in algorithm.client_prompts if c in seen]
    assert not torch.equal(algorithm.client_prompts[owners[0]][left], algorithm.client_prompts[owners[1]][left])


def test_hessian_probe_selects_layers_and_resume_is_bit_identical(toy_files: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    train, eval_ = toy_files
    full_engine = LocalEngine(prepare(build_config(fedpeptao_raw(train, eval_, tmp_path / "full", 4))),
                              tmp_path / "full")
    full_records = full_engine.run()
    first = full_records[0]["method"]
    assert "ratio" in first and 0.0 < first["ratio"] <= 1.0
    assert len(first["global_scores"]) == 3 and first["selected_layers"]
    exp = full_engine.exp  # round t's replies carry the layer scores and the ratio probe inside the message
    sent = {**exp.initial_state, LAYER_SCORES_KEY: torch.zeros(3), RATIO_PROBE_KEY: torch.zeros(7)}
    assert full_records[0]["bytes_up"] == [len(exp.up_codec.encode(sent))] * 2
    # the selection round records every client's Hessian test: a reader can redo Alg. 1's arithmetic
    probes = first["ratio_probes"]
    assert [p["client"] for p in probes] == full_records[0]["clients"]
    assert set(RATIO_PROBE_FIELDS) <= set(probes[0])
    assert all(p["exact"] == 1.0 and p["converged"] == 1.0 for p in probes)  # 384 prompt parameters: eigvalsh
    assert first["lambda_min"] == min(p["lambda_min"] for p in probes) <= first["lambda_max"]
    weights = full_records[0]["num_samples"]
    assert first["ratio"] == pytest.approx(sum(p["ratio"] * n for p, n in zip(probes, weights)) / sum(weights))
    assert "ratio_probes" not in full_records[1]["method"]

    # a run that stops after round 2's checkpoint *and* after round 3 wrote its clients' files (but
    # before round 3's checkpoint) resumes from round 2 reading exactly round 2's files
    part_dir = tmp_path / "part"
    part = fedpeptao_raw(train, eval_, part_dir, 2)
    LocalEngine(prepare(build_config(part)), part_dir).run()
    round_two = (part_dir / CHECKPOINT).read_bytes()
    part["rounds"] = 3
    LocalEngine(prepare(build_config(part)), part_dir).run(resume=True)
    (part_dir / CHECKPOINT).write_bytes(round_two)  # round 3's checkpoint never happened
    part["rounds"] = 4
    resumed_engine = LocalEngine(prepare(build_config(part)), part_dir)
    resumed_engine.run(resume=True)

    def strip(records: list[dict]) -> list[dict]:
        volatile = ("time", "cum_wall_seconds", "client_seconds")
        return [{k: v for k, v in r.items() if k not in volatile} for r in records]

    assert strip(load_metrics(part_dir)) == strip(full_records)
    for key, value in full_engine.final_state.items():
        assert torch.equal(value, resumed_engine.final_state[key]), key
    full_algorithm, resumed = full_engine.exp.algorithm, resumed_engine.exp.algorithm
    assert list(full_algorithm.client_prompts) == list(resumed.client_prompts)
    for client, prompts in full_algorithm.client_prompts.items():
        for key, value in prompts.items():
            assert torch.equal(value, resumed.client_prompts[client][key])
    for client, controls in full_algorithm.server.client_controls.items():
        for key, value in controls.items():
            assert torch.equal(value, resumed.server.client_controls[client][key])
    # per-client state lives in files per client (the current version and the last checkpoint's), not in
    # the checkpoint
    prompt_files = [p.name for p in (part_dir / "client_state" / "prompts").iterdir()]
    assert {name.split(".")[0] for name in prompt_files} == {str(c) for c in resumed.client_prompts}
    assert len(prompt_files) <= 2 * len(resumed.client_prompts)
    saved = torch.load(part_dir / CHECKPOINT, weights_only=False)["algorithm"]["fedpeptao"]
    assert set(saved["client_prompts"]) == {"index"}
    assert set(saved["server"]["client_controls"]) == {"index"}


def test_bad_fedpeptao_config_names_the_field(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    with pytest.raises(ConfigError, match=r"strategy\.score_kernel"):
        prepare(build_config(fedpeptao_raw(train, eval_, tmp_path / "a", 2, score_kernel="rows")))
    raw = fedpeptao_raw(train, eval_, tmp_path / "b", 2)
    raw["adapter"] = {"kind": "lora"}
    with pytest.raises(ConfigError, match=r"adapter\.kind"):
        prepare(build_config(raw))


def test_fedpeptao_learns_the_toy_task(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = learning_config(train, eval_, tmp_path / "run", "fedpeptao")
    raw["client"]["optimizer"] = "adam"
    raw["strategy"].update(selection_round=2, lanczos_iterations=8, score_batch_size=4, hessian_batch_size=4,
                           exact_max_dimension=0)  # the Lanczos path (the probe test above takes the exact one)
    records = learnable_experiment(raw).run()
    accuracies = [r["eval"]["accuracy"] for r in records]
    assert records[-1]["train_loss"] < 0.6 * records[0]["train_loss"]
    assert accuracies[-1] >= 0.75, accuracies
    assert records[-1]["method"]["selected_layers"]


def test_fedpeptao_benchmark_file_validates() -> None:
    """benchmarks/fedpeptao.yaml expands, every FedPepTAO-algorithm run's options validate, and the server
    lr is tuned on the same budget as the client lr."""
    sweep = load_sweep(Path(__file__).resolve().parents[1] / "benchmarks" / "fedpeptao.yaml")
    assert sweep.is_benchmark and len(sweep.spec.seeds) >= 3
    assert sweep.spec.tune is not None and set(sweep.spec.tune.space or {}) == {"client.lr", "strategy.server_lr"}
    for run in sweep.runs:
        cfg = build_config(run.raw)
        if cfg.method in ("fedpeptao", "moms_adamd"):
            parse_options(cfg)
    prompt_lengths = {build_config(r.raw).adapter.num_virtual_tokens for r in sweep.runs if r.method.startswith("ptv2")}
    assert prompt_lengths == {20, 128}
    assert {c.id for c in sweep.spec.claims} >= {"accuracy", "bytes", "time"}

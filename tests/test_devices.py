"""engine.device / engine.precision / model.dtype / model.quantization: validation, placement, the
whole path on the CPU in bf16 autocast, and the same checks on CUDA/MPS when present."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from rich.console import Console
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import fedpeft.federated.client as client_module
from fedpeft.config import ConfigError, EngineConfig, build_config
from fedpeft.devices import Placement, resolve_device
from fedpeft.engines.flower import prepared
from fedpeft.engines.local import LocalEngine, run_client
from fedpeft.experiment import Experiment, prepare
from fedpeft.federated.types import ClientTask
from fedpeft.metrics.recorder import load_metrics, resume_fingerprint
from tests.conftest import tiny_raw_config, without_timing
from tests.test_flower import (
    assert_same_weights,
    local_reference,
    run_in_process,
    server_identity,  # noqa: F401  (the fixture the in-process ClientApps need)
)
from tests.test_generation import generation_raw
from tests.test_torchrun import headprune_raw, run_two_ranks

pytestmark = pytest.mark.usefixtures("single_torch_thread")

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU: torch.cuda.is_available() is False")])
MPS = pytest.param("mps", marks=[pytest.mark.mps, pytest.mark.skipif(
    not torch.backends.mps.is_available(), reason="no Apple MPS: torch.backends.mps.is_available() is False")])
SMALL = {"max_train_examples": 32, "max_eval_examples": 16}


def small_raw(toy_files: tuple[Path, Path], run_dir: Path, **sections: Any) -> dict[str, Any]:
    task = {**SMALL, **sections.pop("task", {})}
    return tiny_raw_config(*toy_files, run_dir, rounds=1, task=task, **sections)


def config_error(raw: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        build_config(raw)
    assert "\n" not in str(caught.value)  # one line
    return caught.value


# ----- validation, before anything is built --------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot happen")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_refused_naming_the_field(tmp_path: Path, device: str) -> None:
    err = config_error({"engine": {"device": device}})
    assert err.field == "engine.device" and "CUDA" in str(err)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS: the refusal cannot happen")
def test_mps_without_mps_is_refused() -> None:
    assert config_error({"engine": {"device": "mps"}}).field == "engine.device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot happen")
def test_a_saved_gpu_run_reads_back_on_a_cpu_only_machine(tmp_path: Path) -> None:
    """A run's config.yaml records where it ran; exporting, comparing or resuming it on a machine without
    that GPU must not refuse it, while a config to run here still is."""
    from fedpeft.export import read_config
    from fedpeft.metrics.recorder import resume_differences, saved_config

    ran = build_config({"engine": {"device": "cpu", "precision": "bf16"}, "model": {"dtype": "bf16"}}).model_dump(
        mode="json")
    ran["engine"]["device"] = "cuda"  # what a GPU run's config.yaml holds
    assert config_error(dict(ran)).field == "engine.device"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(ran))
    saved = read_config(tmp_path)
    assert saved.engine.device == "cuda" and saved.engine.precision == "bf16" and saved.model.dtype == "bf16"
    given = build_config({"engine": {"device": "cpu", "precision": "bf16"}, "model": {"dtype": "bf16"}})
    assert resume_differences(saved_config(yaml.safe_load(yaml.safe_dump(ran))), given) == []


def test_unknown_device_names_the_allowed_ones() -> None:
    err = config_error({"engine": {"device": "tpu"}})
    assert err.field == "engine.device" and "cuda:N" in str(err)


def test_precision_and_dtype_refusals() -> None:
    if resolve_device("auto").type == "cpu":
        assert config_error({"engine": {"precision": "fp16"}}).field == "engine.precision"
    assert config_error({"model": {"dtype": "bf16"}}).field == "model.dtype"  # fp32 autocast: dtypes would clash
    assert config_error({"engine": {"precision": "bf16"}, "client": {"dp": {"epsilon": 3}}}).field == "engine.precision"
    err = config_error({"engine": {"gradient_checkpointing": True}, "client": {"dp": {"epsilon": 3}}})
    assert err.field == "engine.gradient_checkpointing"
    build_config({"engine": {"precision": "bf16"}, "model": {"dtype": "bf16"}})  # the matching pair is fine


@pytest.mark.parametrize(("raw", "says"), [
    ({"method": "full"}, "full-precision"),
    ({"method": "bitfit"}, "full-precision"),
    ({"method": "fedtt"}, "full-precision"),
    ({"method": "federa"}, "svd"),
    ({"method": "headprune"}, "head pruning"),
    ({"method": "lora", "model": {"name": "tiny-llama"}}, "built in code"),
])
def test_quantization_refused_where_the_method_needs_full_precision_weights(raw: dict[str, Any], says: str) -> None:
    raw = {**raw, "model": {"name": "minilm", **raw.get("model", {}), "quantization": "4bit"}}
    err = config_error(raw)
    assert err.field == "model.quantization" and says in str(err)


def test_quantization_needs_bitsandbytes_then_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = {"method": "lora", "model": {"name": "minilm", "quantization": "4bit"}}
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a))
    err = config_error(raw)
    assert err.field == "model.quantization" and "pip install 'fedpeft[quant]'" in str(err)
    if torch.cuda.is_available():
        return
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "bitsandbytes" else real_find_spec(name, *a))
    err = config_error({**raw, "adapter": {"kind": "ffa_lora"}, "method": "ffa_lora"})
    assert err.field == "model.quantization" and "CUDA GPU" in str(err)


def test_device_precision_and_checkpointing_leave_the_resume_fingerprint() -> None:
    """A run resumes on another device; precision changes what is computed, so it stays in."""
    base = build_config({})
    moved = build_config({"engine": {"device": "cpu", "gradient_checkpointing": True, "deterministic": True}})
    assert resume_fingerprint(base) == resume_fingerprint(moved)
    assert resume_fingerprint(base) != resume_fingerprint(build_config({"engine": {"precision": "bf16"}}))


# ----- defaults: nothing changes ------------------------------------------------------------------------
def test_explicit_cpu_fp32_is_bit_identical_to_the_defaults(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    def run(name: str, **sections: Any) -> tuple[LocalEngine, list[dict[str, Any]]]:
        raw = small_raw(toy_files, tmp_path / name, **sections)
        raw["rounds"] = 2
        engine = LocalEngine(prepare(build_config(raw)), tmp_path / name, Console(quiet=True))
        engine.run()
        return engine, load_metrics(tmp_path / name)

    default, default_records = run("default")
    explicit, explicit_records = run("explicit", engine={"device": "cpu", "precision": "fp32", "deterministic": True},
                                     model={"name": "tiny-bert", "dtype": "fp32", "quantization": "none"})
    for key, value in default.final_state.items():
        assert torch.equal(explicit.final_state[key], value), key
    assert without_timing(default_records) == without_timing(explicit_records)


# ----- placement ----------------------------------------------------------------------------------------
@contextmanager
def recorded_calls() -> Iterator[list[tuple[str, set[torch.device]]]]:
    """Every torch function and tensor method called inside, with the devices of its tensor arguments."""
    calls: list[tuple[str, set[torch.device]]] = []

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            leaves, _ = tree_flatten((args, kwargs or {}))
            calls.append((getattr(func, "__name__", str(func)),
                          {leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)}))
            return func(*args, **(kwargs or {}))

    with Recorder():
        yield calls


TRANSFERS = {"copy_", "to", "cpu", "__get__"}
"""Calls that move a tensor between the server's CPU and the device on purpose (state in, update out)."""


def placement_problems(exp: Experiment, device: torch.device, monkeypatch: pytest.MonkeyPatch
                       ) -> tuple[list[str], bool]:
    """Everything a client's step touches that is not on ``device``: the model's parameters and buffers
    after prepare, then one client step's batches, optimizer state and every torch call that mixes devices;
    and whether the step got as far as an optimizer step (the check saw a real step)."""
    problems = [f"parameter {n} on {p.device}" for n, p in exp.slot.model.named_parameters() if p.device != device]
    problems += [f"buffer {n} on {b.device}" for n, b in exp.slot.model.named_buffers() if b.device != device]
    optimizers: list[torch.optim.Optimizer] = []
    batches: list[dict[str, torch.Tensor]] = []
    build, batch_of = client_module.build_optimizer, client_module.training_batch
    monkeypatch.setattr(client_module, "build_optimizer", lambda *a, **k: optimizers.append(build(*a, **k))
                        or optimizers[-1])
    monkeypatch.setattr(client_module, "training_batch", lambda *a: batches.append(batch_of(*a)) or batches[-1])
    task = ClientTask(client_id=0, payload=dict(exp.initial_state))
    with recorded_calls() as calls:
        try:
            run_client(exp, task, round_idx=1, count_flops=False)
        except RuntimeError as err:  # a device clash makes the client fail: report it with what was seen
            problems.append(f"client failed: {err}")
    problems += [f"batch {k} on {v.device}" for batch in batches for k, v in batch.items() if v.device != device]
    problems += [f"optimizer state {k} on {v.device}" for opt in optimizers for state in opt.state.values()
                 for k, v in state.items() if isinstance(v, torch.Tensor) and v.device != device and v.dim() > 0]
    problems += [f"{name} mixes {sorted(map(str, devices))}" for name, devices in calls
                 if len(devices) > 1 and name not in TRANSFERS]
    return problems, bool(batches and optimizers and any(opt.state for opt in optimizers))


@pytest.mark.parametrize("device", ["cpu", CUDA, MPS])
def test_everything_a_client_uses_is_on_the_configured_device(toy_files: tuple[Path, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    exp = prepare(build_config(small_raw(toy_files, tmp_path / "run", engine={"device": device})))
    assert placement_problems(exp, resolve_device(device), monkeypatch) == ([], True)
    assert all(v.device.type == "cpu" for v in exp.initial_state.values())  # the server's side stays on the CPU
    assert all(v.device.type == "cpu" for v in exp.slot.read().values())


def test_the_placement_check_sees_a_buffer_left_elsewhere(toy_files: tuple[Path, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    exp = prepare(build_config(small_raw(toy_files, tmp_path / "run", engine={"device": "cpu"})))
    embeddings = exp.slot.model.bert.embeddings
    name = next(iter(dict(embeddings.named_buffers())))
    embeddings._buffers[name] = embeddings._buffers[name].to("meta")
    problems, _ = placement_problems(exp, torch.device("cpu"), monkeypatch)
    assert f"buffer bert.embeddings.{name} on meta" in problems


def test_the_placement_check_sees_a_stray_tensor_in_the_step(toy_files: tuple[Path, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that mixes in a tensor from another device (here 'meta') is caught by the call recorder."""
    exp = prepare(build_config(small_raw(toy_files, tmp_path / "run", engine={"device": "cpu"})))
    stray = torch.zeros((), device="meta")
    exp.slot.model.classifier.register_forward_hook(lambda module, args, output: output + stray)
    problems, _ = placement_problems(exp, torch.device("cpu"), monkeypatch)
    assert any("mixes" in p and "meta" in p for p in problems)


# ----- precision: the whole path in bf16 autocast on the CPU ----------------------------------------------
FAMILIES = {
    "lora": {},
    "fedtt": {"adapter": {"kind": "tt", "bottleneck_size": 8, "tt_rank": 3, "tt_max_mode": 4}},
    "prompt_tuning": {"adapter": {"kind": "prompt_tuning", "num_virtual_tokens": 2}},
    "full": {"adapter": {"kind": "full"}},
    "headprune": {"adapter": {"r": 4}},
    "fedpeptao": {"adapter": {"kind": "p_tuning_v2", "num_virtual_tokens": 2}, "model": {"tiny_layers": 3},
                  "strategy": {"clients_per_round": 2, "selection_round": 1, "lanczos_iterations": 4,
                               "score_batch_size": 4, "hessian_batch_size": 4}},
}


@pytest.mark.parametrize("method", list(FAMILIES))
def test_every_adapter_family_trains_and_evaluates_in_bf16_autocast(toy_files: tuple[Path, Path], tmp_path: Path,
                                                                   method: str) -> None:
    sections = dict(FAMILIES[method])
    raw = small_raw(toy_files, tmp_path / "run", method=method, engine={"device": "cpu", "precision": "bf16"},
                    **sections)
    raw["rounds"] = 2 if method == "fedpeptao" else 1  # FedPepTAO probes its Hessian in round 1, selects after
    exp = prepare(build_config(raw))
    engine = LocalEngine(exp, tmp_path / "run", Console(quiet=True))
    records = engine.run()
    assert all(r["train_loss"] == r["train_loss"] for r in records)  # not NaN
    assert records[-1]["eval"] and records[-1]["client_flops_per_step"] > 0
    if method == "fedpeptao":  # the Hessian-vector products (Lanczos) ran under autocast
        assert 0 < records[0]["method"]["ratio"] <= 1
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in engine.final_state.values())
    batch = client_module.training_batch(exp.train_data, [0, 1])
    with torch.no_grad():
        assert exp.slot.model(**batch).logits.dtype == torch.bfloat16  # autocast really ran the forward


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_text_generation_trains_and_decodes_in_bf16_autocast(tmp_path: Path, arch: str) -> None:
    """Decoder and encoder-decoder: training, and evaluation through ``generate`` (the autocast forward)."""
    raw = generation_raw(tmp_path, arch, rounds=1, task={"max_train_examples": 32}, evaluation={"max_new_tokens": 4})
    raw["engine"] = {"precision": "bf16"}
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run", Console(quiet=True)).run()
    assert records[-1]["train_loss"] == records[-1]["train_loss"] and "rougeL" in records[-1]["eval"]


def test_bf16_backbone_keeps_trainable_parameters_fp32(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = small_raw(toy_files, tmp_path / "run", engine={"precision": "bf16", "gradient_checkpointing": True},
                    model={"name": "tiny-bert", "dtype": "bf16"})
    exp = prepare(build_config(raw))
    dtypes = {n: p.dtype for n, p in exp.slot.model.named_parameters()}
    assert {dtypes[n] for n in exp.slot.trainable} == {torch.float32}
    assert {d for n, d in dtypes.items() if n not in exp.slot.trainable} == {torch.bfloat16}
    assert exp.slot.model.bert.encoder.layer[0].gradient_checkpointing
    run = run_client(exp, ClientTask(client_id=0, payload=dict(exp.initial_state)), 1, False)
    assert all(v.dtype == torch.float32 and v.abs().sum() > 0 for k, v in run.result.update.items() if "lora_B" in k)


def test_fp16_gradient_scaler_steps_on_the_true_gradient(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """The fp16 path's loss scaling (a power of two) is undone exactly before clipping and stepping, so
    with fp32 compute it reproduces the plain step bit for bit (fp16 itself is refused on a CPU)."""
    exp = prepare(build_config(small_raw(toy_files, tmp_path / "run", client={"grad_clip": 0.5})))
    task = ClientTask(client_id=0, payload=dict(exp.initial_state))
    plain = run_client(exp, task, 1, False).result.update
    exp.slot.placement = Placement(torch.device("cpu"), "fp16")
    assert exp.slot.placement.grad_scaler() is not None
    scaled = run_client(exp, task, 1, False).result.update
    assert all(torch.equal(scaled[k], plain[k]) for k in plain) and any(v.abs().sum() > 0 for v in plain.values())


@pytest.mark.usefixtures("server_identity")
def test_flower_apps_in_bf16_match_the_local_engine_in_bf16(toy_files: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    """The Flower transport (the real ClientApp handlers in process, as in tests/test_flower.py), bf16 on each node."""
    raw = small_raw(toy_files, tmp_path / "flower", engine={"precision": "bf16"})
    raw["rounds"] = 2
    engine, _ = run_in_process(raw, tmp_path / "flower")
    local = local_reference(raw, tmp_path / "local")
    assert_same_weights(engine.final_state, local.final_state)
    assert without_timing(load_metrics(tmp_path / "flower")) == without_timing(load_metrics(tmp_path / "local"))


@pytest.mark.slow
def test_torchrun_ranks_in_bf16_match_the_local_engine_in_bf16(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """tests/test_torchrun.py's two gloo ranks (head pruning: importance hooks, sliced heads) under bf16 autocast."""
    raw = headprune_raw(toy_files, tmp_path / "torchrun", "torchrun")
    raw["engine"]["precision"] = "bf16"
    run_two_ranks(raw, tmp_path / "exp.yaml")
    local_raw = headprune_raw(toy_files, tmp_path / "local", "local")
    local_raw["engine"]["precision"] = "bf16"
    local = local_reference(local_raw, tmp_path / "local")
    assert_same_weights(torch.load(tmp_path / "torchrun" / "checkpoint.pt", weights_only=True)["global_state"],
                        local.final_state)
    assert without_timing(load_metrics(tmp_path / "torchrun")) == without_timing(load_metrics(tmp_path / "local"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the node's cuda would be accepted")
def test_a_flower_node_config_names_the_nodes_own_device(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    yaml_text = build_config(small_raw(toy_files, tmp_path / "run")).to_yaml()
    try:
        with pytest.raises(ConfigError, match=r"engine\.device"):
            prepared(yaml_text, None, "cuda")
        assert prepared(yaml_text, None, "cpu").slot.device == torch.device("cpu")
    finally:
        prepared.cache_clear()


def test_half_precision_on_cuda_keeps_attention_off_cudnn_unless_asked() -> None:
    """In bf16 on CUDA the autocast context turns cuDNN's fused attention off for its duration only;
    ``engine.cudnn_attention`` leaves the choice to PyTorch; the CPU and fp32 are never touched. (The
    flags are global switches that a CPU-only torch has too; its CUDA autocast only warns and disables.)"""
    cudnn = torch.backends.cuda.cudnn_sdp_enabled
    assert cudnn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Placement(torch.device("cuda"), "bf16").autocast():
            assert not cudnn()
            assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
            assert torch.backends.cuda.math_sdp_enabled()
        assert cudnn()
        with Placement(torch.device("cuda"), "fp16", cudnn_attention=True).autocast():
            assert cudnn()
    for placement in (Placement(torch.device("cpu"), "bf16"), Placement(torch.device("cuda"), "fp32")):
        with placement.autocast():
            assert cudnn()
    assert Placement.from_config(EngineConfig(device="cpu", cudnn_attention=True)).cudnn_attention
    assert not Placement.from_config(EngineConfig(device="cpu")).cudnn_attention


def test_checkpointed_recompute_keeps_attention_off_cudnn_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradient checkpointing recomputes each layer's forward in backward, outside the autocast
    wrapper; torch restores autocast there but not the attention switches, so a CUDA bf16 placement
    enters them again around every recompute (checked on the CPU: the switches are global flags)."""
    from transformers import BertConfig, BertForSequenceClassification

    from fedpeft.devices import enable_gradient_checkpointing

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, attn_implementation="sdpa")
    seen: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    for placement, recomputed in ((Placement(torch.device("cuda"), "bf16"), [False, False]),
                                  (Placement(torch.device("cuda"), "bf16", cudnn_attention=True), [True, True]),
                                  (Placement(torch.device("cpu"), "bf16"), [True, True])):
        torch.manual_seed(0)
        model = BertForSequenceClassification(config).train()
        enable_gradient_checkpointing(model, placement)
        seen.clear()
        model(torch.randint(0, 50, (2, 5)), labels=torch.tensor([0, 1])).loss.backward()
        assert seen == [True, True, *recomputed], placement  # the forward, then backward's recompute
    assert torch.backends.cuda.cudnn_sdp_enabled()


# ----- the real GPU paths (skipped with a message on machines without them) ---------------------------------
@pytest.mark.parametrize("device", [CUDA, MPS])
def test_bf16_lora_rounds_on_the_accelerator(toy_files: tuple[Path, Path], tmp_path: Path, device: str) -> None:
    raw = small_raw(toy_files, tmp_path / "run", engine={"device": device, "precision": "bf16"},
                    model={"name": "tiny-bert", "dtype": "bf16"})
    raw["rounds"] = 2
    engine = LocalEngine(prepare(build_config(raw)), tmp_path / "run", Console(quiet=True))
    records = engine.run()
    assert all(r["train_loss"] == r["train_loss"] for r in records)
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in engine.final_state.values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: torch.cuda.is_available() is False")
def test_bf16_attention_on_cuda_runs_without_cudnn(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """The bf16 rounds' attention runs, and not on cuDNN's fused kernel (Placement.autocast says why)."""
    raw = small_raw(toy_files, tmp_path / "run", engine={"device": "cuda", "precision": "bf16"})
    engine = LocalEngine(prepare(build_config(raw)), tmp_path / "run", Console(quiet=True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine.run()
    ops = {event.key for event in profile.key_averages()}
    assert "aten::scaled_dot_product_attention" in ops
    assert not [op for op in ops if "cudnn_attention" in op]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None,
                    reason="4-bit backbones need a CUDA GPU and bitsandbytes (pip install 'fedpeft[quant]')")
def test_4bit_minilm_lora_round_on_cuda(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = small_raw(toy_files, tmp_path / "run", model={"name": "minilm", "quantization": "4bit"},
                    engine={"device": "cuda", "precision": "bf16"})
    exp = prepare(build_config(raw))
    assert any(type(p).__name__ == "Params4bit" for p in exp.slot.model.parameters())
    assert {exp.slot.params[n].dtype for n in exp.slot.trainable} == {torch.float32}
    records = LocalEngine(exp, tmp_path / "run", Console(quiet=True)).run()
    assert records[-1]["train_loss"] == records[-1]["train_loss"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: torch.cuda.is_available() is False")
def test_a_run_checkpointed_on_cuda_resumes_on_the_cpu(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = small_raw(toy_files, tmp_path / "run", engine={"device": "cuda", "deterministic": True})
    try:
        LocalEngine(prepare(build_config(raw)), tmp_path / "run", Console(quiet=True)).run()
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert all(v.device.type == "cpu" for v in saved["global_state"].values())
    raw.update(rounds=2, engine={"device": "cpu"})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run", Console(quiet=True)).run(resume=True)
    assert [r["round"] for r in records] == [1, 2]

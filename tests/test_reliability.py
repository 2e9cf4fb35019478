"""Bad updates, client failures, robust aggregation and crash safety."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from fedpeft.config import StrategyConfig, build_config
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.federated.strategy import build_strategy
from fedpeft.federated.strategy.robust import clip_update, coordinate_median, trimmed_mean
from fedpeft.federated.types import ClientResult
from fedpeft.federated.validation import RoundFailed
from fedpeft.metrics.recorder import load_metrics
from tests.conftest import tiny_raw_config, without_timing


def run(raw: dict) -> tuple[LocalEngine, list[dict]]:
    engine = LocalEngine(prepare(build_config(raw)), Path(raw["output"]["run_dir"]))
    return engine, engine.run()


@pytest.mark.parametrize("kind,reason", [
    ("nan", "NaN or Inf"), ("inf", "NaN or Inf"), ("wrong_shape", "shape"), ("unknown_key", "unknown keys"),
    ("missing_key", "missing keys"), ("oversize", "exceeds the limit"), ("zero_samples", "sample count"),
])
def test_bad_update_rejected_round_goes_on(toy_files: tuple[Path, Path], tmp_path: Path, kind: str,
                                           reason: str) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=1,
                          strategy={"selection": "all", "clients_per_round": None, "max_update_bytes": 1_000_000},
                          faults=[{"kind": kind, "clients": [1]}])
    engine, records = run(raw)
    failures = records[0]["failures"]
    assert [(f["client"], f["stage"]) for f in failures] == [(1, "rejected")]
    assert reason in failures[0]["reason"]
    assert records[0]["clients"] == [0, 2, 3] and records[0]["selected"] == [0, 1, 2, 3]
    assert all(torch.isfinite(v).all() for v in engine.final_state.values())
    assert load_metrics(tmp_path / "run")[0]["failures"] == failures


def test_crashed_and_dropped_clients_are_skipped(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=2,
                          strategy={"selection": "all", "clients_per_round": None},
                          faults=[{"kind": "raise", "clients": [0], "rounds": [1]},
                                  {"kind": "dropout", "clients": [3]}])
    _, records = run(raw)
    assert [(f["client"], f["stage"]) for f in records[0]["failures"]] == [(0, "raised"), (3, "dropout")]
    assert records[1]["clients"] == [0, 1, 2]


def test_too_few_valid_replies_is_a_clear_error(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=1,
                          strategy={"clients_per_round": 2, "min_clients": 2}, faults=[{"kind": "nan"}])
    with pytest.raises(RoundFailed, match="min_clients"):
        run(raw)


def test_robust_aggregators_math() -> None:
    updates = [{"w": torch.tensor([1.0, 10.0])}, {"w": torch.tensor([2.0, -10.0])}, {"w": torch.tensor([3.0, 0.0])},
               {"w": torch.tensor([4.0, 1e6])}]
    assert torch.allclose(coordinate_median(updates)["w"], torch.tensor([2.5, 5.0]))
    assert torch.allclose(trimmed_mean(updates, 0.25)["w"], torch.tensor([2.5, 5.0]))
    clipped = clip_update({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, 1.0)
    assert torch.allclose(clipped["a"], torch.tensor([0.6])) and torch.allclose(clipped["b"], torch.tensor([0.8]))
    assert clip_update({"a": torch.tensor([0.1])}, 1.0)["a"].item() == pytest.approx(0.1)


@pytest.mark.parametrize("robust", ["clip", "median", "trimmed_mean"])
def test_one_poisoned_client_of_five(robust: str) -> None:
    honest = [ClientResult(i, {"w": torch.full((4,), 0.1 * (i + 1))}, 10, 0.0) for i in range(4)]
    poisoned = ClientResult(4, {"w": torch.full((4,), 1e6)}, 10, 0.0)
    state = {"w": torch.zeros(4)}
    plain = build_strategy(StrategyConfig()).aggregate(state, [*honest, poisoned])
    defended = build_strategy(StrategyConfig(robust=robust, clip_norm=1.0, trim_fraction=0.2)).aggregate(
        state, [*honest, poisoned])
    assert plain["w"].abs().max() > 1e5
    assert defended["w"].abs().max() < 1.0


def _uninterrupted_and_killed(tmp_path: Path, train: Path, eval_: Path, kill_after_lines: int,
                              extra_delay: float) -> tuple[Path, Path]:
    raw = tiny_raw_config(train, eval_, tmp_path / "full", rounds=4, adapter={"dropout": 0.1})
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "fedpeft", "run", str(config)]
    killed_dir = tmp_path / "killed"
    proc = subprocess.Popen([*cmd, "--run-dir", str(killed_dir)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = killed_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after_lines:
            break
        time.sleep(0.02)
    time.sleep(extra_delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run([*cmd, "--resume", str(killed_dir)], env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    subprocess.run([*cmd, "--run-dir", str(tmp_path / "full")], env=env, check=True, capture_output=True)
    return tmp_path / "full", killed_dir


@pytest.mark.slow
@pytest.mark.parametrize("kill_after_lines,extra_delay", [(1, 0.0), (2, 0.15), (3, 0.05)])
def test_sigkill_then_resume_matches_uninterrupted(toy_files: tuple[Path, Path], tmp_path: Path,
                                                   kill_after_lines: int, extra_delay: float) -> None:
    train, eval_ = toy_files
    full, killed = _uninterrupted_and_killed(tmp_path, train, eval_, kill_after_lines, extra_delay)

    assert without_timing(load_metrics(killed)) == without_timing(load_metrics(full))
    a = torch.load(full / "checkpoint.pt", weights_only=True)["global_state"]
    b = torch.load(killed / "checkpoint.pt", weights_only=True)["global_state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(killed.glob(".*.tmp"))

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

from fedpeft.config import ConfigError, StrategyConfig, build_config
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.federated.strategy import build_strategy
from fedpeft.federated.strategy.robust import clip_update, coordinate_median, trimmed_mean
from fedpeft.federated.types import ClientResult
from fedpeft.federated.validation import RoundFailed
from fedpeft.metrics.recorder import CheckpointError, load_metrics
from tests.conftest import tiny_raw_config, without_timing, write_toy_sentiment


def run(raw: dict) -> tuple[LocalEngine, list[dict]]:
    engine = LocalEngine(prepare(build_config(raw)), Path(raw["output"]["run_dir"]))
    return engine, engine.run()


@pytest.mark.parametrize("kind,reason", [
    ("nan", "NaN or Inf"), ("inf", "NaN or Inf"), ("wrong_shape", "shape"), ("unknown_key", "unknown keys"),
    ("missing_key", "missing keys"), ("oversize", "exceeds the limit"), ("zero_samples", "sample count"),
    ("truncated", "undecodable message"), ("wrong_dtype", "has dtype torch.int64"),
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


def test_timeouts_drop_late_clients_and_the_server_waits_until_the_deadline(toy_files: tuple[Path, Path],
                                                                            tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=1, client={"timeout_seconds": 1000.0},
                          strategy={"selection": "all", "clients_per_round": None},
                          faults=[{"kind": "straggler", "clients": [1], "slowdown": 1e6},
                                  {"kind": "timeout", "clients": [2]}])
    _, records = run(raw)
    failures = {f["client"]: f for f in records[0]["failures"]}
    assert sorted(failures) == [1, 2] and {f["stage"] for f in failures.values()} == {"timeout"}
    assert "exceeds client.timeout_seconds" in failures[1]["reason"]
    assert "no reply before the deadline" in failures[2]["reason"]
    assert records[0]["clients"] == [0, 3]
    assert records[0]["time"]["simulated"] == 1000.0  # everyone else was done long before


def test_stragglers_slow_the_simulated_round(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=1, network={"down_mbps": 8.0, "up_mbps": 2.0},
                          strategy={"selection": "all", "clients_per_round": None},
                          faults=[{"kind": "straggler", "clients": [2], "slowdown": 1e6}])
    _, records = run(raw)
    r = records[0]
    compute = r["client_seconds"]
    # a million times its own wall clock; the clients do equal work, but on a loaded CPU one client's wall
    # clock has been seen at 36x another's, so the margin must dwarf any jitter
    assert compute[2] > 1000 * max(compute[i] for i in (0, 1, 3))
    per_client = [8 * d / 8e6 + c + 8 * u / 2e6 for d, c, u in zip(r["bytes_down"], compute, r["bytes_up"])]
    assert r["time"]["simulated"] == pytest.approx(max(per_client)) == pytest.approx(per_client[2])


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


def test_fedadamw_aggregates_robustly_too() -> None:
    honest = [ClientResult(i, {"w": torch.full((4,), 0.1 * (i + 1))}, 10, 0.0) for i in range(4)]
    poisoned = ClientResult(4, {"w": torch.full((4,), 1e6)}, 10, 0.0)
    strategy = build_strategy(StrategyConfig(name="fedadamw", robust="median", beta1=0.9))
    strategy.aggregate({"w": torch.zeros(4)}, [*honest, poisoned])
    # Adam's first moment after one step is (1 - beta1) * grad, grad = -median of the updates (0.3)
    assert torch.allclose(strategy.m["w"], torch.full((4,), -0.1 * 0.3))


def test_methods_with_their_own_aggregation_reject_what_they_cannot_honour(toy_files: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="headprune", strategy={"robust": "median"})
    raw.pop("adapter")
    with pytest.raises(ConfigError, match="supports only: none, clip") as err:
        prepare(build_config(raw))
    assert err.value.field == "strategy.robust"


def test_resume_rejects_altered_run_directories(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=2)
    run(raw)
    raw["rounds"] = 3
    run_dir = tmp_path / "run"
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    metrics = (run_dir / "metrics.jsonl").read_text()

    def resume_error(match: str) -> None:
        with pytest.raises(CheckpointError, match=match):
            LocalEngine(prepare(build_config(raw)), run_dir).run(resume=True)
        torch.save(checkpoint, run_dir / "checkpoint.pt")
        (run_dir / "metrics.jsonl").write_text(metrics)

    (run_dir / "metrics.jsonl").write_text(metrics[: len(metrics) // 2])  # not a crash: writes are atomic
    resume_error("corrupt .*metrics.jsonl")
    (run_dir / "metrics.jsonl").write_text(metrics.splitlines()[1] + "\n")
    resume_error(r"lacks rounds \[1\]")
    torch.save({k: v for k, v in checkpoint.items() if k != "algorithm"}, run_dir / "checkpoint.pt")
    resume_error("not a fedpeft checkpoint .no algorithm")
    key = next(iter(checkpoint["global_state"]))
    torch.save({**checkpoint, "global_state": {**checkpoint["global_state"], key: torch.zeros(1)}},
               run_dir / "checkpoint.pt")
    resume_error(f"{key} has shape")
    torch.save({**checkpoint, "global_state": {"other.weight": torch.zeros(1)}}, run_dir / "checkpoint.pt")
    resume_error("keys do not match")


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


KILL_ROUNDS = 4


def _command(config: Path) -> list[str]:
    return [sys.executable, "-m", "fedpeft", "run", str(config)]


def _env() -> dict[str, str]:
    """The subprocess imports this checkout's sources, whatever the virtualenv has installed."""
    paths = [str(Path(__file__).resolve().parents[1] / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(paths)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The config (in a subprocess-readable file) and the run directory of a run nobody killed."""
    root = tmp_path_factory.mktemp("crash")
    train = write_toy_sentiment(root / "train.csv", 160, 0)
    eval_ = write_toy_sentiment(root / "eval.csv", 64, 1)
    raw = tiny_raw_config(train, eval_, root / "full", rounds=KILL_ROUNDS, adapter={"dropout": 0.1},
                          evaluation={"at_start": True})
    config = root / "exp.yaml"
    config.write_text(yaml.safe_dump(raw))
    subprocess.run([*_command(config), "--run-dir", str(root / "full")], env=_env(), check=True, capture_output=True)
    return config, root / "full"


@pytest.mark.slow
@pytest.mark.parametrize("kill_after_lines,extra_delay", [(0, 1.0), (1, 0.0), (3, 0.05), (4, 0.02)])
def test_sigkill_then_resume_matches_uninterrupted(uninterrupted: tuple[Path, Path], tmp_path: Path,
                                                   kill_after_lines: int, extra_delay: float) -> None:
    """SIGKILL at several points (during start-up, right after a metrics line, mid-round, while
    checkpointing); ``--resume`` must end with the uninterrupted run's weights and metrics."""
    config, full = uninterrupted
    killed = tmp_path / "killed"
    proc = subprocess.Popen([*_command(config), "--run-dir", str(killed)], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = killed / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after_lines:
            break
        time.sleep(0.02)
    time.sleep(extra_delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if (killed / "config.yaml").exists():
        resumed = subprocess.run([*_command(config), "--resume", str(killed)], env=_env(), capture_output=True,
                                 text=True)
    else:  # killed before it wrote anything: there is nothing to resume, so run it again
        resumed = subprocess.run([*_command(config), "--run-dir", str(killed)], env=_env(), capture_output=True,
                                 text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    assert without_timing(load_metrics(killed)) == without_timing(load_metrics(full))
    a = torch.load(full / "checkpoint.pt", weights_only=True)["global_state"]
    b = torch.load(killed / "checkpoint.pt", weights_only=True)["global_state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(killed.glob(".*.tmp"))

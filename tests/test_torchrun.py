"""torchrun engine: two gloo ranks on loopback give the local engine's weights and records bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fedpeft.cli import main
from fedpeft.config import build_config
from fedpeft.engines.deploy import free_port
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.metrics.recorder import load_metrics, resume_fingerprint
from tests.conftest import tiny_raw_config, without_timing


def headprune_raw(toy_files: tuple[Path, Path], run_dir: Path, kind: str) -> dict:
    """Head pruning: loss-gap selection from observed losses, sliced uploads plus per-head scores."""
    return tiny_raw_config(*toy_files, run_dir, method="headprune", rounds=2, adapter={"r": 4},
                           strategy={"clients_per_round": 3, "min_clients": 1}, engine={"kind": kind})


def run_two_ranks(raw: dict, config: Path) -> None:
    """``torchrun --nproc-per-node 2 -m fedpeft run`` on the experiment ``raw`` (written to ``config``)."""
    config.write_text(yaml.safe_dump(raw))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", "fedpeft", "run", str(config)]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_two_ranks_match_the_local_engine(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = headprune_raw(toy_files, tmp_path / "torchrun", "torchrun")
    run_two_ranks(raw, tmp_path / "exp.yaml")

    local_raw = headprune_raw(toy_files, tmp_path / "local", "local")
    local = LocalEngine(prepare(build_config(local_raw)), tmp_path / "local")
    local.run()
    ours = torch.load(tmp_path / "torchrun" / "checkpoint.pt", weights_only=True)
    assert ours["global_state"].keys() == local.final_state.keys()
    for key, value in local.final_state.items():  # tolerance 0: the same tasks, seeds and aggregation order
        assert torch.equal(ours["global_state"][key], value), key
    records, reference = load_metrics(tmp_path / "torchrun"), load_metrics(tmp_path / "local")
    assert without_timing(records) == without_timing(reference)
    assert len({tuple(r["clients"]) for r in records}) > 1  # loss-gap selection moved between rounds


def dp_raw(toy_files: tuple[Path, Path], run_dir: Path, kind: str) -> dict:
    """LoRA with DP-SGD; 3 of 4 clients per round, so a client's accountant meets other ranks."""
    return tiny_raw_config(*toy_files, run_dir, rounds=2, strategy={"clients_per_round": 3},
                           client={"local_steps": 2, "dp": {"epsilon": 3.0, "clip_norm": 1.0, "noise_seed": 0}},
                           engine={"kind": kind})  # seeded noise: the engines must draw the same


def test_dp_sgd_on_two_ranks_matches_the_local_engine(toy_files: tuple[Path, Path], tmp_path: Path,
                                                      single_torch_thread: None) -> None:
    """Each client's accountant travels with its task (device state), so the privacy records, noise and
    weights are the local engine's, and rank 0's checkpoint holds every accountant. One thread here as
    in each rank: Opacus's per-sample einsums round differently when split over threads."""
    run_two_ranks(dp_raw(toy_files, tmp_path / "torchrun", "torchrun"), tmp_path / "exp.yaml")

    local = LocalEngine(prepare(build_config(dp_raw(toy_files, tmp_path / "local", "local"))), tmp_path / "local")
    local.run()
    ours = torch.load(tmp_path / "torchrun" / "checkpoint.pt", weights_only=True)
    for key, value in local.final_state.items():
        assert torch.equal(ours["global_state"][key], value), key
    records, reference = load_metrics(tmp_path / "torchrun"), load_metrics(tmp_path / "local")
    assert without_timing(records) == without_timing(reference)
    assert local.exp.privacy is not None and ours["privacy"] == local.exp.privacy.state_dict()
    ranks: dict[int, set[int]] = {}  # task i goes to rank i mod 2
    for record in records:
        for position, client in enumerate(record["clients"]):
            ranks.setdefault(client, set()).add(position % 2)
    moved = [c for c, served in ranks.items() if len(served) > 1]
    assert moved and all(records[-1]["privacy"]["steps"][str(c)] == 4 for c in moved)  # 2 steps a round, twice


def test_torchrun_engine_needs_torchrun(toy_files: tuple[Path, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(headprune_raw(toy_files, tmp_path / "run", "torchrun")))
    assert main(["run", str(config)]) == 2
    assert "engine.kind" in capsys.readouterr().out


def test_engine_kind_does_not_change_the_resume_fingerprint(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """The engines compute the same rounds, so a run may continue on another engine."""
    prints = {resume_fingerprint(build_config(headprune_raw(toy_files, tmp_path, kind)))
              for kind in ("local", "torchrun", "flower")}
    assert len(prints) == 1
    other = headprune_raw(toy_files, tmp_path, "local")
    other["adapter"]["r"] = 2
    assert resume_fingerprint(build_config(other)) not in prints

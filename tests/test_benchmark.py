"""A benchmark file end to end on a toy task: tune on one budget, seeds, ceiling, results with verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedpeft.config import ConfigError
from fedpeft.sweep import expand
from tests.conftest import tiny_raw_config, write_toy_sentiment


def _benchmark(root: Path) -> dict:
    train = write_toy_sentiment(root / "train.csv", 160, 0)
    eval_ = write_toy_sentiment(root / "eval.csv", 64, 1)
    base = tiny_raw_config(train, eval_, root / "unused", rounds=3, engine={"threads": 1},
                           evaluation={"at_start": True})
    for key in ("method", "adapter", "output"):
        base.pop(key)
    return {
        "name": "toy", "description": "A toy comparison.", "results_dir": str(root / "results"),
        "out_dir": str(root / "runs"), "base": base,
        "methods": {"lora": {"method": "lora", "adapter": {"r": 4, "alpha": 8}},
                    "bitfit": {"method": "bitfit"}},
        "tasks": {"toy": {}},
        "partitions": {"iid": {"partition": {"kind": "iid", "num_clients": 4}}},
        "seeds": [0, 1],
        "tune": {"trials": 2, "pruner": "none", "validation_fraction": 0.2},
        "ceiling": {"method": "lora", "rounds": 2},
        "target": 0.6,
        "bandwidth": "10/1",
        "claims": [{"id": "bytes", "claim": "BitFit sends fewer bytes", "source": "toy", "baseline": "lora",
                    "check": "bitfit.uplink < lora.uplink"},
                   {"id": "acc", "claim": "BitFit is within 50 points", "check": "bitfit.final >= lora.final - 0.5"}],
        "notes": ["A note."],
    }


def test_expand_orders_fragments_and_names_runs(tmp_path: Path) -> None:
    spec = _benchmark(tmp_path)
    sweep = expand(spec)
    names = [r.name for r in sweep.runs]
    assert names == ["toy_iid_lora_seed0", "toy_iid_bitfit_seed0", "toy_iid_lora_seed1", "toy_iid_bitfit_seed1",
                     "toy_centralized_lora_seed0"]
    assert set(sweep.tunes) == {"toy_iid_lora", "toy_iid_bitfit"}
    ceiling = sweep.runs[-1]
    assert ceiling.raw["partition"] == {"kind": "centralized"} and ceiling.tune_key == "toy_iid_lora"
    assert all(r.raw["task"]["validation_fraction"] == 0.2 for r in sweep.runs)  # all train without the split
    bad = {**spec, "claims": [{"id": "x", "claim": "x", "check": "ghost.final > lora.final"}]}
    with pytest.raises(ConfigError, match=r"sweep\.claims\.0\.check: 'ghost' is not one of sweep\.methods"):
        expand(bad)
    with pytest.raises(ConfigError, match=r"sweep\.methods"):
        expand({**spec, "methods": {"lora-r8": {"method": "lora"}}})
    with pytest.raises(ConfigError, match=r"sweep\.tune\.trials"):
        expand({**spec, "tune": {"trials": 0}})


@pytest.mark.slow
def test_benchmark_runs_and_writes_verdicts(tmp_path: Path) -> None:
    from fedpeft.cli import main

    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(_benchmark(tmp_path), sort_keys=False))
    assert main(["sweep", str(path), "--workers", "2"]) == 0
    results = json.loads((tmp_path / "results" / "toy.json").read_text())
    assert results["command"].startswith("fedpeft sweep") and results["benchmark"] == "toy"
    assert len(results["rows"]) == 4 and not results["missing_runs"]
    row = results["rows"][0]
    for key in ("task", "partition", "method", "seed", "rounds", "clients", "clients_per_round", "metric",
                "best_metric", "final_metric", "trainable_params", "uplink_bytes_per_client_round",
                "downlink_bytes_per_client_round", "total_bytes", "rounds_to_target", "bytes_to_target",
                "wall_seconds", "eval_examples"):
        assert key in row
    assert row["eval_examples"] == 64 and row["method"] == "lora" and row["recipe"] == "lora"
    summary = {r["method"]: r for r in results["summary"]}
    assert summary["lora"]["seeds"] == [0, 1] and summary["lora"]["interval"] == "t"
    assert results["ceilings"][0]["partition"] == "centralized"
    tuned = results["tuning"]["toy_iid_lora"]
    assert tuned["trials"] == 2 and "client.lr" in tuned["best_params"]
    run_config = yaml.safe_load((tmp_path / "runs" / "toy_iid_lora_seed1" / "config.yaml").read_text())
    assert run_config["client"]["lr"] == pytest.approx(tuned["best_params"]["client.lr"])
    bytes_claim = results["claims"][0]["cells"][0]
    assert bytes_claim["verdict"] in ("confirmed", "not reached")  # gated only if LoRA missed 90% of its ceiling
    assert "bitfit.uplink" in bytes_claim["values"]
    md = (tmp_path / "results" / "toy.md").read_text()
    assert md.startswith("<!-- command: fedpeft sweep") and "## Claims" in md and "A note." in md
    assert (tmp_path / "results" / "toy_curves.png").stat().st_size > 0
    assert (tmp_path / "results" / "toy_tradeoff.png").stat().st_size > 0
    # finished work is skipped: a second call only rewrites the results
    assert main(["sweep", str(path)]) == 0

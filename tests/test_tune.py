"""fedpeft tune: seeded determinism, pruning, resume after SIGKILL, best.yaml runs, bad input."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedpeft.config import ConfigError, build_config
from fedpeft.recipes import RECIPES
from fedpeft.tune import ParamSpec, check_space, config_values, default_space, parse_space, tune, tuning_config
from tests.conftest import tiny_raw_config, write_toy_sentiment


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    root = tmp_path_factory.mktemp("tune")
    train = write_toy_sentiment(root / "train.csv", 160, 0)
    eval_ = write_toy_sentiment(root / "eval.csv", 64, 1)
    raw = tiny_raw_config(train, eval_, root / "unused", rounds=3, engine={"threads": 1})
    return raw, root


def _rows(tune_dir: Path) -> list[dict[str, str]]:
    with (tune_dir / "trials.csv").open() as handle:
        return list(csv.DictReader(handle))


def test_same_seed_same_trials_and_best_yaml_runs(toy: tuple[dict[str, Any], Path], tmp_path: Path) -> None:
    from rich.console import Console

    raw, _ = toy
    quiet = Console(quiet=True)
    first = tune(raw, tmp_path / "a", 4, seed=3, pruner="none", console=quiet)
    second = tune(raw, tmp_path / "b", 4, seed=3, pruner="none", console=quiet)
    other = tune(raw, tmp_path / "c", 4, seed=4, pruner="none", console=quiet)
    lrs = [[row["client.lr"] for row in _rows(tmp_path / d)] for d in ("a", "b", "c")]
    assert lrs[0] == lrs[1] and lrs[0] != lrs[2]
    assert first.best_params == second.best_params and other.trials == 4
    best = build_config(yaml.safe_load(first.best_config.read_text()))
    assert best.client.lr == first.best_params["client.lr"]
    assert best.task.validation_fraction == 0.1 and best.evaluation.splits == ["eval", "validation"]
    assert (tmp_path / "a" / "trials.png").stat().st_size > 0
    assert (tmp_path / "a" / "study.db").exists()
    from fedpeft.cli import main

    assert main(["run", str(first.best_config), "--run-dir", str(tmp_path / "best_run")]) == 0
    assert (tmp_path / "best_run" / "summary.json").exists()
    # asking again for the same budget reuses the study: nothing new runs
    again = tune(raw, tmp_path / "a", 4, seed=3, pruner="none", console=quiet)
    assert again.best_params == first.best_params and len(_rows(tmp_path / "a")) == 4


def test_a_tune_in_which_no_trial_learned_says_so(toy: tuple[dict[str, Any], Path], tmp_path: Path) -> None:
    """At lr 1e-9 nothing moves: the stratified validation split (16 of 160, 8 per class) scores at most
    0.5 + 1.96 * sqrt(0.25 / 16) = 0.745 by always answering one class, and the tune says its best is there."""
    import json
    from types import SimpleNamespace

    from rich.console import Console

    from fedpeft.tune import _not_learned

    raw, _ = toy
    space = parse_space({"client.lr": {"choices": [1.0e-9]}}, "space")
    tune(raw, tmp_path / "t", 1, seed=0, space=space, pruner="none", console=Console(quiet=True))
    said = json.loads((tmp_path / "t" / "tune.json").read_text())["not_learned"]
    assert said.startswith("the best trial (0) ends at validation accuracy 0.")
    assert "most frequent class scores 0.500 (0.745 with its noise over 16 examples)" in said
    attrs = {"constant": 0.5, "validation_examples": 16, "metric": "accuracy"}
    learned = SimpleNamespace(number=2, value=0.8125, user_attrs=attrs)
    assert _not_learned(learned, "validation accuracy") is None
    # scored by macro-F1 on a classification task: the best one-class answer is the level, without a band
    attrs = {"constant": 0.4186, "validation_examples": 200, "metric": "macro_f1"}
    one_class = _not_learned(SimpleNamespace(number=1, value=0.4186, user_attrs=attrs), "validation macro_f1")
    assert one_class is not None and "answering one class for every validation example scores 0.419" in one_class
    assert _not_learned(SimpleNamespace(number=1, value=0.45, user_attrs=attrs), "validation macro_f1") is None
    # scored by another metric: only 0 is a known level (an F1 of 0 finds nothing right)
    assert _not_learned(SimpleNamespace(number=2, value=0.5, user_attrs={}), "validation f1") is None
    nothing = _not_learned(SimpleNamespace(number=3, value=0.0, user_attrs={}), "validation entity_f1")
    assert nothing is not None and nothing.startswith("the best trial (3) ends at validation entity_f1 0.000, and 0 is")


def test_pruning_stops_a_diverging_trial(toy: tuple[dict[str, Any], Path], tmp_path: Path) -> None:
    from rich.console import Console

    raw, _ = toy
    raw = {**raw, "rounds": 4, "client": {**raw["client"], "optimizer": "sgd"}}  # SGD at 1e6: the loss overflows
    space = parse_space({"client.lr": {"choices": [0.01, 1.0e6]}}, "space")
    tune(raw, tmp_path / "t", 4, seed=0, space=space, console=Console(quiet=True))
    rows = _rows(tmp_path / "t")
    diverged = [r for r in rows if float(r["client.lr"]) > 1]
    assert diverged and all(r["state"] == "pruned" and int(r["rounds_reported"]) <= 1 and "diverged" in r["note"]
                            for r in diverged)
    assert any(r["state"] == "complete" and float(r["client.lr"]) == 0.01 for r in rows)


def _verdicts(kind: str, values: list[float], noise: float = 0.0) -> list[bool]:
    """should_prune after each round of a trial reporting ``values``, after two finished trials that
    reported 0.6, 0.7, 0.8, 0.85 (a pruner that may judge from round 3)."""
    import optuna

    from fedpeft.tune import _pruner

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", pruner=_pruner(kind, 3))
    for _ in range(2):
        trial = study.ask()
        for step, value in enumerate([0.6, 0.7, 0.8, 0.85], start=1):
            trial.report(value, step)
            trial.should_prune()  # as every trial of a tune asks after each round (halving records its rungs)
        study.tell(trial, 0.85)
    trial = study.ask()
    trial.set_user_attr("noise", noise)
    verdicts = []
    for step, value in enumerate(values, start=1):
        trial.report(value, step)
        verdicts.append(bool(trial.should_prune()))
    return verdicts


@pytest.mark.parametrize("kind", ["median", "halving"])
def test_pruner_waits_for_prune_after_rounds(kind: str) -> None:
    """A trial at the majority class is not judged before round ``prune_after``, and is stopped there."""
    assert _verdicts(kind, [0.545] * 3) == [False, False, True]


def test_median_pruner_spares_a_trial_within_the_noise() -> None:
    """Median 0.8 at round 3: 0.76 is within a 0.0707 noise (200 validation examples) and goes on;
    0.72 is not; without noise both stop."""
    assert _verdicts("median", [0.5, 0.6, 0.76], noise=0.0707) == [False, False, False]
    assert _verdicts("median", [0.5, 0.6, 0.72], noise=0.0707) == [False, False, True]
    assert _verdicts("median", [0.5, 0.6, 0.76]) == [False, False, True]


def _command(config: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "fedpeft", "tune", str(config), "--trials", "3", "--pruner", "none",
            "--out", str(out)]


def _env() -> dict[str, str]:
    paths = [str(Path(__file__).resolve().parents[1] / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(paths)}


@pytest.mark.slow
def test_sigkill_then_resume_continues_the_study(toy: tuple[dict[str, Any], Path], tmp_path: Path) -> None:
    raw, _ = toy
    raw = {**raw, "rounds": 6}
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(raw))
    full = subprocess.Popen(_command(config, tmp_path / "full"), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # the uninterrupted reference, beside the killed tune
    proc = subprocess.Popen(_command(config, tmp_path / "killed"), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = tmp_path / "killed" / "trials" / "001" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics.read_text().splitlines()) < 6  # killed inside trial 1
    done = subprocess.run(_command(config, tmp_path / "killed"), env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert full.wait(timeout=300) == 0
    full, killed = _rows(tmp_path / "full"), _rows(tmp_path / "killed")
    assert [(r["client.lr"], r["value"]) for r in killed] == [(r["client.lr"], r["value"]) for r in full]
    resumed = next(r for r in killed if r["run_dir"].endswith("001"))
    assert int(resumed["rounds_reported"]) == 6  # the rounds before the kill were kept, not rerun
    rounds = [line for line in metrics.read_text().splitlines()]
    assert len(rounds) == 6
    body = [(tmp_path / d / "best.yaml").read_text().split("\n", 1)[1] for d in ("killed", "full")]
    assert body[0] == body[1]  # the same config; only the header's trial number differs (a retried trial is new)


def test_include_defaults_spends_trial_0_on_the_configs_values(toy: tuple[dict[str, Any], Path],
                                                               tmp_path: Path) -> None:
    from rich.console import Console

    raw, _ = toy
    quiet = Console(quiet=True)
    lr = build_config(raw).client.lr
    space = {"client.lr": ParamSpec(low=lr / 10, high=lr * 10, log=True),
             "client.momentum": ParamSpec(low=0.5, high=0.6)}  # the config's 0.0 lies outside: sampled
    assert config_values(build_config(raw), space) == {"client.lr": lr}
    tune(raw, tmp_path / "with", 2, seed=3, space=space, pruner="none", include_defaults=True, console=quiet)
    tune(raw, tmp_path / "without", 2, seed=3, space=space, pruner="none", console=quiet)
    first, plain = _rows(tmp_path / "with"), _rows(tmp_path / "without")
    assert float(first[0]["client.lr"]) == lr and first[0]["note"] == "the config's own values"
    assert 0.5 <= float(first[0]["client.momentum"]) <= 0.6
    assert float(plain[0]["client.lr"]) != lr and plain[0]["note"] == ""
    # the option is part of the study's identity: the same folder refuses the other setting
    with pytest.raises(ConfigError, match=r"TUNE_DIR: .* holds the study of another config"):
        tune(raw, tmp_path / "without", 2, seed=3, space=space, pruner="none", include_defaults=True,
             console=quiet)


@pytest.mark.parametrize("method", sorted(RECIPES))
def test_every_recipe_carries_a_space_that_holds_its_defaults(method: str) -> None:
    """A recipe's own space (not the derived decade either side of its defaults, which for the
    released HetLoRA held only collapsing values) is valid at every edge and holds its defaults, so a
    tune's trial 0 re-runs them."""
    assert RECIPES[method].tune, f"recipes/{method}.yaml has no tune: block"
    cfg = build_config({"method": method})
    space = default_space(cfg)
    check_space(space, {"method": method}, f"recipes/{method}.yaml tune")
    assert set(config_values(cfg, space)) == set(space)


def test_default_space_and_bad_input(toy: tuple[dict[str, Any], Path], tmp_path: Path) -> None:
    from rich.console import Console

    raw, _ = toy
    space = default_space(build_config(raw))
    assert set(space) == {"client.lr"} and space["client.lr"].log
    flasc = default_space(build_config({"method": "flasc"}))
    assert {"client.lr", "strategy.server_lr"} <= set(flasc)
    base = tuning_config(raw)
    with pytest.raises(ConfigError, match=r"space\.client\.lrr: unknown config key"):
        check_space({"client.lrr": ParamSpec(low=1e-4, high=1e-2)}, base)
    with pytest.raises(ConfigError, match=r"space\.strategy\.sever_lr: unknown config key"):
        check_space({"strategy.sever_lr": ParamSpec(low=1e-4, high=1e-2)}, base)
    with pytest.raises(ConfigError, match=r"space\.client\.lr: empty or inverted range"):
        parse_space({"client.lr": {"low": 1e-2, "high": 1e-4}}, "space")
    with pytest.raises(ConfigError, match=r"space\.client\.lr: empty or inverted range"):
        parse_space({"client.lr": {"low": 1e-2, "high": 1e-2}}, "space")
    with pytest.raises(ConfigError, match=r"space\.client\.momentum: the value 1\.5 is not allowed"):
        check_space({"client.momentum": ParamSpec(low=0.5, high=1.5)}, base)
    with pytest.raises(ConfigError, match=r"--trials: must be at least 1"):
        tune(raw, tmp_path / "zero", 0, console=Console(quiet=True))
    with pytest.raises(ConfigError, match=r"task\.validation_fraction"):
        tune(raw, tmp_path / "frac", 2, validation_fraction=1.5, console=Console(quiet=True))
    with pytest.raises(ConfigError, match=r"--prune-after: must be a round from 1 to the trial's 3 rounds"):
        tune(raw, tmp_path / "late", 2, prune_after=4, console=Console(quiet=True))
    tune(raw, tmp_path / "one", 1, console=Console(quiet=True))
    with pytest.raises(ConfigError, match=r"TUNE_DIR: .* holds the study of another config"):
        tune({**raw, "rounds": 2}, tmp_path / "one", 1, console=Console(quiet=True))


def test_tune_cli_one_line_errors(toy: tuple[dict[str, Any], Path], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from fedpeft.cli import main

    raw, _ = toy
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(raw))
    space = tmp_path / "space.yaml"
    space.write_text("client.lr: {low: 0.01, high: 0.001, log: true}\n")
    assert main(["tune", str(config), "--space", str(space), "--out", str(tmp_path / "x")]) == 2
    assert "space.client.lr: empty or inverted range" in capsys.readouterr().out
    assert main(["tune", str(config), "--trials", "0", "--out", str(tmp_path / "y")]) == 2
    assert "--trials: must be at least 1" in capsys.readouterr().out


@pytest.mark.real
def test_tune_real_minilm_lora_on_sst2(tmp_path: Path) -> None:
    """Two trials of MiniLM LoRA on a slice of SST-2: the study, its outputs and a runnable best.yaml."""
    from rich.console import Console

    from tests.conftest import SHARED_DATA

    if not (SHARED_DATA / "glue" / "SST-2").exists():
        pytest.skip(f"SST-2 not found under {SHARED_DATA}")
    raw = {"method": "lora", "rounds": 2, "model": {"name": "minilm"}, "engine": {"threads": 2},
           "task": {"name": "sst2", "data_dir": str(SHARED_DATA), "max_train_examples": 120, "max_eval_examples": 32,
                    "max_length": 32},
           "partition": {"kind": "iid", "num_clients": 3}, "strategy": {"clients_per_round": 2}}
    result = tune(raw, tmp_path / "t", 2, validation_fraction=0.25, console=Console(quiet=True))
    assert result.trials == 2 and 0.0 <= result.best_value <= 1.0
    rows = _rows(tmp_path / "t")
    assert [r["state"] for r in rows] == ["complete", "complete"]
    best = build_config(yaml.safe_load(result.best_config.read_text()))
    assert best.model.name == "minilm" and 1e-4 <= best.client.lr <= 2e-2  # the lora recipe's space
    assert best.task.validation_fraction == 0.25


def test_grid_tries_every_point_once_in_a_seeded_order(toy: tuple[dict[str, Any], Path], tmp_path: Path) -> None:
    """``--grid`` (a paper's "picked from these values"): one trial per combination, no defaults trial, the
    order shuffled by the seed; a trial budget below the grid and a range in the space are refused."""
    from rich.console import Console

    from fedpeft.tune import grid_points

    raw, _ = toy
    quiet = Console(quiet=True)
    space = parse_space({"client.lr": {"choices": [0.001, 0.01, 0.1]}}, "space")
    orders = [[p["client.lr"] for p in grid_points(space, seed)] for seed in (0, 0, 1, 2, 3)]
    assert orders[0] == orders[1] and all(sorted(o) == [0.001, 0.01, 0.1] for o in orders)
    assert len({tuple(o) for o in orders}) > 1
    two = parse_space({"client.lr": {"choices": [0.001, 0.01]}, "client.momentum": {"choices": [0.0, 0.5]}}, "s")
    assert sorted((p["client.lr"], p["client.momentum"]) for p in grid_points(two, 0)) == [
        (0.001, 0.0), (0.001, 0.5), (0.01, 0.0), (0.01, 0.5)]
    result = tune(raw, tmp_path / "grid", 8, seed=0, space=space, pruner="none", include_defaults=True, grid=True,
                  console=quiet)
    rows = _rows(tmp_path / "grid")
    assert [float(row["client.lr"]) for row in rows] == orders[0] and result.trials == 3
    assert all(row["note"] == "" for row in rows)  # no trial at the config's own values
    with pytest.raises(ConfigError, match=r"TUNE_DIR: .* holds the study of another config"):
        tune(raw, tmp_path / "grid", 3, seed=0, space=space, pruner="none", console=quiet)
    with pytest.raises(ConfigError, match=r"--trials: the grid has 3 points; 2 trials would leave 1 untried"):
        tune(raw, tmp_path / "short", 2, space=space, grid=True, console=quiet)
    ranged = parse_space({"client.lr": {"low": 1e-3, "high": 1e-1, "log": True}}, "space")
    with pytest.raises(ConfigError, match=r"--grid: a grid needs \{choices: \[\.\.\.\]\} for every key; client\.lr"):
        tune(raw, tmp_path / "range", 3, space=ranged, grid=True, console=quiet)


def test_a_grid_tune_killed_before_a_point_drew_its_values_still_tries_every_point_once(
        toy: tuple[dict[str, Any], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed between taking a queued point and drawing its values (the point is then only the queue's fixed
    value, not yet the trial's), the resumed tune runs that point, and no point twice; a grid with a repeated
    choice is refused."""
    from rich.console import Console

    import fedpeft.tune as tune_module

    raw, _ = toy
    quiet = Console(quiet=True)
    space = parse_space({"client.lr": {"choices": [0.001, 0.01, 0.1]}}, "space")
    real_suggest, calls = ParamSpec.suggest, []

    def killed_on_second(self: ParamSpec, trial: Any, name: str) -> Any:
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_suggest(self, trial, name)

    monkeypatch.setattr(tune_module.ParamSpec, "suggest", killed_on_second)
    with pytest.raises(KeyboardInterrupt):
        tune(raw, tmp_path / "grid", 3, space=space, pruner="none", grid=True, console=quiet)
    monkeypatch.setattr(tune_module.ParamSpec, "suggest", real_suggest)
    result = tune(raw, tmp_path / "grid", 3, space=space, pruner="none", grid=True, console=quiet)
    assert result.trials == 3
    tried = sorted(float(row["client.lr"]) for row in _rows(tmp_path / "grid"))
    assert tried == [0.001, 0.01, 0.1]
    with pytest.raises(ConfigError, match=r"--grid\.client\.lr: a grid tries each choice once"):
        tune(raw, tmp_path / "twice", 3, space=parse_space({"client.lr": {"choices": [0.01, 0.01]}}, "s"),
             grid=True, console=quiet)


def test_seeds_and_score_rounds_average_the_objective(toy: tuple[dict[str, Any], Path], tmp_path: Path) -> None:
    """``--seeds 0,1 --score-rounds 2``: every trial runs once per seed (its own partition and split) and
    scores the mean over seeds of each run's last 2 validation values, read back from the runs' metrics; the
    pruner hears only the first seed. The options change the study (a study of another objective is
    refused), and bad values are named."""
    import json
    import statistics

    from rich.console import Console

    from fedpeft.tune import study_fingerprint

    raw, _ = toy
    quiet = Console(quiet=True)
    space = parse_space({"client.lr": {"choices": [0.01, 0.1]}}, "space")
    result = tune(raw, tmp_path / "t", 2, space=space, grid=True, pruner="none", seeds=[0, 1], score_rounds=2,
                  console=quiet)
    rows = _rows(tmp_path / "t")
    assert len(rows) == 2 and result.trials == 2
    for number, row in enumerate(rows):
        scores = []
        for seed in (0, 1):
            run = tmp_path / "t" / "trials" / f"{number:03d}" / f"seed{seed}"
            assert yaml.safe_load((run / "config.yaml").read_text())["seed"] == seed
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            values = [r["validation"]["accuracy"] for r in records if r["round"] > 0 and "validation" in r]
            assert len(values) == 3
            scores.append(statistics.fmean(values[-2:]))
        assert float(row["value"]) == pytest.approx(statistics.fmean(scores), abs=1e-6)
        assert int(row["rounds_reported"]) == 3  # the first seed's rounds only
    partitions = [json.loads((tmp_path / "t" / "trials" / "000" / f"seed{s}" / "partition.json").read_text())
                  for s in (0, 1)]
    assert partitions[0] != partitions[1]
    plain = study_fingerprint(raw, space=space, grid=True, pruner="none")
    assert plain != study_fingerprint(raw, space=space, grid=True, pruner="none", seeds=[0, 1])
    assert plain != study_fingerprint(raw, space=space, grid=True, pruner="none", score_rounds=2)
    assert plain == study_fingerprint(raw, space=space, grid=True, pruner="none", seeds=None, score_rounds=1)
    with pytest.raises(ConfigError, match=r"TUNE_DIR: .* holds the study of another config"):
        tune(raw, tmp_path / "t", 2, space=space, grid=True, pruner="none", seeds=[0, 1], console=quiet)
    with pytest.raises(ConfigError, match=r"--score-rounds: must be from 1 to the trial's 3 rounds, got 4"):
        tune(raw, tmp_path / "x", 2, score_rounds=4, console=quiet)
    with pytest.raises(ConfigError, match=r"--seeds: must name at least one seed, each once; got \[1, 1\]"):
        tune(raw, tmp_path / "x", 2, seeds=[1, 1], console=quiet)

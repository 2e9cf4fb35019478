"""A benchmark file end to end on a toy task: tune on one budget, seeds, ceiling, results with verdicts."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from fedpeft.claims import CEILING, references
from fedpeft.config import ConfigError, build_config
from fedpeft.sweep import expand, load_sweep, reads_excluded, with_tuned
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
    # a first judging round past the trials' last round is refused before anything runs, not when the tune starts
    with pytest.raises(ConfigError, match=r"sweep\.tune\.prune_after: 4 is past the last round of the toy_iid_lora "
                       r"tune's trials \(3 rounds\)"):
        expand({**spec, "tune": {**spec["tune"], "prune_after": 4}})
    with pytest.raises(ConfigError, match=r"sweep\.tune\.prune_after: 3 .*\(2 rounds\)"):
        expand({**spec, "tune": {**spec["tune"], "prune_after": 3, "rounds": 2}})
    assert expand({**spec, "tune": {**spec["tune"], "prune_after": 3}}).spec.tune.prune_after == 3


def test_ceiling_config_applies_to_the_ceiling_over_tuned_values(tmp_path: Path) -> None:
    """``ceiling.config`` sets the centralised runs only, over the method's tuned values (a client lr tuned
    against a server optimiser does not come back); the federated runs keep theirs."""
    spec = _benchmark(tmp_path)
    spec["ceiling"] = {"method": "lora", "rounds": 2,
                       "config": {"client": {"lr": 0.003}, "strategy": {"name": "fedavg", "server_lr": 1.0}}}
    sweep = expand(spec)
    ceiling = sweep.runs[-1]
    assert ceiling.ceiling and build_config(ceiling.raw).client.lr == 0.003
    tuned = sweep.tune_dir(ceiling.tune_key)
    tuned.mkdir(parents=True)
    (tuned / "tune.json").write_text(json.dumps({"best_params": {"client.lr": 0.05}}))
    cfg = build_config(with_tuned(sweep, ceiling))
    assert (cfg.client.lr, cfg.partition.kind, cfg.rounds) == (0.003, "centralized", 2)
    federated = next(r for r in sweep.runs if r.method == "lora" and not r.ceiling)
    assert build_config(with_tuned(sweep, federated)).client.lr == 0.05
    with pytest.raises(ConfigError, match=r"client\.lr"):
        expand({**spec, "ceiling": {**spec["ceiling"], "config": {"client": {"lr": -1}}}})


def test_inherit_runs_a_method_at_another_methods_tuned_values(tmp_path: Path) -> None:
    """``tune.inherit``: an arm that only adds a setting (DP noise, here a gradient clip) runs at its twin's
    tuned values, with no tune of its own, and keeps its own settings; a name that is not a method, an arm
    that also has its own space or is skipped, and a source that is not tuned itself are refused before
    anything runs."""
    spec = _benchmark(tmp_path)
    spec["methods"]["lora_dp"] = {"method": "lora", "adapter": {"r": 4, "alpha": 8}, "client": {"grad_clip": 0.5}}
    spec["tune"] = {**spec["tune"], "inherit": {"lora_dp": "lora"}}
    sweep = expand(spec)
    assert set(sweep.tunes) == {"toy_iid_lora", "toy_iid_bitfit"}
    dp = next(r for r in sweep.runs if r.method == "lora_dp")
    assert dp.tune_key == "toy_iid_lora"
    tuned = sweep.tune_dir("toy_iid_lora")
    tuned.mkdir(parents=True)
    (tuned / "tune.json").write_text(json.dumps({"best_params": {"client.lr": 0.05}}))
    cfg = build_config(with_tuned(sweep, dp))
    assert (cfg.client.lr, cfg.client.grad_clip) == (0.05, 0.5)
    for inherit, message in [({"ghost": "lora"}, r"'ghost' is not one of sweep\.methods"),
                             ({"lora_dp": "ghost"}, r"'ghost' is not one of sweep\.methods"),
                             ({"lora_dp": "bitfit", "bitfit": "lora"}, r"inherit\.lora_dp: 'bitfit' is not tuned")]:
        with pytest.raises(ConfigError, match=message):
            expand({**spec, "tune": {**spec["tune"], "inherit": inherit}})
    with pytest.raises(ConfigError, match=r"inherit\.lora_dp: .*neither skipped"):
        expand({**spec, "tune": {**spec["tune"], "skip": ["lora_dp"]}})
    # the results page says which tune an inheriting arm ran at
    from fedpeft.metrics.results import markdown_from_file

    committed = Path(__file__).parents[1] / "benchmarks" / "results" / "flasc.json"
    data = json.loads(committed.read_text())
    data["tune"]["inherit"] = {"lora_dp_hi": "lora"}
    assert "`lora_dp_hi` runs at `lora`'s tuned values." in markdown_from_file(committed, data)


def test_exclude_leaves_cells_out_of_the_benchmark_and_their_tunes(tmp_path: Path) -> None:
    """``exclude``: a baseline run in one partition only is not a product cell left unfinished; a method
    whose every run is excluded is not tuned; the ceiling stays; a name the file does not hold, or an empty
    entry (it would leave out everything), is refused before anything runs."""
    spec = _benchmark(tmp_path)
    spec["partitions"]["skew"] = {"partition": {"kind": "dirichlet", "alpha": 0.5, "num_clients": 4}}
    sweep = expand({**spec, "exclude": [{"method": "bitfit", "partition": "skew"}, {"seed": 1, "partition": "iid"}]})
    assert [r.name for r in sweep.runs] == ["toy_iid_lora_seed0", "toy_skew_lora_seed0", "toy_iid_bitfit_seed0",
                                            "toy_skew_lora_seed1", "toy_centralized_lora_seed0"]
    without_bitfit = expand({**spec, "exclude": [{"method": "bitfit"}], "claims": []})
    assert set(without_bitfit.tunes) == {"toy_iid_lora"}
    # a list matches any of its values (as --only's V1,V2)
    listed = expand({**spec, "exclude": [{"method": ["bitfit", "lora"], "partition": "skew"}]})
    assert [r.name for r in listed.runs] == ["toy_iid_lora_seed0", "toy_iid_bitfit_seed0", "toy_iid_lora_seed1",
                                             "toy_iid_bitfit_seed1", "toy_centralized_lora_seed0"]
    for exclude, message in [([{"method": "ghost"}], r"sweep\.exclude\.0\.method: 'ghost' is not one of the sweep's "
                               r"methods \(bitfit, lora\)"),
                             ([{"seed": 7}], r"sweep\.exclude\.0\.seed: 7 is not one of"),
                             ([{}], r"sweep\.exclude\.0: an empty entry"),
                             ([{"partition": ["iid", "dirichlet9"]}], r"sweep\.exclude\.0\.partition: 'dirichlet9' is "
                              r"not one of"),
                             ([{"method": []}], r"sweep\.exclude\.0\.method: an empty list names nothing"),
                             ([{"rounds": 3}], r"sweep\.exclude\.0")]:
        with pytest.raises(ConfigError, match=message):
            expand({**spec, "exclude": exclude})


def test_a_claim_is_not_judged_where_exclude_leaves_out_a_method_it_reads(tmp_path: Path) -> None:
    """A claim without ``where`` is judged in the cells where every method its check reads runs: a method left
    out of a cell (for every seed) there, or of the cell a ["PARTITION"] reference names, drops that cell; a
    claim left with no cell at all is refused before anything runs."""
    spec = _benchmark(tmp_path)
    spec["partitions"]["skew"] = {"partition": {"kind": "dirichlet", "alpha": 0.5, "num_clients": 4}}
    skew_out = [{"method": "bitfit", "partition": "skew"}]
    sweep = expand({**spec, "exclude": skew_out})
    acc = sweep.spec.claims[1]
    assert [reads_excluded(sweep.spec, acc, "toy", p) for p in ("iid", "skew")] == [False, True]
    # a claim judged in iid that also reads the left-out cell can never be judged
    drop = {"id": "drop", "claim": "BitFit loses less", "where": {"partition": "iid"},
            "check": 'bitfit["iid"].final - bitfit["skew"].final < lora["iid"].final - lora["skew"].final'}
    with pytest.raises(ConfigError, match=r"sweep\.claims\.2\.where: every cell the claim applies to leaves out"):
        expand({**spec, "exclude": skew_out, "claims": [*spec["claims"], drop]})
    # one seed left out is a cell with fewer seeds, not a cell left out
    partial = expand({**spec, "exclude": [{**skew_out[0], "seed": 1}], "claims": [*spec["claims"], drop]})
    assert not reads_excluded(partial.spec, partial.spec.claims[2], "toy", "iid")
    with pytest.raises(ConfigError, match=r"sweep\.claims\.0\.where"):
        expand({**spec, "exclude": [{"method": "bitfit"}]})


def test_only_keeps_the_named_cells_their_tunes_and_the_tasks_ceiling(tmp_path: Path) -> None:
    """``--only`` runs one part of a benchmark: the runs named, the tunes they wait for (a method left out
    is not tuned) and the ceiling of each task kept (so their claims can be judged); a name the file does
    not hold is refused, as is a malformed item."""
    from fedpeft.sweep import parse_only, restrict

    spec = _benchmark(tmp_path)
    spec["partitions"]["skew"] = {"partition": {"kind": "dirichlet", "alpha": 0.5, "num_clients": 4}}
    sweep = expand(spec)
    part = restrict(sweep, parse_only(["method=bitfit", "seed=1", "partition=skew"]))
    assert [r.name for r in part.runs] == ["toy_skew_bitfit_seed1", "toy_centralized_lora_seed0"]
    assert set(part.tunes) == {"toy_iid_bitfit", "toy_iid_lora"}  # tuned on the first partition; lora for its ceiling
    assert [r.name for r in restrict(sweep, parse_only(["method=bitfit", "seed=0,1"])).runs] == [
        "toy_iid_bitfit_seed0", "toy_skew_bitfit_seed0", "toy_iid_bitfit_seed1", "toy_skew_bitfit_seed1",
        "toy_centralized_lora_seed0"]
    assert len(restrict(sweep, {}).runs) == len(sweep.runs)
    with pytest.raises(ConfigError,
                       match=r"--only: partition dirichlet0\.1 not in the sweep file \(it has iid, skew\)"):
        restrict(sweep, parse_only(["partition=dirichlet0.1"]))
    for bad in ("method", "rounds=3", "task="):
        with pytest.raises(ConfigError, match=r"--only: expected KEY=V1,V2"):
            parse_only([bad])
    from fedpeft.cli import main

    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert main(["sweep", str(path), "--only", "task=ghost"]) == 2  # refused before anything runs
    assert not (tmp_path / "runs").exists()


def _fake_fedpeft(started: list[list[str]]) -> Callable[[list[str], Path], int]:
    """A stand-in for the sweep's subprocesses: records each command; a tune leaves a ``tune.json`` choosing
    nothing, so its runs start at once."""
    def fake(args: list[str], log: Path) -> int:
        if args[0] == "tune":
            out = Path(args[args.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "tune.json").write_text(json.dumps({"best_params": {}}))
        started.append(args)
        return 0
    return fake


def test_grid_methods_tune_point_by_point_within_the_same_budget(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``tune.grid``: a method tuned over a space of choices tries each once (``fedpeft tune --grid``, its
    study stamped so); a grid method without a space of its own, with a range, inheriting or larger than
    ``tune.trials`` is refused before anything runs, and the results page names the grid."""
    import fedpeft.sweep as sweep_module
    from fedpeft.metrics.results import markdown_from_file
    from fedpeft.sweep import run_sweep, tune_fingerprint

    spec = _benchmark(tmp_path)
    grid = {"client.lr": {"choices": [0.001, 0.01]}}
    spec["tune"] = {**spec["tune"], "spaces": {"bitfit": grid}, "grid": ["bitfit"]}
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    started: list[list[str]] = []
    monkeypatch.setattr(sweep_module, "_fedpeft", _fake_fedpeft(started))
    sweep = run_sweep(path)
    tunes = {Path(args[args.index("--out") + 1]).name: args for args in started if args[0] == "tune"}
    assert "--grid" in tunes["toy_iid_bitfit"] and "--grid" not in tunes["toy_iid_lora"]
    plain = expand({**spec, "tune": {**spec["tune"], "grid": []}})
    assert tune_fingerprint(sweep, "toy_iid_bitfit") != tune_fingerprint(plain, "toy_iid_bitfit")
    assert tune_fingerprint(sweep, "toy_iid_lora") == tune_fingerprint(plain, "toy_iid_lora")
    for tune, message in [({"grid": ["lora"]}, r"tune\.grid\.lora: a grid method is tuned itself"),
                          ({"grid": ["ghost"]}, r"'ghost' is not one of sweep\.methods"),
                          ({"spaces": {"bitfit": {"client.lr": {"low": 1e-3, "high": 1e-2}}}},
                           r"tune\.grid\.bitfit: a grid needs \{choices"),
                          ({"spaces": {"bitfit": {"client.lr": {"choices": [1e-3, 1e-2, 1e-1]}}}},
                           r"tune\.grid\.bitfit: the grid has 3 points, more than tune\.trials \(2\)")]:
        with pytest.raises(ConfigError, match=message):
            expand({**spec, "tune": {**spec["tune"], **tune}})
    committed = Path(__file__).parents[1] / "benchmarks" / "results" / "flasc.json"
    data = json.loads(committed.read_text())
    data["tune"]["spaces"] = {"lora_dp": {"strategy.server_lr": {"choices": [0.001, 0.02]}}}
    data["tune"]["grid"] = ["lora_dp"]
    assert "`lora_dp` tried every point of its grid once instead (strategy.server_lr in {0.001, 0.02}: 2 trials)." in \
        markdown_from_file(committed, data)


def test_a_tune_objective_over_seeds_and_last_rounds_reaches_every_tune(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``tune.seeds`` / ``tune.score_rounds`` pass to every tune (`--seeds`, `--score-rounds`), change its
    study's fingerprint, and the results page says what a trial scored; a file without them records and
    reads as before."""
    import fedpeft.sweep as sweep_module
    from fedpeft.metrics.results import markdown_from_file
    from fedpeft.sweep import run_sweep, tune_fingerprint

    spec = _benchmark(tmp_path)
    spec["tune"] = {**spec["tune"], "seeds": [0, 1], "score_rounds": 2}
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    started: list[list[str]] = []
    monkeypatch.setattr(sweep_module, "_fedpeft", _fake_fedpeft(started))
    sweep = run_sweep(path)
    tunes = [args for args in started if args[0] == "tune"]
    assert len(tunes) == 2
    assert all(args[args.index("--seeds") + 1] == "0,1" and args[args.index("--score-rounds") + 1] == "2"
               for args in tunes)
    plain = expand({**spec, "tune": {k: v for k, v in spec["tune"].items() if k not in ("seeds", "score_rounds")}})
    assert tune_fingerprint(sweep, "toy_iid_lora") != tune_fingerprint(plain, "toy_iid_lora")
    with pytest.raises(ConfigError, match=r"score_rounds"):
        expand({**spec, "tune": {**spec["tune"], "score_rounds": 0}})
    committed = Path(__file__).parents[1] / "benchmarks" / "results" / "federa_qqp.json"
    data = json.loads(committed.read_text())
    assert "seeds" not in data["tune"] and "score_rounds" not in data["tune"]
    assert "Each trial" not in markdown_from_file(committed, data)
    data["tune"].update(seeds=[0, 1, 2], score_rounds=3)
    assert ("Each trial ran once per seed (0, 1, 2) and scored the mean of its last 3 rounds' validation." in
            markdown_from_file(committed, data))


def test_device_places_every_tune_and_run_started_and_a_wrong_one_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fedpeft sweep FILE --device D`` writes ``engine.device: D`` into every tune and run config it starts,
    the file untouched (a committed benchmark on a GPU), and refuses a device this machine cannot use before
    anything runs, naming the flag."""
    import torch

    import fedpeft.sweep as sweep_module
    from fedpeft.cli import main
    from fedpeft.sweep import run_sweep

    spec = _benchmark(tmp_path)
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    started: list[list[str]] = []

    def fake_fedpeft(args: list[str], log: Path) -> int:  # record instead of running; a tune "chooses" nothing
        if args[0] == "tune":
            out = Path(args[args.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "tune.json").write_text(json.dumps({"best_params": {}, "best_value": 0.5, "metric": "accuracy",
                                                       "trials": 2, "complete": 2, "pruned": 0, "failed": 0,
                                                       "seconds": 1.0}))
        started.append(args)
        return 0

    monkeypatch.setattr(sweep_module, "_fedpeft", fake_fedpeft)
    run_sweep(path, device="cpu")
    configs = [Path(args[1]) for args in started]
    assert len(configs) == 2 + 5  # two tunes, four runs and the ceiling
    assert {yaml.safe_load(config.read_text())["engine"]["device"] for config in configs} == {"cpu"}
    assert "device" not in spec["base"]["engine"] and yaml.safe_load(path.read_text()) == spec
    assert main(["sweep", str(path), "--device", "cpu"]) == 0  # the results say how their runs were started
    assert json.loads((tmp_path / "results" / "toy.json").read_text())["command"].endswith("--device cpu")
    started.clear()
    assert main(["sweep", str(path), "--device", "gpu"]) == 2
    if not torch.cuda.is_available():
        assert main(["sweep", str(path), "--device", "cuda"]) == 2
    assert not started


def test_missing_cells_say_what_is_left_in_a_line_per_task(tmp_path: Path) -> None:
    """A benchmark run one part at a time lists what is left by task, partitions with the same gap merged."""
    from fedpeft.metrics.results import missing_cells

    spec = _benchmark(tmp_path)
    spec["tasks"]["other"] = {}
    spec["partitions"]["skew"] = {"partition": {"kind": "dirichlet", "alpha": 0.5, "num_clients": 4}}
    spec["seeds"] = [0, 1, 2]
    sweep = expand(spec)
    done = {"toy_iid_lora_seed0", "toy_iid_lora_seed1", "toy_iid_lora_seed2", "toy_centralized_lora_seed0",
            "toy_skew_lora_seed0", "toy_skew_lora_seed1", "toy_skew_lora_seed2", "toy_iid_bitfit_seed0"}
    missing = [run.name for run in sweep.runs if run.name not in done]
    assert missing_cells(sweep, missing) == [
        "toy (5 of 13 runs): iid: bitfit, seeds 1, 2; skew: bitfit, seeds 0, 1, 2",
        "other: all 13 runs"]
    done |= {"toy_iid_bitfit_seed1", "toy_iid_bitfit_seed2"}
    done -= {"toy_centralized_lora_seed0"}
    missing = [run.name for run in sweep.runs if run.name not in done and run.task == "toy"]
    assert missing_cells(sweep, missing) == ["toy (4 of 13 runs): skew: bitfit, seeds 0, 1, 2; the ceiling (seed 0)"]
    done -= {"toy_skew_lora_seed1", "toy_skew_lora_seed2"}  # two methods in one cell, missing different seeds
    missing = [run.name for run in sweep.runs if run.name not in done and run.task == "toy"]
    assert missing_cells(sweep, missing) == [
        "toy (6 of 13 runs): skew: lora, seeds 1, 2 and bitfit, seeds 0, 1, 2; the ceiling (seed 0)"]
    assert missing_cells(sweep, []) == []


def test_partition_figure_reads_the_summary_in_the_files_partition_order(tmp_path: Path) -> None:
    """The label-skew view: per task and method the final metric and its interval, iid first as the file
    lists it; a task with every method in one partition gets no panel, a sweep with none no figure."""
    from fedpeft.metrics.results import _partition_figure, by_partition

    spec = _benchmark(tmp_path)
    spec["tasks"]["other"] = {}
    spec["partitions"]["skew"] = {"partition": {"kind": "dirichlet", "alpha": 0.5, "num_clients": 4}}
    sweep = expand(spec)

    def row(task: str, partition: str, method: str, final: float) -> dict:
        return {"task": task, "partition": partition, "method": method, "final_metric": final,
                "final_metric_ci": [final - 0.25, final + 0.125]}  # exact in binary

    summary = [row("toy", "skew", "lora", 0.5), row("toy", "iid", "lora", 0.75), row("toy", "iid", "bitfit", 0.625),
               row("other", "iid", "lora", 0.875)]
    assert by_partition(sweep, summary) == {"toy": {"lora": [("iid", 0.75, 0.5, 0.875), ("skew", 0.5, 0.25, 0.625)],
                                                    "bitfit": [("iid", 0.625, 0.375, 0.75)]}}
    path = _partition_figure(sweep, tmp_path / "toy_partitions.png", summary, {"toy": 0.9}, "fedpeft sweep toy.yaml")
    assert path is not None and path.stat().st_size > 0
    assert _partition_figure(sweep, tmp_path / "none.png", summary[1:], {}, "c") is None
    assert not (tmp_path / "none.png").exists()


@pytest.mark.slow
def test_benchmark_runs_and_writes_verdicts(tmp_path: Path) -> None:
    from fedpeft.cli import main
    from fedpeft.metrics.results import markdown_from_file, refuse_fewer_runs

    path = tmp_path / "toy.yaml"
    spec = _benchmark(tmp_path)
    spec["tune"]["include_defaults"] = True
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert main(["sweep", str(path), "--workers", "2"]) == 0
    results = json.loads((tmp_path / "results" / "toy.json").read_text())
    assert results["command"].startswith("fedpeft sweep") and results["benchmark"] == "toy"
    assert len(results["rows"]) == 4 and not results["missing_runs"]
    row = results["rows"][0]
    for key in ("task", "partition", "method", "seed", "rounds", "clients", "clients_per_round", "metric",
                "best_metric", "final_metric", "trainable_params", "uplink_bytes_per_client_round",
                "downlink_bytes_per_client_round", "total_bytes", "rounds_to_target", "bytes_to_target",
                "wall_seconds", "eval_examples", "last_uplink_bytes_per_client", "seconds_to_target", "computed_on"):
        assert key in row
    assert row["eval_examples"] == 64 and row["method"] == "lora" and row["recipe"] == "lora"
    summary = {r["method"]: r for r in results["summary"]}
    assert summary["lora"]["seeds"] == [0, 1] and summary["lora"]["interval"] == "t"
    assert results["ceilings"][0]["partition"] == "centralized"
    tuned = results["tuning"]["toy_iid_lora"]
    assert tuned["trials"] == 2 and "client.lr" in tuned["best_params"]
    with (tmp_path / "runs" / "tune" / "toy_iid_lora" / "trials.csv").open() as handle:
        first = next(csv.DictReader(handle))  # tune.include_defaults: trial 0 ran the method's own lr
    assert float(first["client.lr"]) == build_config({**spec["base"], "method": "lora"}).client.lr
    assert first["note"] == "the config's own values"
    run_config = yaml.safe_load((tmp_path / "runs" / "toy_iid_lora_seed1" / "config.yaml").read_text())
    assert run_config["client"]["lr"] == pytest.approx(tuned["best_params"]["client.lr"])
    bytes_claim = results["claims"][0]["cells"][0]
    assert bytes_claim["verdict"] in ("confirmed", "not reached")  # gated only if LoRA missed 90% of its ceiling
    assert "bitfit.uplink" in bytes_claim["values"]
    # judged seed by seed too: both methods ran seeds 0 and 1
    assert bytes_claim["paired"]["verdict"] in ("confirmed", "not reached")
    assert bytes_claim["paired"]["gap"].startswith("same-seed gap +") and "over 2 seeds" in bytes_claim["paired"]["gap"]
    md = (tmp_path / "results" / "toy.md").read_text()
    assert md.startswith("<!-- command: fedpeft sweep") and "## Claims" in md and "A note." in md
    # where the runs computed, read from each run's summary (the report may be written elsewhere)
    (where, count), = results["computed_on"].items()
    assert where.startswith("cpu (") and ", fp32, torch " in where and count == 5  # 4 runs + the ceiling
    assert f"Runs computed on: {where} (5 runs)" in md
    assert (tmp_path / "results" / "toy_curves.png").stat().st_size > 0
    assert (tmp_path / "results" / "toy_tradeoff.png").stat().st_size > 0
    # the markdown is a function of the results file: suite.py re-renders it without the runs
    assert markdown_from_file(tmp_path / "results" / "toy.json") == md
    # finished work is skipped: a second call only rewrites the results
    assert main(["sweep", str(path)]) == 0
    # results that would drop a run the committed ones report as finished are refused, before anything is
    # written or run, unless that run is about to run again (--only) or the user allows fewer runs
    (tmp_path / "runs" / "toy_iid_bitfit_seed1" / "summary.json").unlink()
    before = (tmp_path / "results" / "toy.json").read_text()
    for argv in (["--report-only"], ["--only", "method=lora"]):
        assert main(["sweep", str(path), *argv]) == 2
        assert (tmp_path / "results" / "toy.json").read_text() == before
    assert not (tmp_path / "runs" / "toy_iid_bitfit_seed1" / "summary.json").exists()
    sweep = load_sweep(path)
    with pytest.raises(ConfigError, match=r"toy\.json: reports 1 finished run that is not here .*toy/iid/bitfit "
                                          r"seed 1.*--allow-fewer-runs"):
        refuse_fewer_runs(sweep)
    refuse_fewer_runs(sweep, running=[run for run in sweep.runs if run.name == "toy_iid_bitfit_seed1"])
    # --report-only runs nothing: an unfinished run is listed as such and stays unfinished
    assert main(["sweep", str(path), "--report-only", "--allow-fewer-runs"]) == 0
    partial = json.loads((tmp_path / "results" / "toy.json").read_text())
    assert partial["missing_runs"] == ["toy_iid_bitfit_seed1"] and len(partial["rows"]) == 3
    assert partial["claims"][0]["cells"][0]["paired"] is None  # one seed in common: no interval of gaps
    assert not (tmp_path / "runs" / "toy_iid_bitfit_seed1" / "summary.json").exists()
    assert partial["missing_cells"] == ["toy (1 of 5 runs): iid: bitfit, seed 1"]
    assert "Not finished (left out), 1 runs:\n\n- toy (1 of 5 runs): iid: bitfit, seed 1" in (
        tmp_path / "results" / "toy.md").read_text()


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "benchmarks").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_committed_sweep_files_validate(path: Path) -> None:
    """Every committed benchmark file expands, and every run and ceiling config it makes validates, so a
    sweep that takes hours does not die at its 40th run on a typo."""
    raw = yaml.safe_load(path.read_text())
    if "methods" not in raw and "grid" not in raw:
        pytest.skip(f"{path.name} is a base config, not a sweep")
    sweep = load_sweep(path)
    assert sweep.runs
    for run in sweep.runs:
        build_config(run.raw)
    for claim in sweep.spec.claims if sweep.is_benchmark else []:
        names = {ref[0] for ref in references(claim.check)} - ({CEILING} if sweep.spec.ceiling else set())
        assert names <= set(sweep.spec.methods), f"{claim.id} names a method the file does not run"


def test_fedtt_paper_benchmark_file_expands() -> None:
    """benchmarks/fedtt.yaml is valid before anyone spends hours on it: every run's config builds,
    the presets land, every arm packs its messages, and every claim names known methods."""
    sweep = load_sweep(Path(__file__).resolve().parents[1] / "benchmarks" / "fedtt.yaml")
    cells = {(run.task, run.partition, run.method) for run in sweep.runs if not run.ceiling}
    assert len(cells) == 2 * 5 * 5 and len(sweep.runs) == 3 * len(cells) + 2
    severe = next(run for run in sweep.runs if (run.task, run.partition, run.method, run.seed)
                  == ("mrpc", "appb_severe", "fedtt_plus", 0))
    cfg = build_config(severe.raw)
    assert cfg.partition.label_proportions == [[0.05, 0.95], [0.95, 0.05], [0.5, 0.5]]
    assert (cfg.client.local_steps, cfg.strategy.weighting, cfg.model.name) == (10, "uniform", "mpnet")
    assert all(build_config(run.raw).codec.up.pack for run in sweep.runs)
    assert {claim.id for claim in sweep.spec.claims} >= {"fedtt_vs_lora", "fedtt_plus_vs_lora",
                                                          "fedtt_plus_robust_vs_lora"}


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize("path", [p for p in sorted(RESULTS.glob("*.json")) if (data := json.loads(p.read_text()))
                                  .get("claims") and "computed_on" in (data.get("rows") or [{}])[0]],
                         ids=lambda p: p.name)
def test_committed_verdicts_rejudge_from_the_results_file_alone(path: Path) -> None:
    """A results file holds what its claims read (per-seed rows too), so today's rules give its verdicts
    back from the file alone: the file and the code that judges claims cannot drift apart unseen."""
    from fedpeft.metrics.results import judge_claims

    data = json.loads(path.read_text())
    sweep = load_sweep(path.parents[1] / f"{data['benchmark']}.yaml")
    again = judge_claims(sweep, data["summary"], data["ceilings"], data["rows"])
    assert [[(c["verdict"], (c["paired"] or {}).get("verdict")) for c in claim["cells"]] for claim in again] == [
        [(c["verdict"], (c["paired"] or {}).get("verdict")) for c in claim["cells"]] for claim in data["claims"]]


def test_rejudge_judges_the_committed_results_again_from_the_file_alone(tmp_path: Path, capsys) -> None:
    """`fedpeft sweep FILE --rejudge` reads no runs (here there are none): the results file's claims and notes
    follow the sweep file's edited claims, nothing else in it changes, and the markdown follows the file."""
    import shutil

    from fedpeft.cli import main

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    raw = yaml.safe_load((root / "fedtt_minilm_qqp.yaml").read_text())
    (tmp_path / "results").mkdir()
    shutil.copy(root / "results" / "fedtt_minilm_qqp.json", tmp_path / "results")
    before = json.loads((tmp_path / "results" / "fedtt_minilm_qqp.json").read_text())
    raw["claims"] = [{"id": "loses", "claim": "FedTT is 10 points below LoRA r=8", "baseline": "lora_r8",
                      "where": {"partition": "appb_iid"}, "check": "fedtt.final <= lora_r8.final - 0.1"}]
    raw["notes"], raw["description"] = ["edited"], "described again"
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["sweep", str(path), "--rejudge", "--only", "seed=0"]) == 2  # runs nothing: --only would do nothing
    assert main(["sweep", str(path), "--rejudge"]) == 0
    after = json.loads((tmp_path / "results" / "fedtt_minilm_qqp.json").read_text())
    assert [(c["id"], [cell["verdict"] for cell in c["cells"]]) for c in after["claims"]] == [("loses", ["refuted"])]
    assert (after["notes"], after["description"]) == (["edited"], "described again")
    changed = ("claims", "notes", "description", "rejudged")
    assert {k: v for k, v in after.items() if k not in changed} == {k: v for k, v in before.items() if k not in changed}
    page = (tmp_path / "results" / "fedtt_minilm_qqp.md").read_text()
    assert "FedTT is 10 points below LoRA r=8" in page and "**refuted**" in page
    assert f"Claims judged again on {after['rejudged']} from this file alone" in page
    assert not (tmp_path / "runs").exists()  # nothing ran
    (tmp_path / "results" / "fedtt_minilm_qqp.json").unlink()
    assert main(["sweep", str(path), "--rejudge"]) == 2
    assert "there are no results to judge again" in capsys.readouterr().out


def test_readme_results_match_the_committed_results() -> None:
    """The README's claims tables and benchmarks/results/README.md are generated from benchmarks/results/*.json:
    they may not drift from them."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "suite.py"), "--check"], cwd=root,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_crowded_panels_get_distinct_styles_and_an_outside_legend() -> None:
    """A benchmark of every recipe (25 methods) must stay readable: no two methods share a colour and
    line style, and the legend sits right of the axes instead of over the curves."""
    import matplotlib.pyplot as plt

    from fedpeft.metrics.results import CROWDED, _legend, _style

    styles = {(tuple(_style(i)["color"]), _style(i)["linestyle"]) for i in range(25)}
    assert len(styles) == 25
    for count, outside in ((CROWDED, False), (CROWDED + 1, True)):
        fig, ax = plt.subplots()
        for i in range(count):
            ax.plot([0, 1], [i, i], label=str(i))
        _legend(ax, count)
        fig.canvas.draw()
        legend_box = ax.get_legend().get_window_extent()
        axes_box = ax.get_window_extent()
        assert bool(legend_box.x0 >= axes_box.x1) is outside
        plt.close(fig)


def test_runs_start_when_their_own_tune_is_done_not_every_tune() -> None:
    """Two workers, a slow tune A and a quick tune B: B's runs (and an untuned run) go ahead on the
    worker B freed while A is still tuning; A's run waits for A alone."""
    import threading
    from types import SimpleNamespace

    from fedpeft.sweep import schedule

    release_a = threading.Event()
    events: list[str] = []
    lock = threading.Lock()

    def log(event: str) -> None:
        with lock:
            events.append(event)

    def do_tune(key: str) -> None:
        if key == "A":
            assert release_a.wait(timeout=30)
        log(f"tune {key}")

    def do_run(run: SimpleNamespace) -> None:
        log(f"run {run.name}")

    runs = [SimpleNamespace(name=name, tune_key=key) for name, key in
            (("a0", "A"), ("b0", "B"), ("free", None), ("b1", "B"))]
    sweep = SimpleNamespace(tunes={"A": None, "B": None}, runs=runs)
    worker = threading.Thread(target=schedule, args=(sweep, 2, do_tune, do_run))
    worker.start()
    for _ in range(300):  # until B's runs and the untuned run are done (A is still blocked)
        with lock:
            if len(events) == 4:
                break
        threading.Event().wait(0.01)
    assert events == ["tune B", "run b0", "run free", "run b1"]  # seed-major order among ready runs
    release_a.set()
    worker.join(timeout=30)
    assert events[4:] == ["tune A", "run a0"]


def test_figure_footer_wraps_a_long_command_inside_the_figure() -> None:
    """A sweep command with several --only is longer than a one-panel figure is wide: the footer wraps
    and every line stays inside the figure (it was cut off at the right edge)."""
    import matplotlib.pyplot as plt

    from fedpeft.metrics.results import _footer

    command = "fedpeft sweep benchmarks/fedpeptao.yaml --workers 2 " + " ".join(
        f"--only method=method_{i},other_{i}" for i in range(6))
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    ax.plot([0, 1], [0, 1])
    _footer(fig, command)
    text = fig.texts[-1]
    assert text.get_text().count("\n") >= 2 and text.get_text().replace("\n", " ").startswith(command)
    fig.canvas.draw()
    box = text.get_window_extent()
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y0 >= 0
    assert ax.get_window_extent().y0 > box.y1  # the axes sit above the footer
    plt.close(fig)


def test_claim_values_print_in_their_own_units() -> None:
    """Bytes in KB/MB; FLOPs, seconds and metrics as numbers (a FLOP count once printed as '398.67 GB')."""
    from fedpeft.metrics.results import format_value

    assert format_value("lora.uplink", 632_500.0) == "632.50 KB"
    assert format_value('federa["iid"].final', 0.803125) == "0.8031"
    assert format_value("b1.round_flops", 3.9867e11) == "3.987e+11"
    assert format_value("flasc_d4.comm_time_to_target", 32.06) == "32.06"
    assert format_value("lora.wall", 20_000.0) == "2e+04"


def test_a_ceiling_trained_unlike_its_method_says_how() -> None:
    """A ceiling's ``config:`` (another optimiser, lr, loss) is named beside it, so 'lora_adjusted' trained
    with AdamW and no adjustment does not read as the adjusted recipe."""
    from fedpeft.metrics.results import ceiling_label

    ceiling = {"method": "lora_adjusted", "rounds": 3}
    assert ceiling_label(ceiling, None) == ceiling_label(ceiling, {}) == "lora_adjusted, 3 epochs"
    assert ceiling_label(ceiling, {"client": {"optimizer": "adamw", "lr": 0.0009557889723004925,
                                              "logit_adjustment": 0.0}, "strategy": {"server_lr": 1}}) == (
        "lora_adjusted, 3 epochs; with client.optimizer = adamw, client.lr = 0.000956, "
        "client.logit_adjustment = 0, strategy.server_lr = 1")


def test_the_readme_claims_table_escapes_pipes_and_lists_each_cell() -> None:
    """Every judged cell is a row of the README's table for its benchmark, with a '|' in a claim escaped."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite", Path(__file__).parents[1] / "benchmarks" / "suite.py")
    assert spec is not None and spec.loader is not None
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    cell = {"task": "sst2", "partition": "iid", "verdict": "confirmed", "why": None,
            "values": {"a.final": 0.8, "a.uplink": 2048.0}, "paired": None}
    data = {"benchmark": "toy", "command": "fedpeft sweep toy.yaml",
            "claims": [{"claim": "a | b holds", "source": "paper", "cells": [cell, {**cell, "partition": "skew"}]}]}
    rows = [line for line in suite.claims_table(data) if line.startswith("| a")]
    assert len(rows) == 2 and rows[0].count(" | ") == 5
    assert rows[0] == ("| a \\| b holds | paper | sst2 / iid | **confirmed** | - | "
                       "a.final = 0.8, a.uplink = 2.05 KB |")

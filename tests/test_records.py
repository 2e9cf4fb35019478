"""A benchmark's committed run records: a fresh clone rewrites the same results, and only records that are
still the runs the sweep file asks for come back."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import yaml

from fedpeft.config import ConfigError
from fedpeft.records import read_records, records_path, restore_records, stale_on_disk, stale_runs, write_records
from fedpeft.sweep import load_sweep
from tests.test_benchmark import _benchmark


def _results(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "results" / "toy.json").read_text())


@pytest.mark.slow
def test_results_come_back_from_the_records_and_stale_records_run_again(tmp_path: Path) -> None:
    from fedpeft.cli import main

    path = tmp_path / "toy.yaml"
    spec = _benchmark(tmp_path)
    spec["tune"] = {"trials": 2, "pruner": "none", "validation_fraction": 0.2, "skip": ["bitfit"]}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert main(["sweep", str(path), "--workers", "2"]) == 0
    first = _results(tmp_path)
    assert len(first["rows"]) == 4 and not first["missing_runs"]
    sweep = load_sweep(path)
    records = records_path(sweep)
    tunes, runs = read_records(records)
    assert set(tunes) == {"toy_iid_lora"} and set(runs) == {run.name for run in sweep.runs}
    assert set(runs["toy_iid_lora_seed0"]) == {"config.yaml", "metrics.jsonl", "summary.json", "partition.json"}
    before = records.read_bytes()
    assert write_records(sweep).read_bytes() == before  # the same records give the same bytes

    # a fresh clone: no run directories, no tunes; the report is the same, from the records alone
    for folder in (tmp_path / "runs").iterdir():
        if folder.is_dir() and folder.name not in ("configs", "logs"):
            for file in sorted(folder.rglob("*"), reverse=True):
                file.unlink() if file.is_file() else file.rmdir()
            folder.rmdir()
    assert main(["sweep", str(path), "--report-only"]) == 0
    again = _results(tmp_path)
    assert again["rows"] == first["rows"] and again["claims"] == first["claims"]
    assert again["tuning"] == first["tuning"] and again["ceilings"] == first["ceilings"]
    assert not (tmp_path / "runs" / "toy_iid_lora_seed0" / "checkpoint.pt").exists()

    # the file changes one method: its records are stale and say why; the others come back
    for run in load_sweep(path).runs:
        for file in run.run_dir.iterdir():
            file.unlink()
        run.run_dir.rmdir()
    spec["methods"]["bitfit"]["client"] = {"lr": 0.0123}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    said: list[str] = []
    assert restore_records(load_sweep(path), said.append) == 3  # lora's two seeds and its ceiling
    assert said[0].startswith("restored 3 finished run(s)")
    assert any("toy_iid_bitfit_seed0 (client.lr (" in line and "0.0123 given)" in line for line in said[1:])
    # so `--report-only` lists bitfit as not run (a stale result is no loss: no --allow-fewer-runs needed),
    # and a sweep would run it again
    assert stale_runs(load_sweep(path)) == {"toy_iid_bitfit_seed0", "toy_iid_bitfit_seed1"}
    assert main(["sweep", str(path), "--report-only"]) == 0
    assert sorted(_results(tmp_path)["missing_runs"]) == ["toy_iid_bitfit_seed0", "toy_iid_bitfit_seed1"]


def test_rounds_must_match_and_a_run_in_progress_is_left_to_resume(tmp_path: Path) -> None:
    spec = _benchmark(tmp_path)
    spec.pop("tune")
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    sweep = load_sweep(path)
    run = sweep.runs[0]
    from fedpeft.config import build_config

    config = build_config(run.raw)
    files = {"config.yaml": yaml.safe_dump(config.model_dump(mode="json")), "metrics.jsonl": "{}\n",
             "summary.json": "{}", "partition.json": "{}"}
    stale = {"config.yaml": files["config.yaml"].replace(f"rounds: {config.rounds}", "rounds: 9")}
    records = records_path(sweep)
    records.parent.mkdir(parents=True)
    with gzip.open(records, "wt") as handle:
        handle.write(json.dumps({"run": run.name, "files": files}) + "\n")
        handle.write(json.dumps({"run": sweep.runs[1].name, "files": {**files, **stale}}) + "\n")
        handle.write(json.dumps({"run": sweep.runs[2].name, "files": files}) + "\n")
    sweep.runs[2].run_dir.mkdir(parents=True)
    (sweep.runs[2].run_dir / "config.yaml").write_text("seed: 0\n")  # started here: it resumes, not replaced
    said: list[str] = []
    assert restore_records(sweep, said.append) == 1
    assert (run.run_dir / "summary.json").read_text() == "{}"
    assert said[1] == f"not restored, runs again: {sweep.runs[1].name} (rounds (9 in the record, 3 in the file))"
    assert (sweep.runs[2].run_dir / "config.yaml").read_text() == "seed: 0\n"


def test_a_malformed_records_file_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "toy_records.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(json.dumps({"tune": "a", "files": {}}) + "\n" + "not json\n")
    with pytest.raises(ConfigError, match="line 2 is not a run or tune record"):
        read_records(path)


def test_an_unfinished_tune_keeps_its_finished_trials_across_a_fresh_clone(tmp_path: Path) -> None:
    """A session stopped mid-tune commits its study; a fresh clone restores it (where the tune the file asks
    for is unchanged) and the tune goes on from the trials that finished instead of starting over."""
    import shutil

    from fedpeft.sweep import tune_fingerprint
    from fedpeft.tune import saved_fingerprint, tune

    spec = _benchmark(tmp_path)
    spec["tune"] = {"trials": 2, "pruner": "none", "validation_fraction": 0.2}
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    sweep = load_sweep(path)
    key, folder = "toy_iid_lora", sweep.tune_dir("toy_iid_lora")
    options = {"seed": 0, "pruner": "none", "validation_fraction": 0.2}
    tune(sweep.tunes[key].raw, folder, 1, **options)  # one trial of the file's two: then the session stopped
    for name in ("tune.json", "best.yaml", "trials.csv"):
        (folder / name).unlink()
    assert saved_fingerprint(folder / "study.db") == tune_fingerprint(sweep, key)
    tunes, _ = read_records(write_records(sweep))
    assert set(tunes) == {key} and set(tunes[key]) == {"study.db"}

    shutil.rmtree(tmp_path / "runs")  # a fresh clone
    said: list[str] = []
    restore_records(load_sweep(path), said.append)
    assert said == [f"restored 1 unfinished tune(s) from {records_path(sweep)}: their finished trials count"]
    result = tune(sweep.tunes[key].raw, folder, 2, **options)
    assert result.trials == 2  # trial 0 came back finished; only trial 1 ran
    assert not (folder / "trials" / "000").exists() and (folder / "trials" / "001").exists()

    # the file's tune changes: the recorded study is not that tune's, so it is named and the tune starts over
    for name in ("tune.json", "best.yaml", "trials.csv"):
        (folder / name).unlink()
    write_records(sweep)
    shutil.rmtree(tmp_path / "runs")
    spec["tune"]["seed"] = 1
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    said.clear()
    restore_records(load_sweep(path), said.append)
    assert not (folder / "study.db").exists()
    assert said == [f"not restored, runs again: tune {key} (the tune's config, rounds, space, seed or pruner changed "
                    "since)"]


def test_a_finished_tune_comes_back_only_while_it_is_the_tune_the_file_asks_for(tmp_path: Path) -> None:
    """A tune's choice decides every run of its method: after the file asks for longer trials or more of
    them, the finished tune (in the records, or on disk) and the runs made with its choice must not stand in."""
    import shutil

    from fedpeft.cli import main
    from fedpeft.config import build_config
    from fedpeft.sweep import run_sweep, tune_fingerprint, with_tuned
    from fedpeft.tune import tune

    spec = _benchmark(tmp_path)
    spec["tune"] = {"trials": 1, "pruner": "none", "validation_fraction": 0.2, "rounds": 1}
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    sweep = load_sweep(path)
    key, folder = "toy_iid_lora", sweep.tune_dir("toy_iid_lora")
    tune(sweep.tunes[key].raw, folder, 1, seed=0, pruner="none", validation_fraction=0.2, rounds=1)
    summary = json.loads((folder / "tune.json").read_text())
    assert summary["fingerprint"] == tune_fingerprint(sweep, key)
    del summary["fingerprint"]  # as a tune written before tunes stamped it: the record takes the study's
    (folder / "tune.json").write_text(json.dumps(summary))
    run = sweep.runs[0]  # lora, seed 0: finished with the tune's choice (its files stand in)
    run.run_dir.mkdir(parents=True)
    config = build_config(with_tuned(sweep, run)).model_dump(mode="json")
    (run.run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    for name in ("metrics.jsonl", "summary.json", "partition.json"):
        (run.run_dir / name).write_text("{}")
    write_records(sweep)
    assert json.loads(read_records(records_path(sweep))[0][key]["tune.json"])["fingerprint"] == \
        tune_fingerprint(sweep, key)
    shutil.rmtree(tmp_path / "runs")
    assert restore_records(load_sweep(path), [].append) == 1
    assert (folder / "tune.json").is_file()  # the same file: the finished tune comes back, and its run
    shutil.copytree(tmp_path / "runs", tmp_path / "kept")

    for change, why in (({"rounds": 2}, "the tune's config, rounds, space, seed or pruner changed since"),
                        ({"trials": 2}, "it ran 1 trials, the file asks for 2")):
        shutil.rmtree(tmp_path / "runs", ignore_errors=True)
        path.write_text(yaml.safe_dump({**spec, "tune": {**spec["tune"], **change}}, sort_keys=False))
        said: list[str] = []
        restore_records(load_sweep(path), said.append)
        assert not (folder / "tune.json").exists() and not run.run_dir.exists()
        assert said[0] == f"not restored, runs again: tune {key} ({why})"
        assert said[1].startswith(f"not restored, runs again: {run.name} (its tune {key} runs first")

    # the 1-trial tune and its run left on disk: refused before anything runs or is reported
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)
    shutil.copytree(tmp_path / "kept", tmp_path / "runs")
    with pytest.raises(ConfigError, match=rf"another version .*{key} \(it ran 1 trials.*made with the choice of the"):
        run_sweep(path, say=[].append)
    assert main(["sweep", str(path), "--report-only"]) != 0 and not (tmp_path / "results" / "toy.json").exists()
    shutil.rmtree(folder)  # the tune moved away, as the error says: its run is still named
    with pytest.raises(ConfigError, match=rf"its tune {key} is not on disk"):
        run_sweep(path, say=[].append)
    folder.mkdir()
    (folder / "tune.json").write_text('{"trials": ')  # cut short
    with pytest.raises(ConfigError, match=r"its tune\.json does not load"):
        run_sweep(path, say=[].append)
    assert not sweep.runs[1].run_dir.exists()  # nothing ran


def test_a_finished_run_on_disk_that_the_file_no_longer_asks_for_is_named(tmp_path: Path) -> None:
    from fedpeft.config import build_config

    spec = _benchmark(tmp_path)
    spec.pop("tune")
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    run = load_sweep(path).runs[1]  # bitfit, seed 0
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "config.yaml").write_text(yaml.safe_dump(build_config(run.raw).model_dump(mode="json")))
    for name in ("metrics.jsonl", "summary.json", "partition.json"):
        (run.run_dir / name).write_text("{}")
    assert stale_on_disk(load_sweep(path)) == []
    spec["methods"]["bitfit"]["client"] = {"lr": 0.0123}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    [line] = stale_on_disk(load_sweep(path))
    assert line.startswith(f"{run.run_dir} (client.lr (") and "0.0123 given)" in line

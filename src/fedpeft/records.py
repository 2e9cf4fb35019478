"""A benchmark's run records, committed beside its results, so that a fresh clone can rewrite them.

A benchmark's results (``NAME.json``, ``.md``, figures) are computed from its run directories and
tune folders under ``out_dir``, which are not committed (checkpoints are large). Without them,
``fedpeft sweep FILE --report-only`` on a fresh clone would report every run as missing, and adding
one cell to a benchmark (``--only partition=...``) would mean re-running all the others. So
:func:`write_records` keeps, in ``RESULTS_DIR/NAME_records.jsonl.gz``, the small files each finished
run and tune leaves (the resolved config, the per-round metrics, the summary, the partition; the
tune's choice and its trials table), and :func:`restore_records` writes them back into the run
directories a sweep expects before it runs or reports: restored runs count as finished, the others
run.

A record is restored only where it is still the run the sweep file asks for: its saved config must
match the config the file gives now field for field (the resume fingerprint: every field but
``rounds``, ``output`` and where it computes) and run the same number of rounds. A record that no
longer matches (the file or a recipe's defaults changed) stays out, is named, and its run runs
again. A finished tune comes back only where the fingerprint in its ``tune.json`` (config of the trials,
their rounds, space, seed, pruner) is the tune the file asks for now; otherwise it and every run made
with its choice run again. Checkpoints are not kept, so a restored run can be reported but not resumed
further.

A tune that has not finished keeps its Optuna study (``study.db``, a consistent SQLite snapshot,
base64): a session stopped in the middle of an hour-long tune commits the trials it finished, and
the next one restores the study (where its fingerprint is still the tune's the file gives now) and
goes on from there, losing only the trial that was running.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
import sqlite3
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from fedpeft.config import ConfigError, build_config
from fedpeft.metrics.recorder import (
    CONFIG,
    METRICS,
    PARTITION,
    SUMMARY,
    atomic_write_bytes,
    resume_differences,
    saved_config,
)
from fedpeft.sweep import Sweep, SweepRun, finished, tune_fingerprint, tune_finished, tune_trials, with_tuned
from fedpeft.tune import saved_fingerprint

RUN_FILES = (CONFIG, METRICS, PARTITION, SUMMARY)
"""What a finished run leaves besides its checkpoint; everything a benchmark's report reads. Restored in
this order, each file atomically: the summary, which marks a run finished, comes last, so a restore cut
short leaves a run in progress (it runs again), never a finished run with files missing."""

TUNE_FILES = ("tune.json", "best.yaml", "trials.csv")
"""What a finished tune leaves that a sweep reads (its choice) or a reader checks (every trial)."""

STUDY = "study.db"
"""An unfinished tune's Optuna storage: its record holds this file only, base64."""


def records_path(sweep: Sweep) -> Path:
    return sweep.results_dir() / f"{sweep.spec.name or 'benchmark'}_records.jsonl.gz"


def _files(folder: Path, names: tuple[str, ...]) -> dict[str, str]:
    return {name: (folder / name).read_text() for name in names if (folder / name).is_file()}


def write_records(sweep: Sweep) -> Path:
    """Write the records of every finished run and tune of ``sweep`` (one JSON line each, gzip without a
    timestamp, so the same records give the same bytes)."""
    lines = []
    for key in sorted(sweep.tunes):
        folder = sweep.tune_dir(key)
        if tune_finished(sweep, key):
            lines.append({"tune": key, "files": _with_fingerprint(_files(folder, TUNE_FILES), folder / STUDY)})
        elif (folder / STUDY).is_file() and (study := _study_snapshot(folder / STUDY)) is not None:
            lines.append({"tune": key, "files": {STUDY: study}})
    lines += [{"run": run.name, "files": _files(run.run_dir, RUN_FILES)} for run in sweep.runs if finished(run.run_dir)]
    payload = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines).encode()
    path = records_path(sweep)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, gzip.compress(payload, mtime=0))
    return path


def _with_fingerprint(files: dict[str, str], study: Path) -> dict[str, str]:
    """A finished tune's files, its ``tune.json`` stamped with its study's fingerprint where it was written
    before tunes stamped it themselves (a record without one is never restored)."""
    summary = json.loads(files["tune.json"])
    if "fingerprint" not in summary and study.is_file() and (saved := saved_fingerprint(study)) is not None:
        files["tune.json"] = json.dumps({**summary, "fingerprint": saved}, indent=2)
    return files


def _study_snapshot(path: Path) -> str | None:
    """A consistent copy of a study (its tune may be writing it), base64; None when no trial has finished."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / STUDY
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as source, \
                contextlib.closing(sqlite3.connect(copy)) as target:
            try:
                done = source.execute("SELECT COUNT(*) FROM trials WHERE state != 'RUNNING'").fetchone()[0]
            except sqlite3.DatabaseError:
                return None  # not a study yet
            if not done:
                return None
            source.backup(target)
        return base64.b64encode(copy.read_bytes()).decode()


def read_records(path: Path) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
    """(tunes by key, runs by name) of a records file; empty where there is none."""
    tunes: dict[str, dict[str, str]] = {}
    runs: dict[str, dict[str, str]] = {}
    if not path.is_file():
        return tunes, runs
    with gzip.open(path, "rt") as handle:
        for number, line in enumerate(handle, 1):
            try:
                record = json.loads(line)
                files = record["files"]
                (tunes if "tune" in record else runs)[record.get("tune") or record["run"]] = files
            except (ValueError, KeyError, TypeError) as err:
                raise ConfigError("records", f"{path} line {number} is not a run or tune record: {err}") from None
    return tunes, runs


def _write(folder: Path, files: dict[str, str], order: tuple[str, ...]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in order:
        if name in files:
            atomic_write_bytes(folder / name, files[name].encode())


def restore_records(sweep: Sweep, say: Callable[[str], None] = print) -> int:
    """Write the committed records of ``sweep``'s runs and tunes that are not on disk back into their
    folders, where they still match the sweep file; return how many runs came back. Tunes come back
    first (a run's config includes what its tune chose); a tune is kept on disk, never overwritten."""
    tunes, runs = read_records(records_path(sweep))
    studies, stale = 0, []
    for key in sweep.tunes:
        folder = sweep.tune_dir(key)
        files = tunes.get(key)
        if files is None or tune_finished(sweep, key):
            continue
        if "tune.json" in files:
            problem = _finished_tune_mismatch(sweep, key, files["tune.json"])
            if problem:
                stale.append(f"tune {key} ({problem})")
                continue
            _write(folder, files, TUNE_FILES[::-1])  # tune.json, the mark, last
        elif STUDY in files and not (folder / STUDY).exists():  # a study on disk goes on as it is
            try:
                study = base64.b64decode(files[STUDY], validate=True)
            except ValueError as err:
                stale.append(f"tune {key} (its study is not base64: {err})")
                continue
            problem = _study_mismatch(sweep, key, study)
            if problem:
                stale.append(f"tune {key} ({problem})")
                continue
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(folder / STUDY, study)
            studies += 1
    if studies:
        say(f"restored {studies} unfinished tune(s) from {records_path(sweep)}: their finished trials count")
    restored = 0
    for run in sweep.runs:
        files = runs.get(run.name)
        if files is None or finished(run.run_dir) or (run.run_dir / CONFIG).exists():
            continue  # nothing kept, done on disk, or a run in progress here (it resumes)
        problem = _mismatch(sweep, run, files)
        if problem:
            stale.append(f"{run.name} ({problem})")
            continue
        _write(run.run_dir, files, RUN_FILES)
        restored += 1
    if restored:
        say(f"restored {restored} finished run(s) from {records_path(sweep)}")
    for line in stale:
        say(f"not restored, runs again: {line}")
    return restored


def stale_runs(sweep: Sweep) -> set[str]:
    """Names of ``sweep``'s runs whose record no longer matches the run the file asks for (never restored)."""
    runs = read_records(records_path(sweep))[1]
    return {run.name for run in sweep.runs if run.name in runs and _mismatch(sweep, run, runs[run.name])}


def _study_mismatch(sweep: Sweep, key: str, study: bytes) -> str:
    """Why a recorded study (the SQLite file's bytes) is not the tune the sweep file asks for now ('' when it is)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / STUDY
        path.write_bytes(study)
        saved = saved_fingerprint(path)
    return _fingerprint_mismatch(sweep, key, saved, "its study")


def _finished_tune_mismatch(sweep: Sweep, key: str, tune_json: str, study: Path | None = None) -> str:
    """Why a finished tune (its ``tune.json``) is not the tune the sweep file asks for now ('' when it is):
    a tune of 8-round or 3-trial trials must not stand in for the 15-round or 6-trial tune the file asks for
    after an edit. ``study``: on disk, where a ``tune.json`` written before tunes stamped their fingerprint
    finds it (the study's); a tune with neither cannot be checked there and is kept."""
    try:
        summary = json.loads(tune_json)
        saved = summary.get("fingerprint")
    except (ValueError, AttributeError) as err:
        return f"its tune.json does not load: {err}"
    if saved is None and study is not None and study.is_file():
        saved = saved_fingerprint(study)
    unchecked = saved is None and study is not None
    if not unchecked and (problem := _fingerprint_mismatch(sweep, key, saved, "its tune.json")):
        return problem
    trials = tune_trials(sweep, key)
    ran = summary.get("trials")
    return "" if ran == trials else f"it ran {ran} trials, the file asks for {trials}"


def _fingerprint_mismatch(sweep: Sweep, key: str, saved: str | None, holder: str) -> str:
    try:
        expected = tune_fingerprint(sweep, key)
    except ConfigError as err:
        return str(err)
    if saved is None:
        return f"{holder} has no fingerprint"
    return "" if saved == expected else "the tune's config, rounds, space, seed or pruner changed since"


def stale_on_disk(sweep: Sweep) -> list[str]:
    """Finished tunes and runs in ``sweep``'s folders that are no longer what its file asks for, one line
    each. A sweep skips what is finished on disk, so an edited file (more tune rounds or trials, another
    space) would otherwise report the old tune's choice and the runs made with it as its own. A finished
    run whose tune is stale or not on disk is named too: nothing says which choice it ran with."""
    lines, stale = [], set()
    for key in sweep.tunes:
        folder = sweep.tune_dir(key)
        path = folder / "tune.json"
        if path.is_file() and (problem := _finished_tune_mismatch(sweep, key, path.read_text(), folder / STUDY)):
            lines.append(f"{folder} ({problem})")
            stale.add(key)
    for run in sweep.runs:
        if not finished(run.run_dir):
            continue
        if run.tune_key in stale:
            lines.append(f"{run.run_dir} (made with the choice of the stale tune {run.tune_key})")
        elif run.tune_key is not None and not tune_finished(sweep, run.tune_key):
            lines.append(f"{run.run_dir} (its tune {run.tune_key} is not on disk to check the run against)")
        elif problem := _mismatch(sweep, run, _files(run.run_dir, RUN_FILES)):
            lines.append(f"{run.run_dir} ({problem})")
    return lines


def refuse_stale_on_disk(sweep: Sweep) -> None:
    """Raise, naming each folder, where :func:`stale_on_disk` finds any."""
    if stale := stale_on_disk(sweep):
        raise ConfigError("sweep", "finished on disk under another version of this file (move each away to run it "
                          "again): " + "; ".join(stale))


def bring_back(sweep: Sweep, say: Callable[[str], None] = print) -> None:
    """What a sweep or its report does first: refuse where a tune or run finished on disk is stale
    (:func:`refuse_stale_on_disk`), then, for a benchmark, restore its records (:func:`restore_records`). In
    this order: a record is checked against the tune on disk, so a stale one there would pass its runs."""
    refuse_stale_on_disk(sweep)
    if sweep.is_benchmark:
        restore_records(sweep, say)


def _mismatch(sweep: Sweep, run: SweepRun, files: dict[str, str]) -> str:
    """Why a record is not the run the sweep file asks for now ('' when it is)."""
    if set(files) != set(RUN_FILES):
        return f"the record lacks {', '.join(sorted(set(RUN_FILES) - set(files)))}"
    if run.tune_key is not None and not tune_finished(sweep, run.tune_key):
        return f"its tune {run.tune_key} runs first: the record cannot be checked against a choice not yet made"
    try:
        given = build_config(with_tuned(sweep, run))
    except ConfigError as err:
        return str(err)
    try:
        saved = saved_config(yaml.safe_load(files[CONFIG]))
    except (ConfigError, yaml.YAMLError, AttributeError, TypeError) as err:
        return f"its config does not load: {err}"
    if saved.rounds != given.rounds:
        return f"rounds ({saved.rounds} in the record, {given.rounds} in the file)"
    differences = resume_differences(saved, given)
    return "; ".join(differences[:3]) + (" ..." if len(differences) > 3 else "")

"""Sweeps and benchmarks: methods x tasks x partitions x seeds, tuned on one budget, judged by claims.

A sweep file is YAML. The simple form runs a grid and compares it::

    base: configs/demo_sst2_lora.yaml     # a config file, or an inline mapping
    out_dir: runs/sweep                   # each run goes to out_dir/<name>
    set: [rounds=5]                       # overrides applied to every run (optional)
    grid:                                 # dotted key -> list of values (a mapping merges)
      method: [lora, full]
      seed: [0, 1]

A benchmark names its dimensions, and adds a tuning budget, a centralised ceiling and claims::

    name: fedtt                           # results: RESULTS_DIR/fedtt.{json,md} and figures
    results_dir: results                  # relative to this file (default: no results, a compare report)
    base: {...}                           # shared by every run
    tasks: {sst2: {task: {name: sst2}}}   # name -> config fragment, merged over base
    methods: {lora_r8: {method: lora, adapter: {r: 8}}, fedtt: {method: fedtt}}
    partitions: {iid: {partition: {kind: iid}}}
    seeds: [0, 1, 2]
    exclude: [{method: fedtt, partition: iid}]  # cells left out of the product (optional)
    tune: {trials: 8, per: task}          # the SAME trial budget for every method (fedpeft.tune)
    ceiling: {method: lora_r8, rounds: 4} # centralised runs of that method, per task (config: a fragment for them)
    target: {sst2: 0.85}                  # absolute targets for rounds/bytes/time to target
    bandwidth: 10/1                       # Mbps down/up for time to target
    claims:
      - {id: bytes, claim: "...", source: "Table 2", baseline: lora_r8,
         check: "fedtt.uplink <= 0.2 * lora_r8.uplink and fedtt.final >= lora_r8.final - 0.01"}

Fragments merge in the order base, task, method, partition (so every method of a comparison
runs the partition's participation), then the tuned values, then the seed. With ``tune``, each
method is tuned once per task (``per: task``, on ``tune.partition`` or the first partition) or
once per cell (``per: cell``) with ``tune.trials`` trials on a validation split carved from the
training data, and every run of the benchmark, tuned or not, trains without that split, so all
methods see the same examples. ``tune.skip`` runs methods as configured; ``tune.inherit`` (method ->
method) runs one at another's tuned values (a DP arm at its non-private twin's). Runs are
subprocesses (``--workers`` at a time); finished runs and tunes are skipped and interrupted ones
resumed, so a stopped benchmark continues where it stopped.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedpeft.claims import CEILING, reference_cell, references
from fedpeft.config import ConfigError, apply_overrides, build_config, deep_merge
from fedpeft.metrics.recorder import CHECKPOINT, CONFIG, SUMMARY


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TuneBlock(_Strict):
    """One trial budget for every method of a benchmark (see :func:`fedpeft.tune.tune`)."""

    trials: int = Field(gt=0)
    rounds: int | None = Field(None, gt=0)
    seed: int = 0
    pruner: Literal["median", "halving", "none"] = "median"
    prune_after: int | None = Field(None, gt=0)  # first round the pruner may stop a trial (default: half)
    validation_fraction: float = Field(0.1, gt=0, lt=1)
    per: Literal["task", "cell"] = "task"
    partition: str | None = None  # with per: task, the partition tuned on (default: the first)
    space: dict[str, Any] | None = None  # one space for every method (default: each recipe's own)
    spaces: dict[str, dict[str, Any]] = Field(default_factory=dict)  # per method name
    skip: list[str] = Field(default_factory=list)  # methods run as configured (e.g. a paper's fixed values)
    # method -> the method whose tuned values it runs at: an arm that only adds a setting the tune
    # cannot see coming (DP noise on top of a tuned twin), at the cost of one tune, not one per arm
    inherit: dict[str, str] = Field(default_factory=dict)
    # trial 0 at each method's own values (`fedpeft tune --include-defaults`); off, as the committed
    # benchmarks' tunes ran, so they re-draw the same trials from a clean clone
    include_defaults: bool = False
    # methods whose space (all choices) is tried point by point (`fedpeft tune --grid`), e.g. a paper's
    # "server lr picked from five values"; the grid must fit in `trials` (a grid method spends no more)
    grid: list[str] = Field(default_factory=list)
    # the objective: every trial once per seed (`fedpeft tune --seeds`) and the mean of its last
    # score_rounds rounds (`--score-rounds`); defaults: the tune's partition seed, the last round
    seeds: list[int] | None = Field(None, min_length=1)
    score_rounds: int = Field(1, gt=0)


class CeilingBlock(_Strict):
    """Centralised runs (one client, all the data, one epoch per round) of one method, per task.

    ``config``: a fragment for these runs only, merged over the method's and its tuned values. A recipe
    whose client lr is paired with a server optimiser needs one: trained centrally, dense FLASC keeps
    only 3 server AdamW steps of 0.02 in 3 rounds (SST-2: 0.558, against 0.752 federated), and its
    client SGD at lr 0.17 without that server step does not train (0.509); with an AdamW client at
    LoRA's 5e-4 and FedAvg at server lr 1 it is the same model trained centrally.
    """

    method: str
    rounds: int = Field(gt=0)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    config: dict[str, Any] = Field(default_factory=dict)


class ClaimSpec(_Strict):
    """A paper's claim and its check (grammar and verdicts: :mod:`fedpeft.claims`)."""

    id: str
    claim: str
    check: str
    source: str = ""
    baseline: str | None = None  # its centralised ceiling gates the verdict
    # {task: ..., partition: ...}; default every cell, less those where `exclude` leaves out a method it reads
    where: dict[str, str] = Field(default_factory=dict)
    # {partition: P}: the partition (of the judged task) where the baseline must reach 90% of its ceiling, in
    # place of every cell the check reads. For a claim about what a harder cell does to the methods (severe
    # heterogeneity): there the baseline may fall short of its ceiling because of the heterogeneity the claim
    # is about, so the budget is shown to be one at which it learns in the easy cell
    gate: dict[Literal["partition"], str] = Field(default_factory=dict)


class SweepFile(_Strict):
    name: str | None = None
    description: str = ""
    base: str | dict[str, Any] = Field(default_factory=dict)
    out_dir: str = "runs/sweep"
    results_dir: str | None = None
    set: list[str] = Field(default_factory=list)
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    tasks: dict[str, dict[str, Any]] = Field(default_factory=dict)
    methods: dict[str, dict[str, Any]] = Field(default_factory=dict)
    partitions: dict[str, dict[str, Any]] = Field(default_factory=dict)
    seeds: list[int] = Field(default_factory=list)
    # cells the product leaves out: a run matching every key of one entry ({method: full, partition: [iid, x]};
    # a list matches any of its values, as --only's V1,V2) is not part of the benchmark, so its report does not
    # list it as unfinished (GitHub Actions' matrix exclude)
    exclude: list[dict[Literal["task", "method", "partition", "seed"], str | int | list[str | int]]] = Field(
        default_factory=list)
    tune: TuneBlock | None = None
    ceiling: CeilingBlock | None = None
    target: float | dict[str, float] | None = None
    bandwidth: str | None = None
    claims: list[ClaimSpec] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    @field_validator("grid")
    @classmethod
    def _non_empty(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if not all(isinstance(v, list) and v for v in grid.values()):
            raise ValueError("expected a mapping of dotted keys to non-empty lists")
        return grid

    @field_validator("methods")
    @classmethod
    def _method_names(cls, methods: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name in methods:
            if name == CEILING:
                raise ValueError(f"{CEILING!r} is the name claims read the centralised ceiling by; name the method "
                                 "otherwise")
            if not name.isidentifier():
                raise ValueError(f"method name {name!r} must be an identifier (letters, digits, _), as claims "
                                 "refer to it")
        return methods


@dataclass
class SweepRun:
    """One run: its directory name, raw config and where it sits in the benchmark."""

    name: str
    raw: dict[str, Any]
    method: str = ""
    task: str = ""
    partition: str = ""
    seed: int = 0
    ceiling: bool = False
    tune_key: str | None = None

    @property
    def run_dir(self) -> Path:
        return Path(self.raw["output"]["run_dir"])


@dataclass
class TuneJob:
    """What one tune searches: a method's raw config in one task (and partition)."""

    method: str
    raw: dict[str, Any]


@dataclass
class Sweep:
    spec: SweepFile
    path: Path | None
    base: dict[str, Any]
    runs: list[SweepRun] = field(default_factory=list)
    tunes: dict[str, TuneJob] = field(default_factory=dict)

    @property
    def out_dir(self) -> Path:
        return Path(self.spec.out_dir)

    @property
    def is_benchmark(self) -> bool:
        return self.spec.results_dir is not None

    def results_dir(self) -> Path:
        folder = Path(self.spec.results_dir or ".")
        return folder if folder.is_absolute() or self.path is None else self.path.parent / folder

    def tune_dir(self, key: str) -> Path:
        return self.out_dir / "tune" / key


def judged_in(spec: SweepFile, claim: ClaimSpec, task: str, partition: str) -> bool:
    """Whether ``claim`` is judged in cell (``task``, ``partition``): one its ``where`` names (default every
    cell) and not one where it reads an excluded method (:func:`reads_excluded`)."""
    return (claim.where.get("task", task) == task and claim.where.get("partition", partition) == partition
            and not reads_excluded(spec, claim, task, partition))


def reads_excluded(spec: SweepFile, claim: ClaimSpec, task: str, partition: str) -> bool:
    """Whether ``claim``, judged in cell (``task``, ``partition``), reads a method in a cell where the file's
    ``exclude`` leaves out every seed of it: such a cell can never give it a verdict, so a claim is not judged
    there (FLASC's 20 arms left out of the iid cell need no ``where`` on each of their claims)."""
    excluded = _exclusions(spec)
    seeds = [str(seed) for seed in spec.seeds] or ["None"]
    for method, selector, _ in references(claim.check):
        if method == CEILING:
            continue
        read_task, read_partition = reference_cell(selector, task, partition)
        cell = {"task": read_task, "method": method, "partition": read_partition}
        if all(any(_selected({**cell, "seed": seed}, entry) for entry in excluded) for seed in seeds):
            return True
    return False


def _set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
        node[parts[-1]] = {**node[parts[-1]], **value}
    else:
        node[parts[-1]] = copy.deepcopy(value)


def _label(value: Any) -> str:
    if isinstance(value, dict):
        return "-".join(f"{k}{v}" for k, v in value.items())
    return str(value)


def load_sweep(path: Path) -> Sweep:
    if not path.is_file():
        raise ConfigError("SWEEP", f"file not found: {path}")
    return expand(yaml.safe_load(path.read_text()) or {}, path)


def expand(raw_file: dict[str, Any], sweep_path: Path | None = None) -> Sweep:
    """Every run of a sweep file (validated before any runs), and the tunes its runs wait for."""
    try:
        spec = SweepFile.model_validate(raw_file)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
        raise ConfigError(f"sweep.{where}", message) from None
    base = spec.base
    if isinstance(base, str):
        base_path = Path(base)
        if not base_path.is_file() and sweep_path is not None:
            base_path = sweep_path.parent / base
        if not base_path.is_file():
            raise ConfigError("sweep.base", f"config file not found: {base}")
        base = yaml.safe_load(base_path.read_text()) or {}
    sweep = Sweep(spec, sweep_path, apply_overrides(base, spec.set))
    _check_names(spec)
    tasks = spec.tasks or {"": {}}
    methods = spec.methods or {"": {}}
    partitions = spec.partitions or {"": {}}
    grid_keys = list(spec.grid)
    seeds: list[int | None] = list(spec.seeds) or [None]
    excluded = _exclusions(spec)
    # seed-major: a benchmark stopped early has every cell at the first seeds rather than some cells at all
    for seed in seeds:
        for task, method, partition in itertools.product(tasks, methods, partitions):
            cell = {"task": task, "method": method, "partition": partition, "seed": str(seed)}
            if any(_selected(cell, entry) for entry in excluded):
                continue
            for values in itertools.product(*(spec.grid[k] for k in grid_keys)):
                sweep.runs.append(_point(sweep, task, method, partition, dict(zip(grid_keys, values)), seed))
    if spec.ceiling is not None:
        if spec.ceiling.method not in spec.methods:
            raise ConfigError("sweep.ceiling.method", f"{spec.ceiling.method!r} is not one of sweep.methods")
        for task in tasks:
            for seed in spec.ceiling.seeds:
                sweep.runs.append(_ceiling_point(sweep, task, seed))
    for run in sweep.runs:
        build_config(run.raw)  # validate every point before running any
    _check_prune_after(sweep)
    return sweep


ONLY_KEYS = ("task", "method", "partition", "seed")


def _dimensions(spec: SweepFile) -> dict[str, set[str]]:
    """The names each of :data:`ONLY_KEYS` takes in the file (what ``--only`` and ``exclude`` may name)."""
    return {"task": set(spec.tasks), "method": set(spec.methods), "partition": set(spec.partitions),
            "seed": {str(s) for s in spec.seeds}}


def _exclusions(spec: SweepFile) -> list[dict[str, set[str]]]:
    """``exclude`` entries as ``--only`` selections: key -> the names it matches."""
    return [{key: {str(v) for v in (value if isinstance(value, list) else [value])} for key, value in entry.items()}
            for entry in spec.exclude]


def _selected(fields: dict[str, str], selection: dict[str, set[str]], keys: tuple[str, ...] = ONLY_KEYS) -> bool:
    """Whether a run's ``fields`` are in ``selection`` for each of ``keys`` (a key it leaves out matches all)."""
    return all(key not in selection or fields[key] in selection[key] for key in keys)


def _check_prune_after(sweep: Sweep) -> None:
    """``tune.prune_after`` must be a round every tune's trials reach (else ``fedpeft tune`` fails mid-sweep)."""
    tune = sweep.spec.tune
    if tune is None or tune.prune_after is None:
        return
    for key, job in sweep.tunes.items():
        rounds = tune.rounds or build_config(job.raw).rounds
        if tune.prune_after > rounds:
            raise ConfigError("sweep.tune.prune_after", f"{tune.prune_after} is past the last round of the {key} "
                              f"tune's trials ({rounds} rounds)")


def _check_names(spec: SweepFile) -> None:
    known = set(spec.methods)
    dimensions = _dimensions(spec)
    for index, entry in enumerate(spec.exclude):
        if not entry:
            raise ConfigError(f"sweep.exclude.{index}", "an empty entry would leave out every run")
        for key, value in entry.items():
            if value == []:
                raise ConfigError(f"sweep.exclude.{index}.{key}", "an empty list names nothing")
            for name in value if isinstance(value, list) else [value]:
                if str(name) not in dimensions[key]:
                    raise ConfigError(f"sweep.exclude.{index}.{key}", f"{name!r} is not one of the sweep's "
                                      f"{key}s ({', '.join(sorted(dimensions[key])) or 'none'})")
    for index, claim in enumerate(spec.claims):
        for method, _, _ in references(claim.check):
            if method == CEILING and spec.ceiling is None:
                raise ConfigError(f"sweep.claims.{index}.check", f"{method!r} reads the centralised ceiling, and "
                                  "the sweep has no ceiling: block")
            if method not in known and method != CEILING:
                raise ConfigError(f"sweep.claims.{index}.check", f"{method!r} is not one of sweep.methods")
        if claim.baseline is not None and claim.baseline not in known:
            raise ConfigError(f"sweep.claims.{index}.baseline", f"{claim.baseline!r} is not one of sweep.methods")
        if claim.gate and claim.baseline is None:
            raise ConfigError(f"sweep.claims.{index}.gate", "a gate cell needs the claim's baseline, whose run "
                              "there it reads")
        if "partition" in claim.gate:
            gate_partition = claim.gate["partition"]
            if gate_partition not in dimensions["partition"]:
                raise ConfigError(f"sweep.claims.{index}.gate.partition", f"{gate_partition!r} is not one of the "
                                  f"sweep's partitions ({', '.join(sorted(dimensions['partition'])) or 'none'})")
            seeds = [str(seed) for seed in spec.seeds] or ["None"]
            for task in spec.tasks or [""]:
                cell = {"task": task, "method": claim.baseline, "partition": gate_partition}
                if all(any(_selected({**cell, "seed": seed}, entry) for entry in _exclusions(spec)) for seed in seeds):
                    raise ConfigError(f"sweep.claims.{index}.gate.partition", f"exclude leaves the baseline "
                                      f"{claim.baseline!r} out of {gate_partition!r}, so the gate could never pass")
        cells = itertools.product(spec.tasks or [claim.where.get("task", "")],
                                  spec.partitions or [claim.where.get("partition", "")])
        if spec.exclude and not any(judged_in(spec, claim, task, partition) for task, partition in cells):
            raise ConfigError(f"sweep.claims.{index}.where", "every cell the claim applies to leaves out (sweep."
                              "exclude) a method its check reads there, so it could never be judged")
    if spec.tune is not None:
        for name in [*spec.tune.skip, *spec.tune.spaces, *spec.tune.inherit, *spec.tune.inherit.values(),
                     *spec.tune.grid]:
            if name not in known:
                raise ConfigError("sweep.tune", f"{name!r} is not one of sweep.methods")
        for name in spec.tune.grid:
            _check_grid(spec.tune, name)
        for name, source in spec.tune.inherit.items():
            if name in spec.tune.skip or name in spec.tune.spaces:
                raise ConfigError(f"sweep.tune.inherit.{name}", "a method that inherits tuned values is neither "
                                  "skipped nor given its own space")
            if source in spec.tune.inherit or source in spec.tune.skip:
                raise ConfigError(f"sweep.tune.inherit.{name}", f"{source!r} is not tuned itself (skipped or "
                                  "inheriting)")
        if spec.tune.partition is not None and spec.tune.partition not in spec.partitions:
            raise ConfigError("sweep.tune.partition", f"{spec.tune.partition!r} is not one of sweep.partitions")


def _grid(tune: TuneBlock, name: str) -> list[dict[str, Any]]:
    """The points of grid method ``name``'s space (:func:`fedpeft.tune.grid_points`), checked."""
    from fedpeft.tune import grid_points, parse_space

    where = f"sweep.tune.grid.{name}"
    space = tune.spaces.get(name, tune.space)
    if name in tune.skip or name in tune.inherit or space is None:
        raise ConfigError(where, "a grid method is tuned itself, over a space of choices in tune.spaces or tune.space")
    return grid_points(parse_space(space, where), tune.seed, where)


def _check_grid(tune: TuneBlock, name: str) -> None:
    where = f"sweep.tune.grid.{name}"
    points = _grid(tune, name)
    if len(points) > tune.trials:
        raise ConfigError(where, f"the grid has {len(points)} points, more than tune.trials ({tune.trials})")


def _fragment(sweep: Sweep, task: str, method: str, partition: str) -> dict[str, Any]:
    spec = sweep.spec
    raw = copy.deepcopy(sweep.base)
    for part in (spec.tasks.get(task, {}), spec.methods.get(method, {}), spec.partitions.get(partition, {})):
        raw = deep_merge(raw, part)
    if spec.tune is not None:  # every run trains without the validation split, tuned or not
        raw.setdefault("task", {})["validation_fraction"] = spec.tune.validation_fraction
    return raw


def _tune_key(sweep: Sweep, task: str, method: str, partition: str) -> str | None:
    tune = sweep.spec.tune
    if tune is None or method in tune.skip:
        return None
    method = tune.inherit.get(method, method)
    tuned_on = partition if tune.per == "cell" else tune.partition or next(iter(sweep.spec.partitions), "")
    key = "_".join(part for part in (task, tuned_on, method) if part)
    if key not in sweep.tunes:
        raw = _fragment(sweep, task, method, tuned_on)
        raw["seed"] = tune.seed
        sweep.tunes[key] = TuneJob(method, raw)
    return key


def _point(sweep: Sweep, task: str, method: str, partition: str, grid: dict[str, Any], seed: int | None
           ) -> SweepRun:
    raw = _fragment(sweep, task, method, partition)
    labels = [task, partition, method] if sweep.spec.methods or sweep.spec.tasks or sweep.spec.partitions else []
    for key, value in grid.items():
        _set_path(raw, key, value)
        if key != "seed":
            labels.append(_label(value))
    if "seed" in grid:
        seed = grid["seed"]
    if seed is not None:
        raw["seed"] = seed
    variant = "_".join(part for part in labels[2:] if part) if sweep.spec.methods else \
        "_".join(label for label in labels if label) or str(raw.get("method", "lora"))
    name = "_".join(part for part in labels if part) or str(raw.get("method", "lora"))
    if seed is not None:
        name += f"_seed{seed}"
    name = name.replace("/", "-")
    raw.setdefault("output", {}).update(run_dir=str(sweep.out_dir / name), progress=False)
    return SweepRun(name, raw, method=variant, task=task, partition=partition, seed=int(raw.get("seed", 0)),
                    tune_key=_tune_key(sweep, task, method, partition))


def _ceiling_point(sweep: Sweep, task: str, seed: int) -> SweepRun:
    ceiling = sweep.spec.ceiling
    assert ceiling is not None
    first_partition = next(iter(sweep.spec.partitions), "")
    raw = _fragment(sweep, task, ceiling.method, first_partition)
    raw = deep_merge(raw, ceiling.config)
    raw["partition"] = {"kind": "centralized"}
    raw["rounds"] = ceiling.rounds
    raw["seed"] = seed
    name = "_".join(part for part in (task, "centralized", ceiling.method) if part) + f"_seed{seed}"
    raw.setdefault("output", {}).update(run_dir=str(sweep.out_dir / name), progress=False)
    return SweepRun(name, raw, method=ceiling.method, task=task, partition="centralized", seed=seed, ceiling=True,
                    tune_key=_tune_key(sweep, task, ceiling.method, first_partition))


def tune_finished(sweep: Sweep, key: str) -> bool:
    """Whether the sweep's tune ``key`` has finished: its ``tune.json``, written last, is there."""
    return (sweep.tune_dir(key) / "tune.json").is_file()


def tuned_values(sweep: Sweep, key: str) -> dict[str, Any]:
    """The best values a finished tune chose (its ``tune.json``)."""
    path = sweep.tune_dir(key) / "tune.json"
    if not tune_finished(sweep, key):
        raise ConfigError("sweep.tune", f"the tune {key} has not finished ({path} is missing)")
    return dict(json.loads(path.read_text())["best_params"])


def tune_fingerprint(sweep: Sweep, key: str) -> str:
    """The fingerprint the sweep's tune ``key`` stamps on its study (:func:`fedpeft.tune.study_fingerprint`)."""
    from fedpeft.tune import parse_space, study_fingerprint

    tune = sweep.spec.tune
    assert tune is not None
    job = sweep.tunes[key]
    space = tune.spaces.get(job.method, tune.space)
    return study_fingerprint(job.raw, seed=tune.seed, space=None if space is None else parse_space(space, "sweep.tune"),
                             pruner=tune.pruner, rounds=tune.rounds, validation_fraction=tune.validation_fraction,
                             prune_after=tune.prune_after, include_defaults=tune.include_defaults,
                             grid=job.method in tune.grid, seeds=tune.seeds, score_rounds=tune.score_rounds)


def tune_trials(sweep: Sweep, key: str) -> int:
    """How many trials the sweep's tune ``key`` runs: the file's ``trials``, or a grid's size (a grid is cut
    to its points)."""
    tune = sweep.spec.tune
    assert tune is not None
    method = sweep.tunes[key].method
    return len(_grid(tune, method)) if method in tune.grid else tune.trials


def with_tuned(sweep: Sweep, run: SweepRun) -> dict[str, Any]:
    """The run's raw config with its method's tuned values (tuned values under the seed's)."""
    from fedpeft.tune import set_dotted

    raw = run.raw
    if run.tune_key is not None:
        for key, value in tuned_values(sweep, run.tune_key).items():
            raw = set_dotted(raw, key, value)
        if run.ceiling and sweep.spec.ceiling is not None:  # the ceiling's own fragment wins over tuned values
            raw = deep_merge(raw, sweep.spec.ceiling.config)
    return raw



def parse_only(items: list[str]) -> dict[str, set[str]]:
    """``--only KEY=V1,V2`` (repeatable) -> {key: values}; KEY is one of :data:`ONLY_KEYS`."""
    only: dict[str, set[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or key not in ONLY_KEYS or not values:
            raise ConfigError("--only", f"expected KEY=V1,V2 with KEY one of {', '.join(ONLY_KEYS)}, got {item!r}")
        only.setdefault(key, set()).update(v for v in values.split(",") if v)
    return only


def restrict(sweep: Sweep, only: dict[str, set[str]]) -> Sweep:
    """Keep the runs whose task, method, partition and seed are in ``only`` (a key left out keeps all), and
    the tunes they wait for: one cell of a large benchmark can run first and the rest later, into the same
    folder. A task's centralised ceiling stays with its task (its method, partition and seed are not filtered),
    so the cells that run can be judged. A name that matches nothing is an error, not an empty run."""
    spec = sweep.spec
    known = _dimensions(spec)
    for key, values in only.items():
        if unknown := sorted(values - known[key]):
            raise ConfigError("--only", f"{key} {', '.join(unknown)} not in the sweep file (it has "
                              f"{', '.join(sorted(known[key])) or 'none'})")

    def keep(run: SweepRun) -> bool:
        fields = {"task": run.task, "method": run.method, "partition": run.partition, "seed": str(run.seed)}
        return _selected(fields, only, ("task",) if run.ceiling else ONLY_KEYS)

    runs = [run for run in sweep.runs if keep(run)]
    needed = {run.tune_key for run in runs if run.tune_key is not None}
    return Sweep(spec, sweep.path, sweep.base, runs, {k: v for k, v in sweep.tunes.items() if k in needed})


def finished(run_dir: Path) -> bool:
    return (run_dir / SUMMARY).exists()


# ---------------------------------------------------------------------------------------------
# Execution: each tune and run is a subprocess of `fedpeft`, `workers` at a time


def _fedpeft(args: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("a") as handle:
        return subprocess.run([sys.executable, "-m", "fedpeft", *args], stdout=handle, stderr=subprocess.STDOUT,
                              env=env).returncode


def run_sweep(path: Path, workers: int = 1, data_dir: str | None = None,
              say: Callable[[str], None] = print, only: dict[str, set[str]] | None = None,
              device: str | None = None, allow_fewer: bool = False) -> Sweep:
    """Tune (once per method and task or cell) and run every seed and ceiling, each run once its own tune has
    finished (:func:`schedule`); skip what is done. ``only``: run just those cells (:func:`restrict`); the
    sweep returned is the whole file, so its report covers every run finished so far. ``device``: the
    ``engine.device`` of every tune and run started now (a committed benchmark on a GPU without editing its
    file; each run's summary records where it computed). A benchmark first gets back the committed records
    of its finished runs (:mod:`fedpeft.records`), so only what is not done runs; unless ``allow_fewer``, it
    refuses, before anything runs, where its report would drop a run its committed results report as finished
    (:func:`fedpeft.metrics.results.refuse_fewer_runs`), not at the report after hours of runs. Any sweep
    refuses where a tune or run finished on disk is no longer what the file asks for
    (:func:`fedpeft.records.stale_on_disk`): it would be skipped as done and reported as the file's."""
    whole = load_sweep(path)
    sweep = restrict(whole, only) if only else whole
    from fedpeft.records import bring_back

    bring_back(whole, say)
    if whole.is_benchmark and not allow_fewer:
        from fedpeft.metrics.results import refuse_fewer_runs

        refuse_fewer_runs(whole, running=sweep.runs)
    configs = sweep.out_dir / "configs"
    logs = sweep.out_dir / "logs"
    extra = ["--data-dir", data_dir] if data_dir else []

    def placed(raw: dict[str, Any]) -> dict[str, Any]:
        return raw if device is None else deep_merge(raw, {"engine": {"device": device}})

    def do_tune(key: str) -> None:
        if tune_finished(sweep, key):
            return
        tune = sweep.spec.tune
        assert tune is not None
        job = sweep.tunes[key]
        config = configs / f"tune_{key}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump(placed(job.raw), sort_keys=False))
        args = ["tune", str(config), "--trials", str(tune.trials), "--out", str(sweep.tune_dir(key)), "--seed",
                str(tune.seed), "--pruner", tune.pruner, "--validation-fraction", str(tune.validation_fraction),
                "--include-defaults" if tune.include_defaults else "--no-include-defaults",
                *(["--grid"] if job.method in tune.grid else [])]
        space = tune.spaces.get(job.method, tune.space)
        if space is not None:
            space_file = configs / f"space_{key}.yaml"
            space_file.write_text(yaml.safe_dump(space))
            args += ["--space", str(space_file)]
        if tune.rounds is not None:
            args += ["--rounds", str(tune.rounds)]
        if tune.prune_after is not None:
            args += ["--prune-after", str(tune.prune_after)]
        if tune.seeds is not None:
            args += ["--seeds", ",".join(map(str, tune.seeds))]
        if tune.score_rounds != 1:
            args += ["--score-rounds", str(tune.score_rounds)]
        code = _fedpeft(args + extra, logs / f"tune_{key}.log")
        say(f"tune {key}: " + ("done" if code == 0 else f"failed (see {logs / f'tune_{key}.log'})"))

    def do_run(run: SweepRun) -> None:
        if finished(run.run_dir):
            return
        try:
            raw = placed(with_tuned(sweep, run))
        except ConfigError as err:
            say(f"{run.name}: skipped ({err})")
            return
        config = configs / f"{run.name}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump(raw, sort_keys=False))
        resume = (run.run_dir / CONFIG).exists() or (run.run_dir / CHECKPOINT).exists()
        args = ["run", str(config), *(["--resume", str(run.run_dir)] if resume else ["--run-dir", str(run.run_dir)])]
        code = _fedpeft(args + extra, logs / f"{run.name}.log")
        say(f"{run.name}: " + ("done" if code == 0 else f"failed (see {logs / f'{run.name}.log'})"))

    schedule(sweep, workers, do_tune, do_run)
    return whole


def schedule(sweep: Sweep, workers: int, do_tune: Callable[[str], None], do_run: Callable[[SweepRun], None]) -> None:
    """Run every tune and run, ``workers`` at a time. Tunes start first (they are the long poles);
    a worker with no tune left to start takes the first run (in the sweep's seed-major order) whose
    own tune has finished, so a run never waits for another method's tune, and no worker idles
    while one method is still tuning and another's runs are ready."""
    tunes, runs, workers = sorted(sweep.tunes), list(sweep.runs), max(1, workers)
    tuned: set[str] = set()
    in_flight: dict[Future[None], str | None] = {}  # -> the tune's key (None: a run)

    def next_job() -> tuple[Callable[[], None], str | None] | None:
        if tunes:
            key = tunes.pop(0)
            return partial(do_tune, key), key
        for index, run in enumerate(runs):
            if run.tune_key is None or run.tune_key not in sweep.tunes or run.tune_key in tuned:
                return partial(do_run, runs.pop(index)), None
        return None

    with ThreadPoolExecutor(max_workers=workers) as pool:
        while True:
            while len(in_flight) < workers and (job := next_job()) is not None:
                in_flight[pool.submit(job[0])] = job[1]
            if not in_flight:
                return
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                key = in_flight.pop(future)
                future.result()
                if key is not None:
                    tuned.add(key)  # finished or failed: its runs go ahead (a failed tune's runs say why they skip)

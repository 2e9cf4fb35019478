"""``fedpeft tune``: a federated search of a recipe's hyperparameters on a validation split.

Each trial is a whole federated run of the config with sampled values (client learning rate,
server learning rate, ...) on the training data minus a **validation split** carved from it
(``task.validation_fraction``, 0.1 unless the config has a split already): the trial scores the
validation split after every round and never looks at the eval split, which stays for reporting.
The objective is the validation metric after the last round (the value the run ends with, not
its luckiest round); ``score_rounds`` k averages it over the last k rounds, and ``seeds`` runs every
trial once per seed (each seed its own partition, split and initialisation) and averages over them.
Both exist for an lr at the edge of stability: on QQP under Dirichlet(0.5) (``federa_qqp.yaml``'s
notes) LoRA at lr 0.174 swings between the two classes from round to round on two of three seeds'
partitions, and a one-partition, last-round score chose it over a steady 5e-2 (0.695 against 0.620 on
seed 0); over three partitions the last round ties (0.638 / 0.637) and the last 3 rounds pick 5e-2
(0.646 against 0.605). The pruner hears the first seed's rounds only.

Search: Optuna's TPE sampler, reseeded for every trial from (``seed``, trial number), so the same
seed gives the same trials, also across a resume. Bad trials stop early: after each round the
validation metric is reported to a pruner, and a trial whose training loss is not finite, or a
client of which sends NaN/Inf, stops at once. The median pruner (default) stops a trial whose best
validation value so far is below the median of the finished trials at the same round by more than
the validation split's noise, ``1 / sqrt(n)`` for ``n`` validation examples (two binomial standard
errors at 0.5); successive halving is the alternative. Either judges a trial only from round
``prune_after`` on (default: half the rounds). Both guards come from measurements on the short-run
SST-2 setting (200 validation sentences): runs on label-skewed clients sit at the majority class
for their first rounds, so judged from round 1 the LoRA tune stopped lr 8.7e-4 after round 2
beside the 9.6e-4 that went on to 0.79; judged from round 5 with Optuna's plain median it stopped
lr 1.6e-3 at round 7 while it stood at 0.815, above where both finished trials ended (0.79, 0.78).

Everything lives in ``TUNE_DIR``: Optuna's SQLite storage
(``study.db``), one run directory per trial (``trials/NNN``), ``trials.csv``, ``trials.png`` and
``best.yaml``, the full config with the chosen values, runnable as is (``fedpeft run
best.yaml``). A killed tune resumes where it stopped: the trial that was running is retried with
the same values from its last checkpoint, so at most its current round is lost.

The search space is the recipe's own (``tune:`` in its YAML, see :mod:`fedpeft.recipes`: the
client lr log-uniform, and the server lr where the strategy steps with one); a ``--space`` YAML of
``dotted.key: {low, high, log}`` (or ``{choices: [...]}``, ``type: int``) replaces it. ``fedpeft
tune`` spends its first trial on the config's own values (``--no-include-defaults`` leaves every
trial to the sampler), so its choice never scored below the config it started from on validation;
without it a tune is only as good as its draws. ``--grid`` runs every combination of a space of
choices once instead (a paper's "picked from these five values"; FLASC App. B, Figs. 7-8), in an
order shuffled by the seed, so the pruner sees no systematic order; its trial count is the grid's.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import hashlib
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedpeft.config import ConfigError, ExperimentConfig, build_config
from fedpeft.metrics.summary import ADJUSTED_LOSS, CLASSIFIED, learned_level
from fedpeft.metrics.task_metrics import constant_score
from fedpeft.seeding import derive_seed, rng_for

DEFAULT_VALIDATION_FRACTION = 0.1
STUDY = "fedpeft-tune"


class ParamSpec(BaseModel):
    """One searched value: a float or int range (``log`` for a log-uniform draw) or a list of choices."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["float", "int", "categorical"] = "float"
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _bounds(self) -> ParamSpec:
        if self.choices is not None:
            if self.type == "float" and self.low is None and self.high is None:
                self.type = "categorical"
            if self.type != "categorical" or not self.choices:
                raise ValueError("choices need a non-empty list and no low/high")
            return self
        if self.type == "categorical":
            raise ValueError("a categorical value needs choices")
        if self.low is None or self.high is None:
            raise ValueError("needs low and high (or choices)")
        if not self.low < self.high:
            raise ValueError(f"empty or inverted range: low {self.low} must be below high {self.high}")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs low > 0, got {self.low}")
        if self.type == "int" and not (float(self.low).is_integer() and float(self.high).is_integer()):
            raise ValueError("an int range needs whole bounds")
        return self

    def suggest(self, trial: Any, name: str) -> Any:
        if self.type == "categorical":
            return trial.suggest_categorical(name, self.choices)
        if self.type == "int":
            return trial.suggest_int(name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(name, self.low, self.high, log=self.log)

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is one this spec can draw (a choice, or inside the range)."""
        if self.type == "categorical":
            return value in (self.choices or [])
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        assert self.low is not None and self.high is not None
        return self.low <= value <= self.high and (self.type != "int" or float(value).is_integer())

    def extremes(self) -> list[Any]:
        """Values at the edges of the space, to validate before any training."""
        if self.type == "categorical":
            return list(self.choices or [])
        cast = int if self.type == "int" else float
        return [cast(self.low), cast(self.high)]


Space = dict[str, ParamSpec]


def parse_space(raw: Any, source: str) -> Space:
    """A space from a mapping ``dotted.key -> spec`` (errors name ``source.key``)."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(source, "expected a non-empty mapping of dotted config keys to {low, high, log} or "
                                  "{choices: [...]}")
    space = {}
    for key, spec in raw.items():
        try:
            space[str(key)] = ParamSpec.model_validate(spec if isinstance(spec, dict) else {"choices": spec})
        except ValidationError as err:
            first = err.errors()[0]
            raise ConfigError(f"{source}.{key}", first["msg"].removeprefix("Value error, ")) from None
    return space


def load_space(path: str | Path) -> Space:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--space", f"file not found: {path}")
    return parse_space(yaml.safe_load(path.read_text()), "space")


def default_space(cfg: ExperimentConfig) -> Space:
    """The recipe's own ``tune:`` space. Every recipe carries one: a space derived from the defaults
    (a decade either side) held only collapsing values for the released HetLoRA."""
    from fedpeft.recipes import RECIPES

    return parse_space(RECIPES[cfg.method].tune, f"recipes/{cfg.method}.yaml tune")


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of ``raw`` with ``dotted`` set to ``value`` (sections created as needed)."""
    out = copy.deepcopy(raw)
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value
    return out


_MISSING = object()


def _get_dotted(dumped: dict[str, Any], dotted: str) -> Any:
    node: Any = dumped
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def config_values(cfg: ExperimentConfig, space: Space) -> dict[str, Any]:
    """The config's own value of each searched key, where the space can draw it (a recipe's defaults
    lie inside its own space; a value outside a user's space is left to the sampler)."""
    dumped = cfg.model_dump(mode="json")
    return {key: value for key, spec in space.items()
            if (value := _get_dotted(dumped, key)) is not _MISSING and spec.contains(value)}


def check_space(space: Space, raw: dict[str, Any], source: str = "space") -> None:
    """Every key names a value of the resolved config, and the config is valid at every edge."""
    dumped = build_config(raw).model_dump(mode="json")
    for key, spec in space.items():
        if _get_dotted(dumped, key) is _MISSING:
            raise ConfigError(f"{source}.{key}", "unknown config key (not a field of the resolved config)")
        for value in spec.extremes():
            try:
                build_config(set_dotted(raw, key, value))
            except ConfigError as err:
                raise ConfigError(f"{source}.{key}", f"the value {value!r} is not allowed: {err}") from None


def tuning_config(raw: dict[str, Any], rounds: int | None = None,
                  validation_fraction: float | None = None) -> dict[str, Any]:
    """The base of every trial: a validation split (the config's own, else ``validation_fraction``,
    else 10%), scored alone after every round, and optionally another number of rounds."""
    out = copy.deepcopy(raw)
    task = out.setdefault("task", {})
    if validation_fraction is not None:
        task.pop("validation_file", None)
        task["validation_fraction"] = validation_fraction
    elif task.get("validation_fraction") is None and task.get("validation_file") is None:
        task["validation_fraction"] = DEFAULT_VALIDATION_FRACTION
    if rounds is not None:
        out["rounds"] = rounds
    out.setdefault("engine", {})["kind"] = "local"
    # the pruner needs the validation metric of every round; the untrained model's is not needed
    out.setdefault("evaluation", {}).update(splits=["validation"], every=1, at_start=False)
    out.setdefault("output", {}).update(progress=False, run_dir=None)
    return out


@dataclass
class TuneResult:
    best_params: dict[str, Any]
    best_value: float
    best_config: Path
    trials: int
    metric: str


class _NonFinite(Exception):
    """A trial's training diverged (its loss is NaN or infinite)."""


def _pruner(kind: str, prune_after: int) -> Any:
    """The study's pruner; it may stop a trial from round ``prune_after`` on, never before."""
    import optuna
    from optuna.trial import TrialState

    class MedianBeyondNoise(optuna.pruners.BasePruner):
        """Stop a trial whose best value is below the finished trials' median at this round by more
        than its ``noise`` user attribute (the validation metric's noise, set by the trial)."""

        def prune(self, study: Any, trial: Any) -> bool:
            step = trial.last_step
            if step is None or step < prune_after:
                return False
            finished = [t.intermediate_values[step] for t in study.get_trials(deepcopy=False,
                                                                                states=(TrialState.COMPLETE,))
                        if step in t.intermediate_values]
            if len(finished) < 2:
                return False
            best = max(trial.intermediate_values.values())
            return bool(best + trial.user_attrs.get("noise", 0.0) < statistics.median(finished))

    if kind == "median":
        return MedianBeyondNoise()
    if kind == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=prune_after, reduction_factor=3)
    return optuna.pruners.NopPruner()


def _fingerprint(base: dict[str, Any], space: Space, seed: int, pruner: str, prune_after: int,
                 include_defaults: bool, grid: bool = False, seeds: list[int] | None = None,
                 score_rounds: int = 1) -> str:
    resolved = build_config(base).model_dump(mode="json")
    resolved.pop("output")
    resolved["engine"]["device"] = "auto"  # where trials compute is not the study: a CPU tune resumes on a GPU
    blob = {"config": resolved, "space": {k: v.model_dump() for k, v in space.items()}, "seed": seed,
            "pruner": pruner, "prune_after": prune_after}
    if grid:  # a grid has no defaults trial, whatever include_defaults says
        blob["grid"] = True
    elif include_defaults:  # only when on, so the studies made before the option still match
        blob["include_defaults"] = True
    if seeds is not None:  # likewise: only away from the default objective
        blob["seeds"] = list(seeds)
    if score_rounds != 1:
        blob["score_rounds"] = score_rounds
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def _study_setup(raw: dict[str, Any], rounds: int | None, validation_fraction: float | None, space: Space | None,
                 prune_after: int | None, seeds: list[int] | None = None,
                 score_rounds: int = 1) -> tuple[dict[str, Any], ExperimentConfig, Space, int]:
    """The trials' config, its space and first judged round, checked: what a study is of."""
    base = tuning_config(raw, rounds, validation_fraction)
    cfg = build_config(base)
    space = space if space is not None else default_space(cfg)
    check_space(space, base)
    prune_after = max(1, cfg.rounds // 2) if prune_after is None else prune_after
    if not 1 <= prune_after <= cfg.rounds:
        raise ConfigError("--prune-after", f"must be a round from 1 to the trial's {cfg.rounds} rounds, "
                          f"got {prune_after}")
    if not 1 <= score_rounds <= cfg.rounds:
        raise ConfigError("--score-rounds", f"must be from 1 to the trial's {cfg.rounds} rounds, got {score_rounds}")
    if seeds is not None and (not seeds or len(set(seeds)) < len(seeds)):
        raise ConfigError("--seeds", f"must name at least one seed, each once; got {seeds}")
    return base, cfg, space, prune_after


def study_fingerprint(raw: dict[str, Any], *, seed: int = 0, space: Space | None = None,
                      pruner: Literal["median", "halving", "none"] = "median", rounds: int | None = None,
                      validation_fraction: float | None = None, prune_after: int | None = None,
                      include_defaults: bool = False, grid: bool = False, seeds: list[int] | None = None,
                      score_rounds: int = 1) -> str:
    """What :func:`tune` with these arguments stamps on its study (and refuses to resume under another)."""
    base, _, space, prune_after = _study_setup(raw, rounds, validation_fraction, space, prune_after, seeds,
                                               score_rounds)
    return _fingerprint(base, space, seed, pruner, prune_after, include_defaults, grid, seeds, score_rounds)


def grid_points(space: Space, seed: int, source: str = "--grid") -> list[dict[str, Any]]:
    """Every combination of a space of choices, in an order shuffled by ``seed``; a range is an error
    (a grid has no points in it)."""
    if ranges := [key for key, spec in space.items() if spec.type != "categorical"]:
        raise ConfigError(source, f"a grid needs {{choices: [...]}} for every key; {', '.join(ranges)} is a range")
    for key, spec in space.items():
        if len(set(map(repr, spec.choices or []))) < len(spec.choices or []):
            raise ConfigError(f"{source}.{key}", f"a grid tries each choice once; {spec.choices} repeats one")
    keys = sorted(space)
    points = [dict(zip(keys, values, strict=True))
              for values in itertools.product(*(space[key].choices or [] for key in keys))]
    return [points[index] for index in rng_for(seed, "grid").permutation(len(points))]


def saved_fingerprint(study_db: Path) -> str | None:
    """The fingerprint a study file was made under (None where it holds no study)."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(f"file:{study_db}?mode=ro", uri=True)) as db:
        try:
            row = db.execute("SELECT value_json FROM study_user_attributes WHERE key = 'fingerprint'").fetchone()
        except sqlite3.DatabaseError:
            return None
    return None if row is None else str(json.loads(row[0]))


def tune(raw: dict[str, Any], tune_dir: Path, trials: int, *, seed: int = 0, space: Space | None = None,
         pruner: Literal["median", "halving", "none"] = "median", rounds: int | None = None,
         validation_fraction: float | None = None, prune_after: int | None = None,
         include_defaults: bool = False, grid: bool = False, seeds: list[int] | None = None,
         score_rounds: int = 1, data_dir: str | None = None, console: Console | None = None) -> TuneResult:
    """Run (or resume) a study of ``trials`` trials of the config ``raw`` in ``tune_dir``.

    ``prune_after``: the first round at which the pruner may stop a trial (default: half the rounds).
    ``include_defaults``: trial 0 runs the config's own values (:func:`config_values`; one of the
    ``trials``), so the tune never picks anything that scored below them on validation. Off here and in
    sweep files (the committed benchmarks' tunes drew without it); ``fedpeft tune`` turns it on.
    ``grid``: one trial per combination of the space's choices (:func:`grid_points`), no sampler and no
    trial at the defaults; ``trials`` above the grid's size is cut to it, below it is an error (a grid
    left part-tried is not the grid). ``seeds`` / ``score_rounds``: the objective averaged over these
    seeds' runs (the config's ``seed`` replaced; run directories ``trials/NNN/seedS``) and over each
    run's last ``score_rounds`` rounds (module docstring).
    """
    import optuna

    console = console or Console()
    if trials < 1:
        raise ConfigError("--trials", f"must be at least 1, got {trials}")
    base, cfg, space, prune_after = _study_setup(raw, rounds, validation_fraction, space, prune_after, seeds,
                                                 score_rounds)
    points = grid_points(space, seed) if grid else []
    if grid:
        if trials < len(points):
            raise ConfigError("--trials", f"the grid has {len(points)} points; {trials} trials would leave "
                              f"{len(points) - trials} untried")
        trials, include_defaults = len(points), False
    tune_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(base, space, seed, pruner, prune_after, include_defaults, grid, seeds, score_rounds)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=f"sqlite:///{tune_dir / 'study.db'}", study_name=STUDY,
                                direction="maximize", pruner=_pruner(pruner, prune_after), load_if_exists=True)
    saved = study.user_attrs.get("fingerprint")
    if saved is None:
        study.set_user_attr("fingerprint", fingerprint)
        study.set_user_attr("space", {k: v.model_dump() for k, v in space.items()})
    elif saved != fingerprint:
        raise ConfigError("TUNE_DIR", f"{tune_dir} holds the study of another config, space, seed, pruner "
                          "or --include-defaults; use another --out (or delete it)")
    if include_defaults and not study.trials and (start := config_values(cfg, space)):
        study.enqueue_trial(start, user_attrs={"note": "the config's own values"})
    _retry_interrupted(study)
    if grid:
        _queue_untried(study, points)
    metric_holder: dict[str, str] = {}
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, disable=not raw.get("output", {}).get("progress", True))
    with progress:
        done = _counted(study)
        trial_bar = progress.add_task("trials", total=trials, completed=done)
        round_bar = progress.add_task("rounds", total=cfg.rounds * len(seeds or [None]))
        while done < trials:
            # seeded by how many trials are done, so a resumed study draws what an uninterrupted one would
            study.sampler = optuna.samplers.TPESampler(seed=derive_seed(seed, "tune", done) % 2**32,
                                                       n_startup_trials=max(2, min(5, trials // 2)))
            trial = study.ask()
            run_dir = Path(trial.user_attrs.get("run_dir") or tune_dir / "trials" / f"{trial.number:03d}")
            trial.set_user_attr("run_dir", str(run_dir))
            params = {key: spec.suggest(trial, key) for key, spec in space.items()}
            progress.update(trial_bar, description=f"trial {trial.number}")
            progress.reset(round_bar, total=cfg.rounds * len(seeds or [None]))
            started = time.perf_counter()
            state, value, reason = _run_seeds(trial, base, params, run_dir, data_dir, metric_holder,
                                              lambda: progress.advance(round_bar), seeds, score_rounds)
            trial.set_user_attr("seconds", time.perf_counter() - started)
            if reason:
                trial.set_user_attr("note", "; ".join(filter(None, [trial.user_attrs.get("note"), reason])))
            if state == "complete":
                study.tell(trial, value)
            elif state == "pruned":
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            else:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            shown = ", ".join(f"{k}={_short(v)}" for k, v in params.items())
            console.print(f"trial {trial.number}: {shown} -> {state}"
                          + (f" {metric_holder.get('name', 'metric')} {value:.4f}" if value is not None else "")
                          + (f" ({reason})" if reason else ""))
            done = _counted(study)
            progress.update(trial_bar, completed=done)
    return _write_outputs(study, base, raw, space, tune_dir, metric_holder.get("name"), console)


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _counted(study: Any) -> int:
    """Trials that used budget: finished ones, not the interrupted ones that were retried."""
    from optuna.trial import TrialState

    return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
               and not t.user_attrs.get("retried") for t in study.trials)


def _retry_interrupted(study: Any) -> None:
    """A trial left RUNNING by a killed tune is marked failed (not counted) and queued again with
    the same values and run directory, so it resumes from its checkpoint."""
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        storage = study._storage
        storage.set_trial_user_attr(trial._trial_id, "retried", True)
        storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        kept = {key: value for key, value in trial.user_attrs.items() if key in ("run_dir", "note")}
        study.enqueue_trial(_values(trial), user_attrs=kept, skip_if_exists=False)


def _values(trial: Any) -> dict[str, Any]:
    """A trial's values: those drawn so far over those it was queued with (a trial killed before drawing
    holds them only as the queue's fixed values)."""
    return {**trial.system_attrs.get("fixed_params", {}), **trial.params}


def _queue_untried(study: Any, points: list[dict[str, Any]]) -> None:
    """Queue each grid point that no counted trial ran and no queued trial holds: a tune killed while it
    queued the grid, or between taking a point and drawing its values, still tries every point once."""
    from optuna.trial import TrialState

    def key(values: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted(values.items()))

    held = {key(_values(t)) for t in study.get_trials(deepcopy=False)
            if not t.user_attrs.get("retried") and t.state != TrialState.RUNNING}
    for point in points:
        if key(point) not in held:
            study.enqueue_trial(point)


def _run_seeds(trial: Any, base: dict[str, Any], params: dict[str, Any], run_dir: Path, data_dir: str | None,
               metric_holder: dict[str, str], advance: Callable[[], None], seeds: list[int] | None,
               score_rounds: int) -> tuple[str, float | None, str]:
    """Run one trial, once per seed (``seeds`` None: once, at the config's own); (state, objective, reason).
    The objective is the mean of the seeds' scores; a seed that is pruned or fails ends the trial so."""
    if seeds is None:
        return _run_trial(trial, base, params, run_dir, data_dir, metric_holder, advance, score_rounds)
    scores = []
    for index, seed in enumerate(seeds):
        state, value, reason = _run_trial(trial, {**base, "seed": seed}, params, run_dir / f"seed{seed}", data_dir,
                                          metric_holder, advance, score_rounds, report=index == 0)
        if state != "complete" or value is None:
            return state, None, f"seed {seed}: {reason}"
        scores.append(value)
    trial.set_user_attr("seed_scores", scores)
    return "complete", statistics.fmean(scores), ""


def _run_trial(trial: Any, base: dict[str, Any], params: dict[str, Any], run_dir: Path, data_dir: str | None,
               metric_holder: dict[str, str], advance: Callable[[], None], score_rounds: int = 1,
               report: bool = True) -> tuple[str, float | None, str]:
    """Run one trial; (state, objective, reason). Reports each round's validation metric to the pruner
    (``report``); the objective is the mean over the last ``score_rounds`` rounds' validation values."""
    import optuna

    from fedpeft.engines.local import LocalEngine
    from fedpeft.experiment import prepare
    from fedpeft.federated.validation import NON_FINITE, RoundFailed
    from fedpeft.metrics.recorder import CONFIG

    raw = copy.deepcopy(base)
    for key, value in params.items():
        raw = set_dotted(raw, key, value)
    raw["output"]["run_dir"] = str(run_dir)
    try:
        cfg = build_config(raw)
        exp = prepare(cfg, data_dir)
    except ConfigError as err:
        return "failed", None, str(err)
    metric = exp.task.primary_metric
    metric_holder["name"] = f"validation {metric}"
    if exp.validation_data is not None and exp.task.problem_type in CLASSIFIED:
        trial.set_user_attr("constant", constant_score(metric, exp.validation_data.labels))
        trial.set_user_attr("metric", metric)
        trial.set_user_attr("validation_examples", len(exp.validation_data))
    trial.set_user_attr("noise", 1 / math.sqrt(max(1, len(exp.task.validation))))
    resume = (run_dir / CONFIG).exists()  # a retried trial continues from its checkpoint (or round 1)
    engine = LocalEngine(exp, run_dir, Console(quiet=True))
    reported: set[int] = set()

    def on_round(record: dict[str, Any]) -> None:
        advance()
        for done in engine.recorder.records if report else ():  # after a resume: the rounds before the kill, too
            value = done.get("validation", {}).get(metric)
            if value is not None and done["round"] > 0 and done["round"] not in reported:
                trial.report(value, done["round"])
                reported.add(done["round"])
        if not math.isfinite(record["train_loss"]):
            raise _NonFinite(f"training loss {record['train_loss']} in round {record['round']}")
        if any(NON_FINITE in failure["reason"] for failure in record.get("failures", [])):
            raise _NonFinite(f"a client's update held NaN or Inf in round {record['round']}")
        if report and trial.should_prune():
            raise optuna.TrialPruned()

    try:
        records = engine.run(resume=resume, on_round=on_round)
    except optuna.TrialPruned:
        return "pruned", None, f"pruned after round {len(reported)}"
    except (_NonFinite, RoundFailed) as err:
        return "pruned", None, f"diverged: {err}"
    values = [r["validation"][metric] for r in records if r["round"] > 0 and metric in r.get("validation", {})]
    if not values:
        return "failed", None, "no validation metric was recorded"
    if report:
        trial.set_user_attr("best_round_value", max(values))
    return "complete", float(statistics.fmean(values[-score_rounds:])), ""


def _write_outputs(study: Any, base: dict[str, Any], raw: dict[str, Any], space: Space, tune_dir: Path,
                   metric: str | None, console: Console) -> TuneResult:
    from optuna.trial import TrialState

    trials = [t for t in study.trials if not t.user_attrs.get("retried")]
    _write_csv(trials, space, tune_dir / "trials.csv")
    _plot(trials, space, tune_dir / "trials.png", metric or "validation metric")
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if not complete:
        raise ConfigError("--trials", f"no trial completed (see {tune_dir / 'trials.csv'}): widen the space or "
                          "raise --trials")
    best = max(complete, key=lambda t: (t.value, -t.number))
    chosen = copy.deepcopy(raw)
    task = chosen.setdefault("task", {})
    for key in ("validation_fraction", "validation_file"):  # train the final run on exactly the tuned data
        task[key] = base["task"].get(key)
    for key, value in best.params.items():
        chosen = set_dotted(chosen, key, value)
    chosen.setdefault("output", {})["run_dir"] = None
    cfg = build_config(chosen)
    path = tune_dir / "best.yaml"
    header = (f"# fedpeft tune: best of {len(trials)} trials ({metric} {best.value:.4f} at the last round, trial "
              f"{best.number}); chosen: " + ", ".join(f"{k}={_short(v)}" for k, v in best.params.items()) + "\n")
    path.write_text(header + cfg.to_yaml())
    summary = {"best_params": best.params, "best_value": best.value, "best_trial": best.number, "metric": metric,
               "trials": len(trials), "complete": len(complete),
               "pruned": sum(t.state == TrialState.PRUNED for t in trials),
               "failed": sum(t.state == TrialState.FAIL for t in trials),
               "seconds": sum(t.user_attrs.get("seconds", 0.0) for t in trials),
               "space": {k: v.model_dump() for k, v in space.items()},
               "fingerprint": study.user_attrs.get("fingerprint")}  # what a sweep checks a kept tune against
    summary["not_learned"] = _not_learned(best, metric or "metric")
    from fedpeft.metrics.recorder import atomic_write_bytes

    atomic_write_bytes(tune_dir / "tune.json", json.dumps(summary, indent=2).encode())  # a sweep's "finished" mark
    console.print(f"best {metric} {best.value:.4f} with " + ", ".join(f"{k}={_short(v)}" for k, v in
                                                                     best.params.items()) + f"; config: {path}")
    if summary["not_learned"]:
        console.print(f"[yellow]no trial learned:[/] {summary['not_learned']}")
    return TuneResult(best.params, float(best.value), path, len(trials), metric or "")


def _not_learned(best: Any, metric: str) -> str | None:
    """Why the best trial has not learned, or None. On a classification task: scored by accuracy, no better
    than always answering the validation split's most frequent class (with its noise); scored by F1,
    macro-F1 or Matthews, no better than the best one-class answer (``task_metrics.constant_score``).
    Otherwise (exact match, ROUGE, Pearson, all higher-is-better): at or below 0, the score of a model that
    finds nothing right (trials are not scored untrained, so 0 is the only level known)."""
    constant, examples = best.user_attrs.get("constant"), best.user_attrs.get("validation_examples") or 0
    level, kind = learned_level(best.user_attrs.get("metric", ""), constant, examples)
    if best.value > level:
        return None
    if kind == "majority":
        reference = (f"always answering the validation split's most frequent class scores {constant:.3f} "
                     f"({level:.3f} with its noise over {examples} examples)")
    elif kind == "one_class":
        reference = f"answering one class for every validation example scores {level:.3f}"
    else:
        reference = "0 is what a model that has learned nothing scores"
    return (f"the best trial ({best.number}) ends at {metric} {best.value:.3f}, and {reference}. best.yaml holds "
            "it all the same; before running it, widen the space (--space), give the trials more rounds, or on "
            f"label-skewed clients try {ADJUSTED_LOSS} or more clients per round")


def _write_csv(trials: list[Any], space: Space, path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["trial", "state", "value", *space, "rounds_reported", "seconds", "run_dir", "note"])
        for t in trials:
            writer.writerow([t.number, t.state.name.lower(), "" if t.value is None else f"{t.value:.6f}",
                             *(t.params.get(k, "") for k in space), len(t.intermediate_values),
                             f"{t.user_attrs.get('seconds', 0.0):.1f}", t.user_attrs.get("run_dir", ""),
                             t.user_attrs.get("note", "")])


def _plot(trials: list[Any], space: Space, path: Path, metric: str) -> None:
    """Left: each trial's objective (pruned: its last reported value) and the running best;
    right: the objective against the first searched value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.trial import TrialState

    def shown(t: Any) -> float | None:
        if t.value is not None:
            return t.value
        return t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None

    points = [(t, shown(t)) for t in trials if shown(t) is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for state, marker, label in ((TrialState.COMPLETE, "o", "complete"), (TrialState.PRUNED, "x", "pruned")):
        chosen = [(t.number, v) for t, v in points if t.state == state]
        if chosen:
            axes[0].scatter(*zip(*chosen), marker=marker, label=label)
    best, running = float("-inf"), []
    for t in trials:
        if t.state == TrialState.COMPLETE:
            best = max(best, t.value)
        running.append((t.number, best if best > float("-inf") else math.nan))
    if running:
        axes[0].step(*zip(*running), where="post", color="black", linewidth=1, label="best so far")
    axes[0].set(xlabel="trial", ylabel=metric, title="trials")
    axes[0].legend(fontsize=8)
    key = next(iter(space))
    for state, marker in ((TrialState.COMPLETE, "o"), (TrialState.PRUNED, "x")):
        chosen = [(t.params[key], v) for t, v in points if t.state == state and key in t.params]
        if chosen:
            axes[1].scatter(*zip(*chosen), marker=marker)
    if space[key].log:
        axes[1].set_xscale("log")
    axes[1].set(xlabel=key, ylabel=metric, title=f"{metric} vs {key}")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

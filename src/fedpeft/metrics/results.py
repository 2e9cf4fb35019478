"""A benchmark's results: the SPEC-format JSON, a markdown report with a verdict per claim, figures.

Rows: one per (task, partition, method, seed) with the SPEC's fields; ``summary`` aggregates the
seeds (mean, std, 95% interval; :func:`fedpeft.metrics.compare.aggregate_seeds`), ``ceilings``
holds the centralised runs, ``claims`` each claim's verdict per cell (:mod:`fedpeft.claims`),
``tuning`` what each method's tune chose. Every file starts with the command that made it.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fedpeft.claims import (
    CEILING,
    CEILING_FRACTION,
    NOT_REACHED,
    QUANTITIES,
    Interval,
    Judgement,
    Lookup,
    Missing,
    gate,
    judge,
    judge_paired,
    reference_cell,
    references,
    row_interval,
)
from fedpeft.config import ConfigError
from fedpeft.metrics.compare import Bandwidth, Run, aggregate_seeds, load_run, mark_noise, run_row
from fedpeft.metrics.report import band, bytes_axis, flatten, metric_cell
from fedpeft.metrics.summary import human_bytes, majority_level
from fedpeft.records import stale_runs, write_records
from fedpeft.sweep import Sweep, SweepRun, judged_in

SPEC_FIELDS = ("task", "partition", "method", "recipe", "seed", "rounds", "clients", "clients_per_round", "metric",
               "eval_examples", "best_metric", "final_metric", "start_metric", "trainable_params",
               "uplink_bytes_per_client_round", "downlink_bytes_per_client_round", "total_bytes", "target",
               "rounds_to_target", "bytes_to_target", "simulated_seconds_to_target", "wall_seconds",
               "client_flops_per_step", "majority_rate",
               # beyond the SPEC's list: what claims read seed by seed, so a verdict can be re-judged from the
               # file alone, and where each run computed (a benchmark's runs may span devices)
               "client_flops_per_round", "last_uplink_bytes_per_client", "seconds_to_target",
               "communication_seconds_to_target", "computed_on")


def _target(sweep: Sweep, task: str) -> float | None:
    target = sweep.spec.target
    return target.get(task) if isinstance(target, dict) else target


def seed_row(sweep: Sweep, run: SweepRun, loaded: Run) -> dict[str, Any]:
    """A run's SPEC row: named by the benchmark's task/partition/method names, the recipe beside it."""
    link = Bandwidth.parse(sweep.spec.bandwidth) if sweep.spec.bandwidth else None
    row = run_row(loaded, _target(sweep, run.task), link)
    row.update(task=run.task or row["task"], partition=run.partition or row["partition"], method=run.method,
               recipe=loaded.method, seed=run.seed, run=run.name)
    row["simulated_seconds_to_target"] = row["seconds_to_target"] if row["time_kind"] == "simulated" else None
    return row


def collect(sweep: Sweep) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """(federated rows, ceiling rows, runs not finished) of the sweep's run directories."""
    rows, ceilings, missing = [], [], []
    for run in sweep.runs:
        summary = run.run_dir / "summary.json"
        if not summary.exists():
            missing.append(run.name)
            continue
        row = seed_row(sweep, run, load_run(run.run_dir))
        # where it computed (runs written before summaries recorded it: "not recorded")
        row["computed_on"] = json.loads(summary.read_text()).get("computed_on", "not recorded")
        (ceilings if run.ceiling else rows).append(row)
    return rows, ceilings, missing


def ceiling_of(ceilings: Sequence[dict[str, Any]], task: str) -> float | None:
    """The centralised reference of ``task``: the mean over seeds of the best metric."""
    values = [r["best_metric"] for r in ceilings if r["task"] == task and r["best_metric"] is not None]
    return statistics.fmean(values) if values else None


def judge_claims(sweep: Sweep, summary: Sequence[dict[str, Any]], ceilings: Sequence[dict[str, Any]],
                 rows: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Each claim's verdict in each cell it applies to (``where``, else every cell, less those where the
    file's ``exclude`` leaves out a method the check reads): over the seeds' intervals, and (``paired``)
    over same-seed differences of the per-seed ``rows``."""
    index = {(r["task"], r["partition"], r["method"]): r for r in summary}
    seeds_of: dict[tuple[str, str, str], dict[Any, dict[str, Any]]] = {}
    for r in rows:
        seeds_of.setdefault((r["task"], r["partition"], r["method"]), {})[r["seed"]] = r
    cells = sorted({(r["task"], r["partition"]) for r in summary})
    out = []
    for claim in sweep.spec.claims:
        judged = []
        for task, partition in cells:
            if not judged_in(sweep.spec, claim, task, partition):
                continue

            def where(method: str, selector: tuple[str, ...], task: str = task,
                      partition: str = partition) -> tuple[str, str, str]:
                return (*reference_cell(selector, task, partition), method)

            def lookup(method: str, selector: tuple[str, ...], quantity: str) -> Any:
                if method == CEILING:
                    return row_interval(_ceiling_row(ceilings, where(method, selector)[0]), quantity)
                row = index.get(where(method, selector))
                if row is None:
                    raise Missing(f"{method} has no results in {'/'.join(where(method, selector)[:2])}")
                return row_interval(row, quantity)

            # the baseline must have learned in every cell the check reads, not only the one judged (or, with
            # the claim's `gate`, in that cell)
            read = list(dict.fromkeys([(task, partition),
                                       *(where(m, s)[:2] for m, s, _ in references(claim.check))]))
            gate_cell = (task, claim.gate["partition"]) if claim.gate else None

            judgement = _gate_cells(judge(claim.check, lookup), claim.baseline, read, index, ceilings, gate_cell)
            paired = judge_paired(claim.check, _seed_lookups(claim.check, seeds_of, where, ceilings))
            gap = paired.why if paired is not None else ""
            if paired is not None:
                paired = _gate_cells(paired, claim.baseline, read, index, ceilings, gate_cell)
            judged.append({"task": task, "partition": partition, "verdict": judgement.verdict,
                           "values": judgement.values, "why": judgement.why,
                           "paired": None if paired is None else {"verdict": paired.verdict, "why": paired.why,
                                                                  "gap": gap}})
        out.append({"id": claim.id, "claim": claim.claim, "source": claim.source, "check": claim.check,
                    "baseline": claim.baseline, "cells": judged})
    return out


def _gate_cells(judgement: Judgement, baseline: str | None, cells: Sequence[tuple[str, str]],
                index: Mapping[tuple[str, str, str], dict[str, Any]], ceilings: Sequence[dict[str, Any]],
                gate_cell: tuple[str, str] | None = None) -> Judgement:
    """:func:`fedpeft.claims.gate` over each cell a check reads (``cells``, the judged one first): not reached
    where the baseline ended below 90% of its ceiling in any of them (two methods both at the majority class
    in one cell "lose the same" from another, which says nothing). With the claim's ``gate_cell``, over that
    cell alone, and in the cells the check reads the baseline must still beat always answering the eval
    split's majority class (with its noise; where the results know that share: accuracy rows that carry
    ``majority_rate``); the verdict then says so, with the baseline's value in the gate cell and in each
    cell the check reads where it ended below 90% of its ceiling (the reader sees what the gate let through)."""
    judged = cells[0]
    for task, partition in [gate_cell] if gate_cell else cells:
        row = index.get((task, partition, baseline)) if baseline else None
        out = gate(judgement, baseline, row["final_metric"] if row else None, ceiling_of(ceilings, task),
                   f"{task}/{partition}" if (task, partition) != judged else "")
        if out is not judgement:
            return out
    if baseline is None or gate_cell is None or judgement.verdict == NOT_REACHED:
        return judgement
    for cell in cells:
        row = index.get((*cell, baseline)) or {}
        if row.get("majority_rate") is not None and row.get("eval_examples"):
            level = majority_level(row["majority_rate"], row["eval_examples"])
            if row["final_metric"] <= level:
                alone = f"{judgement.verdict}{'; ' + judgement.why if judgement.why else ''}"
                return Judgement(NOT_REACHED, judgement.values,
                                 f"baseline {baseline} ended at {row['final_metric']:.3f} in {'/'.join(cell)}, no "
                                 f"higher than always answering the majority class ({level:.3f} with its noise) "
                                 f"(the check alone says: {alone})")
    ceiling, row = ceiling_of(ceilings, gate_cell[0]), index.get((*gate_cell, baseline))
    if ceiling is None or row is None:
        return judgement
    note = (f"gated in {'/'.join(gate_cell)}: {baseline} ended at {row['final_metric']:.3f} there, at least 90% of "
            f"its centralised ceiling {ceiling:.3f}")
    below = [f"{index[(*cell, baseline)]['final_metric']:.3f} in {'/'.join(cell)}" for cell in cells
             if (*cell, baseline) in index and index[(*cell, baseline)]["final_metric"] < CEILING_FRACTION * ceiling]
    if below:
        note += f"; below it where the check reads: {', '.join(below)}"
    return Judgement(judgement.verdict, judgement.values, f"{judgement.why}; {note}" if judgement.why else note)


def _ceiling_row(ceilings: Sequence[dict[str, Any]], task: str) -> dict[str, Any]:
    """The centralised run of ``task`` over its seeds (``ceiling.QUANTITY`` in a check)."""
    rows = [r for r in ceilings if r["task"] == task]
    if not rows:
        raise Missing(f"{task} has no centralised ceiling")
    return rows[0]


def _seed_lookups(check: str, seeds_of: dict[tuple[str, str, str], dict[Any, dict[str, Any]]],
                  where: Callable[[str, tuple[str, ...]], tuple[str, str, str]],
                  ceilings: Sequence[dict[str, Any]]) -> list[Lookup]:
    """One exact lookup per seed that every method the check reads has run (none if one has no runs). The
    centralised ceiling is not one of a seed's federated runs: it counts at its mean over its seeds, exact."""
    keys = [where(method, selector) for method, selector, _ in references(check) if method != CEILING]
    common = set.intersection(*(set(seeds_of.get(key, {})) for key in keys)) if keys else set()

    def lookup_for(seed: Any) -> Lookup:
        def lookup(method: str, selector: tuple[str, ...], quantity: str) -> Any:
            if method == CEILING:
                return Interval.exact(row_interval(_ceiling_row(ceilings, where(method, selector)[0]), quantity).mid)
            return row_interval(seeds_of[where(method, selector)][seed], quantity)
        return lookup

    return [lookup_for(seed) for seed in sorted(common)]


def _objective(tune: dict[str, Any]) -> str:
    """The tune's objective in words where it is not the last round of one run ('' where it is)."""
    seeds, rounds = tune.get("seeds"), tune.get("score_rounds", 1)
    words = f" Each trial ran once per seed ({', '.join(map(str, seeds))}) and scored the mean" if seeds else ""
    if rounds > 1:
        words += (" of" if seeds else " Each trial scored the mean of") + f" its last {rounds} rounds' validation"
    return words + "." if words else ""


def _tune_block(tune: Any) -> dict[str, Any]:
    """The file's tune block as results record it; the objective's options only where set, so results
    written before they existed read the same."""
    block = tune.model_dump()
    if block["seeds"] is None:
        del block["seeds"]
    if block["score_rounds"] == 1:
        del block["score_rounds"]
    return block


def tuning_summary(sweep: Sweep) -> dict[str, Any]:
    out = {}
    for key in sorted(sweep.tunes):
        path = sweep.tune_dir(key) / "tune.json"
        if path.is_file():
            data = json.loads(path.read_text())
            out[key] = {k: data[k] for k in ("best_params", "best_value", "metric", "trials", "complete", "pruned",
                                             "failed", "seconds")}
    return out


def _seeds(seeds: set[int]) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(str(seed) for seed in sorted(seeds))


def missing_cells(sweep: Sweep, missing: Sequence[str]) -> list[str]:
    """What has not run, one line per task, partitions with the same gap merged: a benchmark run one
    part at a time (``fedpeft sweep --only``) lists its 150 unfinished runs as three lines, not 150 names."""
    gone = set(missing)
    lines = []
    for task in dict.fromkeys(run.task for run in sweep.runs):
        runs = [run for run in sweep.runs if run.task == task]
        absent = [run for run in runs if run.name in gone]
        if not absent:
            continue
        title = task or "runs"
        if len(absent) == len(runs):
            lines.append(f"{title}: all {len(runs)} runs")
            continue
        gaps: dict[str, list[str]] = {}  # the gap ("methods, seeds") -> partitions with it
        for partition in dict.fromkeys(run.partition for run in runs if not run.ceiling):  # the file's order
            cell = [run for run in runs if run.partition == partition and not run.ceiling]
            if not (lost := [run for run in absent if run.partition == partition and not run.ceiling]):
                continue
            if len(lost) == len(cell):
                gap = f"every method, {_seeds({run.seed for run in lost})}"
            else:  # methods missing the same seeds together, in the file's order
                by_seeds: dict[frozenset[int], list[str]] = {}
                for method in dict.fromkeys(run.method for run in cell):
                    if seeds := frozenset(run.seed for run in lost if run.method == method):
                        by_seeds.setdefault(seeds, []).append(method)
                gap = " and ".join(f"{', '.join(methods)}, {_seeds(set(seeds))}" for seeds, methods in by_seeds.items())
            gaps.setdefault(gap, []).append(partition or "-")
        parts = [f"{', '.join(partitions)}: {gap}" for gap, partitions in gaps.items()]
        if ceilings := {run.seed for run in absent if run.ceiling}:
            parts.append(f"the ceiling ({_seeds(ceilings)})")
        lines.append(f"{title} ({len(absent)} of {len(runs)} runs): " + "; ".join(parts))
    return lines


def _run_keys(rows: Sequence[dict[str, Any]], ceilings: Sequence[dict[str, Any]]) -> set[tuple[Any, ...]]:
    """(task, partition, method, seed) of every finished run: ``rows`` one per seed (:func:`collect`'s, or a
    results file's), ``ceilings`` a results file's, one per seed list."""
    keys = {(r["task"], r["partition"], r["method"], r["seed"]) for r in rows}
    return keys | {(c["task"], c["partition"], c["method"], seed) for c in ceilings for seed in c.get("seeds", [])}


def _sweep_keys(runs: Iterable[SweepRun]) -> set[tuple[Any, ...]]:
    return {(run.task, run.partition, run.method, run.seed) for run in runs}


def dropped_runs(path: Path, rows: Sequence[dict[str, Any]], ceiling_rows: Sequence[dict[str, Any]]
                 ) -> set[tuple[Any, ...]]:
    """The runs (:func:`_run_keys`) the results at ``path`` report as finished that are not finished here: a
    benchmark run before it kept records, reported on a fresh clone, or one cell of it run there, would
    otherwise overwrite committed evidence with less."""
    if not path.is_file():
        return set()
    old = json.loads(path.read_text())
    return _run_keys(old.get("rows", []), old.get("ceilings", [])) - _run_keys([*rows, *ceiling_rows], [])


def refuse_fewer_runs(sweep: Sweep, rows: Sequence[dict[str, Any]] | None = None,
                      ceiling_rows: Sequence[dict[str, Any]] | None = None, running: Sequence[SweepRun] = ()) -> None:
    """Raise where the sweep's committed results report a finished run that is neither finished here nor in
    ``running`` (:func:`dropped_runs`); ``rows``: :func:`collect`'s, read again when not given. A run whose
    record is here but stale (the file or a recipe changed it, so it was not restored) is no loss: its old
    result is not the run the file asks for."""
    if rows is None or ceiling_rows is None:
        rows, ceiling_rows, _ = collect(sweep)
    path = sweep.results_dir() / f"{sweep.spec.name or 'benchmark'}.json"
    gone = dropped_runs(path, rows, ceiling_rows) - _sweep_keys(running)
    if gone:  # checking each record against the file builds every recorded run's config: only when needed
        stale = stale_runs(sweep)
        gone -= _sweep_keys(run for run in sweep.runs if run.name in stale)
    if gone:
        names = [f"{task}/{partition or '-'}/{method} seed {seed}"
                 for task, partition, method, seed in sorted(gone, key=str)]
        raise ConfigError(str(path), (
            f"reports {len(names)} finished run{'s' * (len(names) != 1)} that {'are' if len(names) != 1 else 'is'} "
            f"not here (no run folder, no record: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); "
            "writing would drop them from the committed results. Restore their run folders, or run them "
            "again, or pass --allow-fewer-runs to write the smaller results"))


def write_results(sweep: Sweep, command: str, allow_fewer: bool = False) -> dict[str, Path]:
    """Write ``NAME.json``, ``NAME.md``, the figures and the run records (:mod:`fedpeft.records`) into the
    sweep's results folder. Refused, before anything is written, where the results there report a run as
    finished that is not finished here (no run folder, no record; :func:`dropped_runs`), unless
    ``allow_fewer``."""
    name = sweep.spec.name or "benchmark"
    folder = sweep.results_dir()
    rows, ceiling_rows, missing = collect(sweep)
    if not allow_fewer:
        refuse_fewer_runs(sweep, rows, ceiling_rows)
    folder.mkdir(parents=True, exist_ok=True)
    summary = aggregate_seeds(rows)
    mark_noise(summary)
    ceilings = aggregate_seeds(ceiling_rows)
    claims = judge_claims(sweep, summary, ceilings, rows)
    machine = f"{platform.machine()}, {platform.processor() or platform.system()}, python {platform.python_version()}"
    data = {
        "benchmark": name, "command": command, "machine": machine, "description": sweep.spec.description,
        "target": sweep.spec.target, "bandwidth": sweep.spec.bandwidth,
        "tune": None if sweep.spec.tune is None else _tune_block(sweep.spec.tune),
        "rows": [{k: r.get(k) for k in SPEC_FIELDS} for r in rows],
        "summary": summary, "ceilings": ceilings,
        "ceiling_config": sweep.spec.ceiling.config if sweep.spec.ceiling else None,
        "claims": claims, "tuning": tuning_summary(sweep),
        "missing_runs": missing, "missing_cells": missing_cells(sweep, missing), "notes": sweep.spec.notes,
        "computed_on": computed_on([*rows, *ceiling_rows]),
    }
    paths = {"json": folder / f"{name}.json", "md": folder / f"{name}.md"}
    paths["json"].write_text(json.dumps(data, indent=2, default=str) + "\n")
    figures = _figures(sweep, folder, name, summary, ceilings, command)
    paths["md"].write_text(markdown(data, figures))
    paths["records"] = write_records(sweep)
    return {**paths, **{f"png{i}": p for i, p in enumerate(figures)}}


def rejudge_results(sweep: Sweep) -> dict[str, Path]:
    """The committed ``NAME.json``'s claims judged again under the sweep file's claims, and its description
    and notes taken again, from the results file alone (its summary, ceilings and per-seed rows): claims
    edited after the runs and their folders are gone. Nothing else in the file changes but ``rejudged``
    (the date, which the markdown states under the command); ``NAME.md`` is rendered from it again with the
    figures beside it (the README tables follow with ``benchmarks/suite.py``)."""
    name = sweep.spec.name or "benchmark"
    path = sweep.results_dir() / f"{name}.json"
    if not path.exists():
        raise ConfigError("--rejudge", f"{path} does not exist: there are no results to judge again (run the "
                                       "benchmark)")
    data = json.loads(path.read_text())
    data.update(description=sweep.spec.description, notes=sweep.spec.notes,
                claims=judge_claims(sweep, data["summary"], data["ceilings"], data["rows"]),
                rejudged=datetime.date.today().isoformat())
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    markdown_path = path.with_suffix(".md")
    markdown_path.write_text(markdown_from_file(path, data))
    return {"json": path, "md": markdown_path}


def computed_on(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many finished runs (federated and ceiling rows of :func:`collect`) computed on each device:
    the report may be written on another machine than its runs."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["computed_on"]] = counts.get(row["computed_on"], 0) + 1
    return counts


def _cell_title(task: str, partition: str) -> str:
    return f"{task} / {partition}" if partition else task


def _grid(tune: dict[str, Any], method: str) -> str:
    """``key in {v1, v2}: N trials`` for a grid method's space (as the sweep file wrote it)."""
    parts, count = [], 1
    for key, spec in (tune["spaces"].get(method) or tune["space"]).items():
        values = spec.get("choices", []) if isinstance(spec, dict) else spec
        parts.append(f"{key} in {{" + ", ".join(map(str, values)) + "}")
        count *= len(values)
    return "; ".join(parts) + f": {count} trials"


def markdown(data: dict[str, Any], figures: Sequence[Path]) -> str:
    lines = [f"<!-- command: {data['command']} -->", f"# Benchmark `{data['benchmark']}`", "",
             f"Command: `{data['command']}`  ", f"Machine: {data['machine']}  "]
    if data.get("rejudged"):
        lines.append(f"Claims judged again on {data['rejudged']} from this file alone, under the sweep file's claims "
                     f"as they read then (`fedpeft sweep ... --rejudge`; the runs are the command's)  ")
    if data.get("computed_on"):
        lines.append("Runs computed on: " + "; ".join(f"{where} ({n} run{'s' * (n != 1)})"
                                                      for where, n in data["computed_on"].items()))
    lines.append("")
    if data["description"]:
        lines += [data["description"].strip(), ""]
    tune = data["tune"]
    if tune:
        lines += [f"Tuning: every method got the same budget, {tune['trials']} trials of `fedpeft tune` "
                  f"(TPE, {tune['pruner']} pruning, seed {tune['seed']}) per {tune['per']}, on a validation split of "
                  f"{tune['validation_fraction']:.0%} of the training data (never the eval split); every run then "
                  "trains without that split." + (f" Not tuned: {', '.join(tune['skip'])}." if tune["skip"] else "")
                  + "".join(f" `{name}` runs at `{source}`'s tuned values." for name, source in
                            tune.get("inherit", {}).items())
                  + "".join(f" `{name}` tried every point of its grid once instead ({_grid(tune, name)})."
                            for name in tune.get("grid", [])) + _objective(tune),
                  ""]
    target = data["target"]
    if target is not None:
        comm = any(r.get("communication_seconds_to_target") is not None for r in data["summary"])
        lines += [f"Target (rounds/bytes/time to target): {target}" +
                  (f"; time simulated at {data['bandwidth']} Mbps down/up plus each client's measured compute" +
                   " (in brackets: the communication alone)" * comm if data["bandwidth"] else ""), ""]
    lines += ["Values: mean ± std over seeds [95% interval: t over seeds; one seed: binomial from the eval size]. "
              "'within noise': the final interval overlaps the best method's in the same cell.", ""]
    ceilings = {r["task"]: r for r in data["ceilings"]}
    by_seed = _finals_by_seed(data["rows"])
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in data["summary"]:
        cells.setdefault((row["task"], row["partition"]), []).append(row)
    for (task, partition), rows in cells.items():
        metric = rows[0]["metric"]
        lines += [f"## {_cell_title(task, partition)}", ""]
        if task in ceilings:
            c = ceilings[task]
            lines += [f"Centralised ceiling ({ceiling_label(c, data.get('ceiling_config'))}): best {metric} "
                      f"{metric_cell(c, 'best_metric')}; 90% of it: {CEILING_FRACTION * c['best_metric']:.3f}.", ""]
        lines += [f"| method | eval n | seeds | trainable params | final {metric} | final by seed | best {metric} | "
                  "final vs best | uplink / client / round | rounds to target | time to target |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: -(r["final_metric"] or 0)):
            reached = f"{r['seeds_reaching_target']}/{len(r['seeds'])}"
            finals = by_seed.get((task, partition, r["method"]), [])
            lines.append(
                f"| `{r['method']}` | {r.get('eval_examples') or '-'} | {len(r['seeds'])} | "
                f"{r['trainable_params']:,} | {metric_cell(r, 'final_metric')} | "
                f"{' / '.join(f'{v:.3f}' for v in finals) or '-'} | {metric_cell(r, 'best_metric')} | "
                f"{r.get('vs_best', '-')} | {_uplink_cell(r)} | "
                f"{_fmt_opt(r['rounds_to_target'])} ({reached}) | {_time_cell(r)} |")
        lines.append("")
    if data["tuning"]:
        lines += ["## Tuning", "", "| tune | chosen | validation metric | trials (complete / pruned / failed) | "
                  "wall time |", "|---|---|---|---|---|"]
        for key, t in data["tuning"].items():
            lines.append(f"| {key} | {_settings(t['best_params'])} | {t['best_value']:.4f} | {t['trials']} "
                         f"({t['complete']} / {t['pruned']} / {t['failed']}) | {t['seconds'] / 60:.0f} min |")
        lines.append("")
    if data["claims"]:
        lines += ["## Claims", "", "Verdicts: **confirmed** (holds at the pessimistic end of the intervals), "
                  "**refuted** (fails even at the optimistic end), **within noise** (the intervals straddle it), "
                  "**not reached** (the baseline ended below 90% of its centralised ceiling, or a value is missing). "
                  "**same seeds**: the same rule on the per-seed gaps (runs with one seed share their partition "
                  "and each round's clients), with their 95% t interval.",
                  "", "| claim | source | check | cell | verdict | same seeds | values |",
                  "|---|---|---|---|---|---|---|"]
        for claim in data["claims"]:
            for cell in claim["cells"] or [{"task": "-", "partition": "-", "verdict": "not reached", "values": {},
                                            "why": "no cell has results"}]:
                values = format_values(cell["values"])
                why = f" ({cell['why']})" if cell["why"] else ""
                paired = cell.get("paired")
                same_seeds = f"**{paired['verdict']}** ({paired['why']})" if paired else "-"
                lines.append(f"| {claim['claim']} | {claim['source']} | `{claim['check']}` | "
                             f"{_cell_title(cell['task'], cell['partition'])} | **{cell['verdict']}**{why} | "
                             f"{same_seeds} | {values} |")
        lines.append("")
    if data["missing_runs"]:
        lines += [f"Not finished (left out), {len(data['missing_runs'])} runs:", "",
                  *(f"- {line}" for line in data.get("missing_cells") or data["missing_runs"]), ""]  # older files
    for note in data["notes"]:
        lines += [note.strip(), ""]
    lines += [f"![{p.stem}]({p.name})" for p in figures]
    return "\n".join(lines) + "\n"


FIGURES = ("curves", "tradeoff", "partitions")
"""The figures a sweep writes beside its results, ``NAME_<kind>.png``, in the order the markdown shows them."""


def markdown_from_file(path: Path, data: dict[str, Any] | None = None) -> str:
    """``NAME.md`` rendered again from ``NAME.json`` (``path``; ``data``: its contents when the caller
    has read them already) and the figures beside it: the markdown is a function of the results file,
    so a change in how results print reaches every committed benchmark without its runs
    (``benchmarks/suite.py`` rewrites them all)."""
    figures = [f for kind in FIGURES if (f := path.with_name(f"{path.stem}_{kind}.png")).exists()]
    return markdown(json.loads(path.read_text()) if data is None else data, figures)


def _finals_by_seed(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[float]]:
    """Each method's final values in seed order, by (task, partition, method): the mean and interval hide
    whether seeds split into runs that learned and runs left at one class, which the seeds' own values
    show."""
    groups: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for row in rows:
        if row.get("final_metric") is not None:
            key = (row["task"], row["partition"], row["method"])
            groups.setdefault(key, []).append((row.get("seed") or 0, row["final_metric"]))
    return {key: [value for _, value in sorted(members)] for key, members in groups.items()}


def _uplink_cell(row: dict[str, Any]) -> str:
    """Bytes a client uploads a round; '-' for one client holding all the data (a centralised run sends
    nothing anywhere: its 'upload' is the update the engine passes to itself)."""
    return "-" if row.get("clients") == 1 else human_bytes(row["uplink_bytes_per_client_round"] or 0)


def ceiling_label(ceiling: Mapping[str, Any], config: Mapping[str, Any] | None) -> str:
    """Which run the ceiling is: its method, epochs and the settings its ``config:`` fragment changes, so a
    ceiling trained unlike the method it is named after (another optimiser, lr or loss) says so."""
    flat: dict[str, Any] = {}
    flatten("", dict(config or {}), flat)
    return f"{ceiling['method']}, {ceiling['rounds']} epochs" + (f"; with {_settings(flat)}" if flat else "")


def _settings(values: Mapping[str, Any]) -> str:
    """Dotted settings as ``client.lr = 0.000956, client.optimizer = adamw`` (floats to 3 significant digits)."""
    return ", ".join(f"{key} = {value:.3g}" if isinstance(value, float) else f"{key} = {value}"
                     for key, value in values.items())


def _fmt_opt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _time_cell(row: dict[str, Any]) -> str:
    """Time to target, and the communication alone beside it where the row has a network model."""
    comm = row.get("communication_seconds_to_target")
    return _fmt_seconds(row["seconds_to_target"]) + (f" ({_fmt_seconds(comm)})" if comm is not None else "")


def _fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.1f} min"


def format_value(reference: str, value: float) -> str:
    """A value a claim read (``reference``: ``METHOD.QUANTITY``), as the results pages print it: bytes
    (a quantity whose results field counts bytes) in KB/MB, anything else (metrics, seconds, FLOPs) to
    4 significant digits."""
    quantity = reference.rsplit(".", 1)[-1]
    if "bytes" in QUANTITIES.get(quantity, quantity):
        return human_bytes(value)
    return f"{value:.4g}"


def format_values(values: Mapping[str, float]) -> str:
    """A claim cell's values, ``METHOD.QUANTITY = value`` each, as every results page lists them."""
    return ", ".join(f"{k} = {format_value(k, v)}" for k, v in values.items())


FOOTER_POINTS = 7
FOOTER_CHARS_PER_INCH = 17
"""Characters of 7-point DejaVu Sans a footer line holds per inch of figure width (about 4 points each)."""


def _footer(fig: Any, command: str, note: str = "bands and bars: 95% intervals") -> None:
    """Every figure says which command made it and what its bands and bars are, wrapped to the
    figure's width (a sweep run with several ``--only`` is longer than one line of a narrow figure)."""
    lines = textwrap.wrap(f"{command}   ({note})", width=int(fig.get_figwidth() * FOOTER_CHARS_PER_INCH))
    line_height = FOOTER_POINTS * 1.3 / 72 / fig.get_figheight()  # as a fraction of the figure's height
    fig.tight_layout(rect=(0, 0.02 + line_height * len(lines), 1, 1))
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=FOOTER_POINTS, color="#555", va="bottom")


CROWDED = 8
"""More methods than this in one panel: distinct colours (tab20, then dashed) and the legend outside."""
LEGEND_WIDTH = {0: 0.0, 1: 2.4, 2: 4.4}
"""Inches a figure widens per panel for a legend of that many columns outside the axes (0: inside)."""


def _style(index: int) -> dict[str, Any]:
    """Colour, line style and marker of the index-th method of a panel: tab20's 20 colours, then again
    dashed with square markers."""
    second = index // 20 % 2
    return {"color": plt.get_cmap("tab20")(index % 20), "linestyle": "-" if not second else "--",
            "marker": "os"[second]}


def _legend_columns(entries: int) -> int:
    """0: the legend fits inside the axes; else its number of columns outside them."""
    return 0 if entries <= CROWDED else 1 if entries <= 22 else 2


def _legend(ax: Any, entries: int) -> None:
    columns = _legend_columns(entries)
    if columns == 0:
        ax.legend(fontsize=7)
    else:  # outside the axes, so it hides no curve or title
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=columns)


def _figures(sweep: Sweep, folder: Path, name: str, summary: Sequence[dict[str, Any]],
             ceilings: Sequence[dict[str, Any]], command: str) -> list[Path]:
    """Per cell: the metric per round (mean and 95% band per method, the ceiling as a dashed line); the
    final metric (with its interval) against uplink bytes per client and round; and, where a method ran
    under several partitions, the final metric against the partitions (:func:`_partition_figure`)."""
    by_cell: dict[tuple[str, str], dict[str, list[Run]]] = {}
    for run in sweep.runs:
        if run.ceiling or not (run.run_dir / "summary.json").exists():
            continue
        by_cell.setdefault((run.task, run.partition), {}).setdefault(run.method, []).append(load_run(run.run_dir))
    if not by_cell:
        return []
    ceiling = {r["task"]: r["best_metric"] for r in ceilings}
    columns = min(3, len(by_cell))
    rows_n = (len(by_cell) + columns - 1) // columns
    most = max(len(methods) for methods in by_cell.values())
    width = 5.2 + LEGEND_WIDTH[_legend_columns(most + 1)]  # + the ceiling's entry
    fig, axes = plt.subplots(rows_n, columns, figsize=(width * columns, 3.8 * rows_n), squeeze=False)
    for ax, ((task, partition), methods) in zip(axes.flat, sorted(by_cell.items())):
        metric = next(iter(methods.values()))[0].metric
        crowded = len(methods) > CROWDED
        for index, (method, runs) in enumerate(methods.items()):
            rounds, means, lows, highs = band(runs, metric)
            style = {**_style(index), "marker": "."} if crowded else {"marker": "."}
            line, = ax.plot(rounds, means, ms=4, label=f"{method} ({len(runs)})", **style)
            if not crowded:  # crowded panels: bands would cover each other (the table has the intervals)
                ax.fill_between(rounds, lows, highs, color=line.get_color(), alpha=0.15, linewidth=0)
        if ceiling.get(task) is not None:
            ax.axhline(ceiling[task], linestyle="--", color="black", linewidth=1, label="centralised")
        ax.set(title=_cell_title(task, partition), xlabel="round", ylabel=metric)
        ax.grid(alpha=0.3)
        _legend(ax, len(methods) + 1)
    for ax in list(axes.flat)[len(by_cell):]:
        ax.set_visible(False)
    _footer(fig, command, "bands: 95% intervals" if most <= CROWDED else
            "lines: mean over seeds; with this many methods the intervals are in the table and the tradeoff figure")
    curves = folder / f"{name}_{FIGURES[0]}.png"
    fig.savefig(curves, dpi=110)
    plt.close(fig)

    cells = sorted({(r["task"], r["partition"]) for r in summary})
    fig, axes = plt.subplots(1, len(cells), figsize=(width * len(cells), 3.8), squeeze=False)
    for ax, (task, partition) in zip(axes[0], cells):
        rows = [r for r in summary if (r["task"], r["partition"]) == (task, partition)]
        for index, row in enumerate(rows):
            ci = row.get("final_metric_ci") or [row["final_metric"]] * 2
            style = _style(index) if len(rows) > CROWDED else {"marker": "o"}
            ax.errorbar(row["uplink_bytes_per_client_round"], row["final_metric"],
                        yerr=[[row["final_metric"] - ci[0]], [ci[1] - row["final_metric"]]], capsize=3,
                        label=row["method"], linestyle="none", color=style.get("color"), marker=style["marker"])
        if ceiling.get(task) is not None:
            ax.axhline(ceiling[task], linestyle="--", color="black", linewidth=1, label="centralised")
        ax.set_xscale("log")
        bytes_axis(ax)
        ax.set(title=_cell_title(task, partition), xlabel="uplink bytes / client / round", ylabel="final metric")
        ax.grid(alpha=0.3)
        _legend(ax, len(rows) + 1)
    _footer(fig, command)
    tradeoff = folder / f"{name}_{FIGURES[1]}.png"
    fig.savefig(tradeoff, dpi=110)
    plt.close(fig)
    heterogeneity = _partition_figure(sweep, folder / f"{name}_{FIGURES[2]}.png", summary, ceiling, command)
    return [curves, tradeoff] + ([heterogeneity] if heterogeneity else [])


def by_partition(sweep: Sweep, summary: Sequence[dict[str, Any]]
                 ) -> dict[str, dict[str, list[tuple[str, float, float, float]]]]:
    """Per task and method, (partition, final mean, 95% low, high) in the sweep file's partition order;
    only tasks where some method ran in two partitions or more (a curve over label skew)."""
    order = {name: index for index, name in enumerate(sweep.spec.partitions)}
    out: dict[str, dict[str, list[tuple[str, float, float, float]]]] = {}
    for row in sorted((r for r in summary if r["partition"] in order), key=lambda r: order[r["partition"]]):
        low, high = row.get("final_metric_ci") or [row["final_metric"]] * 2
        point = (row["partition"], row["final_metric"], low, high)
        out.setdefault(row["task"], {}).setdefault(row["method"], []).append(point)
    return {task: methods for task, methods in out.items() if max(len(p) for p in methods.values()) >= 2}


def _partition_figure(sweep: Sweep, path: Path, summary: Sequence[dict[str, Any]], ceiling: Mapping[str, float],
                      command: str) -> Path | None:
    """The final metric (mean and 95% interval) against the partitions, in the file's order (iid to
    the strongest skew, FeDeRA's Fig. 5 view), one panel per task; None where no method ran in two."""
    tasks = by_partition(sweep, summary)
    if not tasks:
        return None
    names = list(sweep.spec.partitions)
    fig, axes = plt.subplots(1, len(tasks), figsize=(max(5.2 * len(tasks), 7.5), 3.8), squeeze=False)  # footer fits
    for ax, (task, methods) in zip(axes[0], tasks.items()):
        for index, (method, points) in enumerate(methods.items()):
            xs = [names.index(p[0]) + 0.04 * (index - (len(methods) - 1) / 2) for p in points]  # side by side
            means = [p[1] for p in points]
            ax.errorbar(xs, means, yerr=[[m - p[2] for m, p in zip(means, points)],
                                         [p[3] - m for m, p in zip(means, points)]],
                        capsize=3, marker="o", ms=4, label=method,
                        color=_style(index)["color"] if len(methods) > CROWDED else None)
        if ceiling.get(task) is not None:
            ax.axhline(ceiling[task], linestyle="--", color="black", linewidth=1, label="centralised")
        ax.set_xticks(range(len(names)), names)
        ax.set(title=task, xlabel="partition", ylabel="final metric")
        ax.grid(alpha=0.3)
        _legend(ax, len(methods) + 1)
    _footer(fig, command)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Run a grid of experiments (methods x tasks x partitions x seeds) into one folder.

A sweep file::

    base: configs/demo_sst2_lora.yaml     # a config file, or an inline mapping
    out_dir: runs/sweep                   # each run goes to out_dir/<name>
    set: [rounds=5]                       # overrides applied to every run (optional)
    grid:                                 # dotted key -> list of values (a mapping merges)
      method: [lora, full]
      partition: [{kind: iid}, {kind: dirichlet, alpha: 0.1}]
      seed: [0, 1]

Runs whose ``summary.json`` exists are skipped, so an interrupted sweep continues where it
stopped; a run with a checkpoint but no summary is resumed.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedpeft.config import ConfigError, apply_overrides, build_config
from fedpeft.metrics.recorder import CHECKPOINT, SUMMARY


@dataclass
class SweepRun:
    name: str
    raw: dict[str, Any]


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


def expand(sweep: dict[str, Any], sweep_path: Path | None = None) -> tuple[Path, list[SweepRun]]:
    """The run directory and the list of (name, raw config) of a sweep file's grid."""
    base = sweep.get("base", {})
    if isinstance(base, str):
        base_path = Path(base)
        if not base_path.is_file() and sweep_path is not None:
            base_path = sweep_path.parent / base
        if not base_path.is_file():
            raise ConfigError("sweep.base", f"config file not found: {base}")
        base = yaml.safe_load(base_path.read_text()) or {}
    grid = sweep.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise ConfigError("sweep.grid", "expected a mapping of dotted keys to non-empty lists")
    base = apply_overrides(base, list(sweep.get("set", [])))
    out_dir = Path(sweep.get("out_dir", "runs/sweep"))
    runs = []
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        raw = copy.deepcopy(base)
        parts = []
        for key, value in zip(keys, values):
            _set_path(raw, key, value)
            parts.append(f"seed{value}" if key == "seed" else _label(value))
        seed_last = [p for p in parts if not p.startswith("seed")] + [p for p in parts if p.startswith("seed")]
        name = "_".join(seed_last).replace("/", "-")
        raw.setdefault("output", {})["run_dir"] = str(out_dir / name)
        build_config(raw)  # validate every point before running any
        runs.append(SweepRun(name, raw))
    return out_dir, runs


def run_sweep(path: Path, run_one: Callable[[dict[str, Any], bool], None]) -> tuple[Path, list[Path]]:
    """Run (or resume) every grid point with ``run_one(raw, resume)``; return the run dirs."""
    if not path.is_file():
        raise ConfigError("SWEEP", f"file not found: {path}")
    sweep = yaml.safe_load(path.read_text()) or {}
    out_dir, runs = expand(sweep, path)
    dirs = []
    for run in runs:
        run_dir = Path(run.raw["output"]["run_dir"])
        dirs.append(run_dir)
        if (run_dir / SUMMARY).exists():
            continue
        run_one(run.raw, (run_dir / CHECKPOINT).exists())
    return out_dir, dirs

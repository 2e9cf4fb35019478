"""What the per-paper benchmarks share: running one experiment in a child process, and reading
when a run first reached a target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def run_child(config_path: Path) -> None:
    """Run (or resume, when its run directory holds a checkpoint) one experiment in this process."""
    from fedpeft.config import build_config
    from fedpeft.engines.local import LocalEngine
    from fedpeft.experiment import prepare

    raw = json.loads(config_path.read_text())
    run_dir = Path(raw["output"]["run_dir"])
    resume = (run_dir / "checkpoint.pt").exists()
    LocalEngine(prepare(build_config(raw)), run_dir).run(resume=resume)


def first_round_at(records: list[dict[str, Any]], metric: str, target: float) -> dict[str, Any] | None:
    """The first trained round's record whose ``metric`` reaches ``target`` (None: never)."""
    return next((r for r in records if r["round"] > 0 and r["eval"].get(metric, -1.0) >= target), None)

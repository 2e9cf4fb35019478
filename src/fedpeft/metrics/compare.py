"""Read finished runs and put them side by side: one row per run, the SPEC's benchmark fields.

A run directory holds ``config.yaml``, ``metrics.jsonl`` and (optionally) ``partition.json``.
Times to target use, in order: a bandwidth given here (recomputed from the real bytes and each
client's measured compute), the run's own simulated time (``time.simulated`` per round, when
its config had a network model), or the measured wall clock.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedpeft.config import ConfigError
from fedpeft.metrics.recorder import CONFIG, METRICS, PARTITION, load_metrics
from fedpeft.metrics.stats import estimate

NOT_FRACTIONS = frozenset({"pearson", "spearman", "matthews"})
"""Metrics that are not fractions of examples (so one seed's value has no binomial interval)."""


@dataclass(frozen=True)
class Bandwidth:
    """Per-client link speeds in megabits per second (10^6 bit/s) and a fixed latency per message."""

    down_mbps: float
    up_mbps: float
    latency_seconds: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Bandwidth:
        """``"10/1"`` means 10 Mbps down, 1 Mbps up."""
        try:
            down, up = (float(part) for part in text.split("/"))
        except ValueError as err:
            raise ConfigError("--bandwidth", f"expected DOWN/UP in Mbps like 10/1, got {text!r}") from err
        if down <= 0 or up <= 0:
            raise ConfigError("--bandwidth", f"speeds must be > 0, got {text!r}")
        return cls(down, up)

    def round_seconds(self, record: dict[str, Any], *, compute: bool = True) -> float:
        """The round lasts as long as its slowest client: download + compute + upload, each message
        after the link's latency (``compute`` off: the communication time alone)."""
        seconds = record.get("client_seconds") if compute else None
        per_client = [
            8 * down / (self.down_mbps * 1e6) + busy + 8 * up / (self.up_mbps * 1e6) + 2 * self.latency_seconds
            for down, up, busy in zip(record["bytes_down"], record["bytes_up"],
                                      seconds or [0.0] * len(record["bytes_up"]))
        ]
        return max(per_client, default=0.0)


@dataclass
class Run:
    path: Path
    name: str
    config: dict[str, Any]
    records: list[dict[str, Any]]
    partition: dict[str, Any] | None

    @property
    def method(self) -> str:
        return str(self.config.get("method", "?"))

    @property
    def metric(self) -> str:
        evaluated = [r for r in self.records if r.get("eval")]
        return next(iter(evaluated[-1]["eval"])) if evaluated else "accuracy"

    @property
    def trained(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["round"] > 0]

    def curve(self, metric: str | None = None) -> list[tuple[dict[str, Any], float]]:
        metric = metric or self.metric
        return [(r, r["eval"][metric]) for r in self.records if metric in r.get("eval", {})]


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not (path / METRICS).exists() or not (path / CONFIG).exists():
        raise ConfigError("RUN_DIR", f"{path} is not a run directory (needs {CONFIG} and {METRICS})")
    config = yaml.safe_load((path / CONFIG).read_text())
    partition = json.loads((path / PARTITION).read_text()) if (path / PARTITION).exists() else None
    records = load_metrics(path)
    if not records:
        raise ConfigError("RUN_DIR", f"{path} has no finished round yet")
    return Run(path=path, name=path.name, config=config, records=records, partition=partition)


def time_axis(run: Run, bandwidth: Bandwidth | None) -> tuple[list[float], str]:
    """Cumulative seconds at the end of each record, and what kind of time it is."""
    if bandwidth is not None:
        label, per_round = "simulated", [bandwidth.round_seconds(r) for r in run.records]
    elif run.trained and all("simulated" in r["time"] for r in run.trained):
        label, per_round = "simulated", [r["time"].get("simulated", 0.0) for r in run.records]
    else:
        label, per_round = "wall clock", [r["time"]["round"] if r["round"] > 0 else 0.0 for r in run.records]
    return list(itertools.accumulate(per_round)), label


def communication_axis(run: Run, bandwidth: Bandwidth | None) -> list[float] | None:
    """Cumulative communication seconds at the end of each record: each round's slowest client's
    download + upload, no compute (FLASC's Fig. 3 measure, which does not depend on where a run
    computed); from ``bandwidth``, else from the run's own simulated network; None without either."""
    if bandwidth is not None:
        per_round = [bandwidth.round_seconds(r, compute=False) for r in run.records]
    elif run.trained and all("simulated_communication" in r["time"] for r in run.trained):
        per_round = [r["time"].get("simulated_communication", 0.0) for r in run.records]
    else:
        return None
    return list(itertools.accumulate(per_round))


def _mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else 0.0


def run_row(run: Run, target: float | None, bandwidth: Bandwidth | None = None) -> dict[str, Any]:
    """One row with the SPEC's benchmark fields for ``run`` (targets null when never reached).

    A target at or below the untrained model's value (round 0, when it was evaluated) credits no
    round: reaching it says nothing about learning (``target_below_start`` is then true). The
    best and final values carry a 95% interval from the evaluation set's size (one seed; see
    :mod:`fedpeft.metrics.stats`).
    """
    metric = run.metric
    curve = run.curve(metric)
    trained = run.trained
    cfg = run.config
    times, time_kind = time_axis(run, bandwidth)
    time_at = {r["round"]: t for r, t in zip(run.records, times)}
    communication = communication_axis(run, bandwidth)
    communication_at = {r["round"]: t for r, t in zip(run.records, communication or [])}
    start = next((v for r, v in curve if r["round"] == 0), None)
    below_start = target is not None and start is not None and target <= start
    reached = None if below_start else next(((r, v) for r, v in curve if target is not None and v >= target
                                             and r["round"] > 0), None)
    last = run.records[-1]
    eval_examples = next((r["eval_examples"] for r in reversed(run.records) if r.get("eval_examples")), None)
    best = max((v for _, v in curve), default=None)
    final = curve[-1][1] if curve else None
    fraction = metric not in NOT_FRACTIONS
    row = {
        "run": run.name,
        "task": cfg.get("task", {}).get("name"),
        "partition": _partition_label(cfg.get("partition", {})),
        "method": run.method,
        "seed": cfg.get("seed"),
        "rounds": len(trained),
        "clients": cfg.get("partition", {}).get("num_clients"),
        "clients_per_round": _mean([len(r["clients"]) for r in trained]),
        "metric": metric,
        "eval_examples": eval_examples,
        "best_metric": best,
        "final_metric": final,
        "start_metric": start,
        "trainable_params": last.get("trainable_params"),
        "uplink_bytes_per_client_round": _mean([b for r in trained for b in r["bytes_up"]]),
        "downlink_bytes_per_client_round": _mean([b for r in trained for b in r["bytes_down"]]),
        # the last round's message: what a method that shrinks it mid-run (FedPepTAO's layer selection)
        # sends from then on, which the mean over rounds dilutes in a short run
        "last_uplink_bytes_per_client": _mean(trained[-1]["bytes_up"]) if trained else None,
        "total_bytes": last.get("cum_bytes_up", 0) + last.get("cum_bytes_down", 0),
        "target": target,
        "target_below_start": below_start,
        "rounds_to_target": reached[0]["round"] if reached else None,
        "bytes_to_target": (reached[0]["cum_bytes_up"] + reached[0]["cum_bytes_down"]) if reached else None,
        "uplink_bytes_to_target": reached[0]["cum_bytes_up"] if reached else None,
        "seconds_to_target": time_at[reached[0]["round"]] if reached else None,
        "communication_seconds_to_target": communication_at.get(reached[0]["round"]) if reached else None,
        "time_kind": time_kind,
        "client_flops_per_step": last.get("client_flops_per_step"),
        # a method that counts a whole client round (head pruning: training + importance pass)
        "client_flops_per_round": next((r["method"]["client_flops_per_round"] for r in reversed(run.records)
                                        if "client_flops_per_round" in r.get("method", {})), None),
        "wall_seconds": last.get("cum_wall_seconds", sum(r["time"]["round"] for r in trained)),
        "majority_rate": _majority_rate(run, metric),
    }
    for key, value in (("best_metric", best), ("final_metric", final)):
        if value is not None:
            interval = estimate([value], eval_examples, fraction)
            row[f"{key}_ci"] = [interval.low, interval.high]
            row["interval"] = interval.kind
    return row


def _majority_rate(run: Run, metric: str) -> float | None:
    """The eval split's most frequent class's share (the run's summary), for accuracy only: what a model
    that learned nothing scores (a claim's ``gate`` needs the baseline above it where the check reads)."""
    path = run.path / "summary.json"
    if metric != "accuracy" or not path.exists():
        return None
    return json.loads(path.read_text()).get("majority_rate")


def _partition_label(partition: dict[str, Any]) -> str:
    kind = partition.get("kind", "iid")
    if kind in ("dirichlet", "quantity_skew"):
        return f"{kind}({partition.get('alpha')})"
    return str(kind)


def default_target(runs: Sequence[Run], fraction: float = 0.95) -> float | None:
    """95% of the best metric any of the runs reached (the FedTT paper's Table 6 convention)."""
    bests = [v for run in runs for _, v in run.curve()]
    return fraction * max(bests) if bests else None


SEED_KEYS = ("best_metric", "final_metric", "rounds_to_target", "bytes_to_target", "seconds_to_target",
             "communication_seconds_to_target",
             "uplink_bytes_per_client_round", "downlink_bytes_per_client_round", "last_uplink_bytes_per_client",
             "total_bytes", "wall_seconds", "client_flops_per_step", "client_flops_per_round")


def aggregate_seeds(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (task, partition, method, run name without its seed): the mean, the sample
    standard deviation (``*_std``) and the 95% interval (``*_ci``: t over seeds; for the best and
    final metric of a single seed, the binomial interval of its eval size). Rounds, bytes and time
    to target are null unless every seed reached the target. FLOPs are averaged too: a method whose
    pruned model differs by seed (head pruning) counts differently per seed."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["partition"], row["method"], row["run"].rsplit("_seed", 1)[0]),
                          []).append(row)
    out = []
    for (task, partition, method, name), members in groups.items():
        metric = members[0]["metric"]
        merged: dict[str, Any] = {"run": name, "task": task, "partition": partition, "method": method,
                                  "seeds": [m["seed"] for m in members], "metric": metric,
                                  "eval_examples": members[0].get("eval_examples")}
        merged["seeds_reaching_target"] = sum(m.get("rounds_to_target") is not None for m in members)
        for key in SEED_KEYS:
            values = [m[key] for m in members if m.get(key) is not None]
            if key.endswith("_to_target") and len(values) < len(members):
                values = []  # a mean over only the seeds that got there would flatter the method
            merged[key] = _mean(values) if values else None
            merged[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
            if not values:
                continue
            if key in ("best_metric", "final_metric"):
                interval = estimate(values, merged["eval_examples"], metric not in NOT_FRACTIONS)
                merged["interval"] = interval.kind
            else:
                interval = estimate(values, None, fraction=False)
            merged[f"{key}_ci"] = [interval.low, interval.high]
        for key in ("trainable_params", "target", "rounds", "clients", "clients_per_round", "majority_rate"):
            merged[key] = members[0].get(key)
        out.append(merged)
    return out


def mark_noise(rows: list[dict[str, Any]], key: str = "final_metric") -> None:
    """Compare each row with the best row of its task and partition (centralised runs are their own
    group): ``vs_best`` is ``best``, ``within noise`` (95% intervals overlap) or the gap in points."""
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for row in rows:
        if row.get(key) is not None:
            groups.setdefault((row["task"], row["partition"]), []).append(row)
    for members in groups.values():
        leader = max(members, key=lambda r: r[key])
        for row in members:
            if row is leader:
                row["vs_best"] = "best"
            elif _overlap(row.get(f"{key}_ci"), leader.get(f"{key}_ci")):
                row["vs_best"] = "within noise"
            else:
                row["vs_best"] = f"{100 * (row[key] - leader[key]):+.1f} pts"


def _overlap(a: Sequence[float] | None, b: Sequence[float] | None) -> bool:
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]

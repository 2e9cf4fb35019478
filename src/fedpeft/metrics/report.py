"""Figures and a single self-contained HTML page for one run or several side by side.

Figures: metric vs round (mean over seeds with a 95% band, centralised runs as a ceiling line),
vs cumulative uplink bytes, vs (simulated) time, each client's data
(label histogram per client), and the method-specific values each run logged per round under
``method`` in metrics.jsonl: scalar series become line plots (FedTT+ active factor, FLASC
densities, FeDeRA magnitude/direction variation, ...), per-round matrices become heatmaps of
the last round (head importance per client, FedPepTAO layer scores, ...). Images are embedded
as base64 PNG, so the page needs no network and no other file; SVG copies sit beside it.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from fedpeft.metrics.compare import NOT_FRACTIONS, Bandwidth, Run, time_axis
from fedpeft.metrics.stats import estimate
from fedpeft.metrics.summary import human_bytes

MAX_PARTITION_PANELS = 6
MAX_LINES = 6  # a nested group of more method series than this is drawn as one heatmap


@dataclass
class Plot:
    slug: str
    title: str
    png: bytes


def bytes_axis(ax: Any) -> None:
    """Byte ticks ('200 KB') on the x axis, called once the data are drawn. On a log scale the labelled
    ticks are :func:`log_ticks` of the drawn range and the minor ticks go unlabelled: matplotlib's own
    labels ('3x10^5', or every 100 KB when the range is under a decade) run into each other."""
    if ax.get_xscale() == "log":
        ax.xaxis.set_minor_formatter(NullFormatter())
        if ticks := log_ticks(*ax.get_xlim()):  # none: a range too narrow for a round value, keep matplotlib's
            ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v).replace(".00 ", " ")))


def log_ticks(low: float, high: float, min_gap: float = 0.15) -> list[float]:
    """Round tick values for a log axis over [low, high]: the finest of 1, 1-2-5, 1-2-3-5-7 and 1..9
    times a power of ten whose neighbouring ticks stay ``min_gap`` of the axis apart (so their labels
    do not touch), stopping once four ticks are in range."""
    span = math.log10(high / low)
    chosen: list[float] = []
    for mantissas in ((1,), (1, 2, 5), (1, 2, 3, 5, 7), tuple(range(1, 10))):
        ticks = [m * 10.0 ** k for k in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
                 for m in mantissas if low <= m * 10.0 ** k <= high]
        if any(math.log10(b / a) < min_gap * span for a, b in pairwise(ticks)):
            break
        chosen = ticks
        if len(ticks) >= 4:
            break
    return chosen


def _seconds_label(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _save(fig: Figure, slug: str, title: str, out_dir: Path) -> Plot:
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / f"{slug}.svg")
    fig.savefig(out_dir / f"{slug}.png", dpi=110)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return Plot(slug, title, buffer.getvalue())


def seed_groups(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs that differ only in seed (names ``..._seedN``) share a group, named without the seed."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.name.rsplit("_seed", 1)[0], []).append(run)
    return groups


def is_centralized(run: Run) -> bool:
    return run.config.get("partition", {}).get("kind") == "centralized"


def band(runs: Sequence[Run], metric: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per evaluated round: the mean over the runs and its 95% interval (t over seeds, or the
    binomial interval of one run's eval size), over the rounds every run evaluated."""
    curves = [dict((r["round"], v) for r, v in run.curve(metric)) for run in runs]
    rounds = sorted(set.intersection(*(set(c) for c in curves)))
    sizes = [next((r["eval_examples"] for r in run.records if r.get("eval_examples")), None) for run in runs]
    means, lows, highs = [], [], []
    for round_idx in rounds:
        value = estimate([c[round_idx] for c in curves], sizes[0], metric not in NOT_FRACTIONS)
        means.append(value.mean)
        lows.append(value.low)
        highs.append(value.high)
    return rounds, means, lows, highs


def curve_plots(runs: Sequence[Run], out_dir: Path, bandwidth: Bandwidth | None) -> list[Plot]:
    """Metric per round (mean over seeds with its 95% band; centralised runs as a dashed ceiling
    line at their mean best), vs cumulative uplink bytes, and vs time."""
    metric = runs[0].metric
    groups = seed_groups(runs)
    plots = []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, members in groups.items():
        rounds, means, lows, highs = band(members, metric)
        if not rounds:
            continue
        if is_centralized(members[0]):
            best = statistics.fmean(max(v for _, v in run.curve(metric)) for run in members)
            ax.axhline(best, linestyle="--", color="black", linewidth=1, label=f"ceiling: {name} ({best:.3f})")
            continue
        line, = ax.plot(rounds, means, marker="o", ms=3, label=name if len(members) == 1 else
                        f"{name} ({len(members)} seeds)")
        ax.fill_between(rounds, lows, highs, color=line.get_color(), alpha=0.18, linewidth=0)
    ax.set(xlabel="round", ylabel=metric, title=f"{metric} per round (band: 95% interval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plots.append(_save(fig, "metric_vs_round", f"{metric} per round", out_dir))

    federated = [run for run in runs if not is_centralized(run)] or list(runs)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in federated:
        points = [(r, v) for r, v in run.curve(metric) if r["round"] > 0]
        ax.plot([r["cum_bytes_up"] for r, _ in points], [v for _, v in points], marker="o", ms=3, label=run.name)
    ax.set_xscale("symlog" if len(federated) == 1 else "log")
    bytes_axis(ax)
    ax.set(xlabel="cumulative uplink bytes (all clients)", ylabel=metric, title=f"{metric} vs uplink bytes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plots.append(_save(fig, "metric_vs_uplink", f"{metric} vs cumulative uplink bytes", out_dir))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    kinds = set()
    for run in federated:
        times, kind = time_axis(run, bandwidth)
        kinds.add(kind)
        at = {r["round"]: t for r, t in zip(run.records, times)}
        points = run.curve(metric)
        ax.plot([at[r["round"]] for r, _ in points], [v for _, v in points], marker="o", ms=3, label=run.name)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _seconds_label(v)))
    link = f" at {bandwidth.down_mbps:g}/{bandwidth.up_mbps:g} Mbps" if bandwidth else ""
    ax.set(xlabel=f"{' / '.join(sorted(kinds))} time{link}", ylabel=metric, title=f"{metric} vs time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plots.append(_save(fig, "metric_vs_time", f"{metric} vs time", out_dir))
    return plots


def partition_plot(runs: Sequence[Run], out_dir: Path) -> list[Plot]:
    """One panel per distinct partition (runs sharing a partition share its panel)."""
    distinct: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for run in runs:
        if run.partition:
            key = json.dumps(run.partition, sort_keys=True)
            distinct.setdefault(key, (run.partition, []))[1].append(run.name)
    shown = list(distinct.values())[:MAX_PARTITION_PANELS]
    if not shown:
        return []
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 2.4 * len(shown)), squeeze=False)
    for ax, (partition, names_of_runs) in zip(axes[:, 0], shown):
        clients = partition["clients"]
        names = partition["label_names"] or ["value"]
        bottom = [0] * len(clients)
        for name in names:
            counts = [c["labels"].get(name, 0) if "labels" in c else c["size"] for c in clients]
            ax.bar(range(len(clients)), counts, bottom=bottom, label=name, width=0.9)
            bottom = [b + n for b, n in zip(bottom, counts)]
        who = names_of_runs[0] if len(names_of_runs) == 1 else f"{len(names_of_runs)} runs ({names_of_runs[0]}, ...)"
        ax.set(xlabel="client", ylabel="examples", title=f"data per client: {who}")
        if len(names) <= 12:
            ax.legend(fontsize=7, ncol=min(len(names), 6))
    return [_save(fig, "partition", "training examples per client, by label", out_dir)]


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """A nested config fragment as dotted keys (``client.lr``) into ``out``."""
    if isinstance(value, dict):
        for key, inner in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


def _is_matrix(value: Any) -> bool:
    return (isinstance(value, list) and len(value) > 0 and all(isinstance(row, list) and row for row in value)
            and all(isinstance(x, int | float) for row in value for x in row))


@dataclass
class MethodValues:
    """What one run logged under ``method``: scalar series, families of series, last-round matrices."""

    scalars: dict[str, list[tuple[int, float]]]
    families: dict[str, dict[str, list[tuple[int, float]]]]  # e.g. FeDeRA's variation per LoRA matrix
    matrices: dict[str, tuple[int, list[list[float]]]]


def method_values(run: Run) -> MethodValues:
    """Split a run's per-round method values: a nested group with more than :data:`MAX_LINES`
    series (one per LoRA matrix, per layer, ...) is a family, shown as one heatmap."""
    series: dict[str, list[tuple[int, float]]] = {}
    matrices: dict[str, tuple[int, list[list[float]]]] = {}
    for record in run.trained:
        flat: dict[str, Any] = {}
        flatten("", record.get("method", {}), flat)
        for key, value in flat.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                series.setdefault(key, []).append((record["round"], float(value)))
            elif _is_matrix(value):
                matrices[key] = (record["round"], value)
    groups: dict[str, list[str]] = {}
    for key in series:
        if "." in key:
            groups.setdefault(key.split(".", 1)[0], []).append(key)
    families = {group: {key.split(".", 1)[1]: series.pop(key) for key in keys}
                for group, keys in groups.items() if len(keys) > MAX_LINES}
    return MethodValues(series, families, matrices)


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text)


def method_plots(runs: Sequence[Run], out_dir: Path) -> list[Plot]:
    """Method-specific values: each scalar series in one panel with a line per run (so FeDeRA's and
    LoRA's variations, or two FLASC densities, sit side by side), each family of series as a
    heatmap per run (rows = series, columns = rounds), each matrix as a heatmap of its last round."""
    values = {run.name: method_values(run) for run in runs}
    plots = []
    keys = sorted({key for v in values.values() for key in v.scalars})
    if keys:
        columns = 2 if len(keys) > 1 else 1
        rows = (len(keys) + columns - 1) // columns
        fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 2.6 * rows + 0.4), squeeze=False)
        for ax, key in zip(axes.flat, keys):
            for name, v in values.items():
                if key in v.scalars:
                    ax.plot(*zip(*v.scalars[key]), marker=".", ms=4, label=name)
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(keys):]:
            ax.set_visible(False)
        axes[0, 0].legend(fontsize=7)
        plots.append(_save(fig, "method_values", "method-specific values per round", out_dir))
    for name, v in values.items():
        for family, members in sorted(v.families.items()):
            labels = sorted(members)
            rounds = sorted({r for series in members.values() for r, _ in series})
            grid = [[dict(members[label]).get(r, float("nan")) for r in rounds] for label in labels]
            fig, ax = plt.subplots(figsize=(8, 0.22 * len(labels) + 1.6))
            image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
            fig.colorbar(image, ax=ax)
            ax.set_yticks(range(len(labels)), [label[-48:] for label in labels], fontsize=6)
            ax.set_xticks(range(len(rounds)), [str(r) for r in rounds], fontsize=7)
            ax.set(title=f"{name}: {family}", xlabel="round")
            plots.append(_save(fig, f"family_{_slug(name)}_{_slug(family)}", f"{name}: {family} per round", out_dir))
        for key, (round_idx, matrix) in sorted(v.matrices.items()):
            fig, ax = plt.subplots(figsize=(7, 3.6))
            image = ax.imshow(matrix, aspect="auto", cmap="viridis")
            fig.colorbar(image, ax=ax)
            ax.set(title=f"{name}: {key} (round {round_idx})", xlabel="column", ylabel="row")
            plots.append(_save(fig, f"heatmap_{_slug(name)}_{_slug(key)}", f"{name}: {key}", out_dir))
    return plots


def _fmt(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if "bytes" in key:
        return human_bytes(float(value))
    if "seconds" in key:
        return _seconds_label(float(value))
    if key == "target":
        return f"{float(value):.4f}"
    if key == "trainable_params" or key == "client_flops_per_step":
        return f"{int(value):,}" if key == "trainable_params" else f"{float(value) / 1e9:.2f} GFLOP"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def metric_cell(row: dict[str, Any], key: str) -> str:
    """``mean ± std [low, high]`` over seeds, or ``value [low, high]`` for one run (95% intervals)."""
    value = row.get(key)
    if value is None:
        return "-"
    text = f"{value:.3f}"
    if len(row.get("seeds", [])) > 1:
        text += f" ± {row.get(f'{key}_std', 0.0):.3f}"
    interval = row.get(f"{key}_ci")
    if interval:
        text += f" [{interval[0]:.3f}, {interval[1]:.3f}]"
    return text


TABLE_COLUMNS = [
    ("run", "run"), ("method", "method"), ("eval_examples", "eval n"), ("trainable_params", "trainable params"),
    ("best_metric", "best (95% CI)"), ("final_metric", "final (95% CI)"), ("vs_best", "final vs best"),
    ("rounds_to_target", "rounds to target"), ("bytes_to_target", "bytes to target"),
    ("seconds_to_target", "time to target"), ("uplink_bytes_per_client_round", "up / client / round"),
    ("downlink_bytes_per_client_round", "down / client / round"), ("client_flops_per_step", "client FLOPs / step"),
    ("wall_seconds", "wall time"),
]


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    return [[metric_cell(row, key) if key in ("best_metric", "final_metric") else _fmt(row.get(key), key)
             for key, _ in TABLE_COLUMNS] for row in rows]


def write_html(title: str, rows: Sequence[dict[str, Any]], plots: Sequence[Plot], path: Path,
               notes: Sequence[str] = ()) -> Path:
    header = "".join(f"<th>{html.escape(label)}</th>" for _, label in TABLE_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in cells) + "</tr>"
                   for cells in table_rows(rows))
    figures = "".join(
        f'<figure><img alt="{html.escape(p.title)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.png).decode()}"><figcaption>{html.escape(p.title)}</figcaption></figure>'
        for p in plots
    )
    note_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5rem auto; max-width: 1200px; padding: 0 1rem; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85rem; width: 100%; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 0.3rem 0.5rem; text-align: right; white-space: nowrap; }}
th:first-child, td:first-child, th:nth-child(2), td:nth-child(2) {{ text-align: left; }}
th {{ background: #f4f4f4; }}
.figures {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 1rem; }}
figure {{ margin: 0; }} img {{ width: 100%; height: auto; border: 1px solid #eee; }}
figcaption {{ font-size: 0.8rem; color: #555; }} .scroll {{ overflow-x: auto; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<ul>{note_html}</ul>
<div class="scroll"><table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table></div>
<h2>Figures</h2><div class="figures">{figures}</div>
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path


def build_report(runs: Sequence[Run], rows: Sequence[dict[str, Any]], out_dir: Path, title: str,
                 bandwidth: Bandwidth | None, notes: Sequence[str] = ()) -> Path:
    plots = [*curve_plots(runs, out_dir, bandwidth), *partition_plot(runs, out_dir), *method_plots(runs, out_dir)]
    return write_html(title, rows, plots, out_dir / "report.html", notes)

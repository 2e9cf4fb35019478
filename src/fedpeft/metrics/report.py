"""Figures and a single self-contained HTML page for one run or several side by side.

Figures: metric vs round, vs cumulative uplink bytes, vs (simulated) time, each client's data
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from fedpeft.metrics.compare import Bandwidth, Run, time_axis
from fedpeft.metrics.summary import human_bytes

MAX_PARTITION_PANELS = 6


@dataclass
class Plot:
    slug: str
    title: str
    png: bytes


def _bytes_axis(ax: Any) -> None:
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))


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


def curve_plots(runs: Sequence[Run], out_dir: Path, bandwidth: Bandwidth | None) -> list[Plot]:
    metric = runs[0].metric
    plots = []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        points = run.curve(metric)
        ax.plot([r["round"] for r, _ in points], [v for _, v in points], marker="o", ms=3, label=run.name)
    ax.set(xlabel="round", ylabel=metric, title=f"{metric} per round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plots.append(_save(fig, "metric_vs_round", f"{metric} per round", out_dir))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        points = [(r, v) for r, v in run.curve(metric) if r["round"] > 0]
        ax.plot([r["cum_bytes_up"] for r, _ in points], [v for _, v in points], marker="o", ms=3, label=run.name)
    ax.set_xscale("symlog" if len(runs) == 1 else "log")
    _bytes_axis(ax)
    ax.set(xlabel="cumulative uplink bytes (all clients)", ylabel=metric, title=f"{metric} vs uplink bytes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plots.append(_save(fig, "metric_vs_uplink", f"{metric} vs cumulative uplink bytes", out_dir))

    fig, ax = plt.subplots(figsize=(7, 4.2))
    kinds = set()
    for run in runs:
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
    shown = [run for run in runs if run.partition][:MAX_PARTITION_PANELS]
    if not shown:
        return []
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 2.4 * len(shown)), squeeze=False)
    for ax, run in zip(axes[:, 0], shown):
        clients = run.partition["clients"]
        names = run.partition["label_names"] or ["value"]
        bottom = [0] * len(clients)
        for name in names:
            counts = [c["labels"].get(name, 0) if "labels" in c else c["size"] for c in clients]
            ax.bar(range(len(clients)), counts, bottom=bottom, label=name, width=0.9)
            bottom = [b + n for b, n in zip(bottom, counts)]
        ax.set(xlabel="client", ylabel="examples", title=f"{run.name}: data per client")
        if len(names) <= 12:
            ax.legend(fontsize=7, ncol=min(len(names), 6))
    return [_save(fig, "partition", "training examples per client, by label", out_dir)]


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


def _is_matrix(value: Any) -> bool:
    return (isinstance(value, list) and len(value) > 0 and all(isinstance(row, list) and row for row in value)
            and all(isinstance(x, int | float) for row in value for x in row))


def method_plots(runs: Sequence[Run], out_dir: Path) -> list[Plot]:
    """Line plots of each logged scalar, heatmaps of each logged matrix (last round), per run."""
    plots = []
    for run in runs:
        series: dict[str, list[tuple[int, float]]] = {}
        matrices: dict[str, tuple[int, list[list[float]]]] = {}
        for record in run.trained:
            flat: dict[str, Any] = {}
            _flatten("", record.get("method", {}), flat)
            for key, value in flat.items():
                if isinstance(value, bool):
                    continue
                if isinstance(value, int | float):
                    series.setdefault(key, []).append((record["round"], float(value)))
                elif _is_matrix(value):
                    matrices[key] = (record["round"], value)
        slug_base = "".join(ch if ch.isalnum() else "_" for ch in run.name)
        if series:
            keys = sorted(series)
            fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.0 * len(keys) + 0.6), squeeze=False)
            for ax, key in zip(axes[:, 0], keys):
                ax.plot([x for x, _ in series[key]], [y for _, y in series[key]], marker=".", ms=4)
                ax.set(ylabel=key, xlabel="round")
                ax.grid(alpha=0.3)
            axes[0, 0].set_title(f"{run.name}: method values per round")
            plots.append(_save(fig, f"method_{slug_base}", f"{run.name}: method-specific values", out_dir))
        for key, (round_idx, matrix) in sorted(matrices.items()):
            fig, ax = plt.subplots(figsize=(7, 3.6))
            image = ax.imshow(matrix, aspect="auto", cmap="viridis")
            fig.colorbar(image, ax=ax)
            ax.set(title=f"{run.name}: {key} (round {round_idx})", xlabel="column", ylabel="row")
            slug = f"heatmap_{slug_base}_{''.join(ch if ch.isalnum() else '_' for ch in key)}"
            plots.append(_save(fig, slug, f"{run.name}: {key}", out_dir))
    return plots


def _fmt(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if "bytes" in key:
        return human_bytes(float(value))
    if "seconds" in key:
        return _seconds_label(float(value))
    if key in ("best_metric", "final_metric", "target"):
        return f"{float(value):.4f}"
    if key == "trainable_params" or key == "client_flops_per_step":
        return f"{int(value):,}" if key == "trainable_params" else f"{float(value) / 1e9:.2f} GFLOP"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


TABLE_COLUMNS = [
    ("run", "run"), ("method", "method"), ("trainable_params", "trainable params"), ("best_metric", "best"),
    ("rounds_to_target", "rounds to target"), ("bytes_to_target", "bytes to target"),
    ("seconds_to_target", "time to target"), ("uplink_bytes_per_client_round", "up / client / round"),
    ("downlink_bytes_per_client_round", "down / client / round"), ("client_flops_per_step", "client FLOPs / step"),
    ("wall_seconds", "wall time"),
]


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    return [[_fmt(row.get(key), key) for key, _ in TABLE_COLUMNS] for row in rows]


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

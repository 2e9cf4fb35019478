"""The headline comparison of each of the five papers, at CPU scale, in one table (the README's).

Each paper's benchmark (``benchmarks/<name>.py``) runs its full comparison on the real MiniLM and
``../shared/data`` and commits ``benchmarks/results/<name>.json``. This suite first reruns each
benchmark with the exact command recorded in its JSON (finished runs in the benchmarks' work
directories are reused, so this only computes what is missing), then picks from each JSON the rows
of the paper's headline claim, compares every method with the paper's baseline on the same rows
(accuracy difference, uplink ratio), and writes:

- ``benchmarks/results/suite.json`` and ``suite.md`` (the table, the claims, the commands);
- ``benchmarks/results/suite.png``: best accuracy vs uplink bytes per client and round, one panel
  per paper;
- the table into ``README.md`` between the ``suite:begin`` / ``suite:end`` markers.

Run: ``.venv/bin/python benchmarks/suite.py`` (``--report-only`` skips the reruns).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- suite:begin -->", "<!-- suite:end -->"


@dataclass(frozen=True)
class Headline:
    """One paper's headline comparison: which rows of which benchmark, against which baseline."""

    paper: str
    benchmark: str
    claim: str
    cells: tuple[tuple[str, str], ...]  # (task, partition) pairs, as the benchmark names them
    methods: tuple[str, ...]
    baseline: str


HEADLINES = (
    Headline("FeDeRA", "federa", "converges faster than LoRA and degrades less as alpha falls",
             (("sst2", "dirichlet1.0"), ("20newsgroups", "dirichlet1.0")),
             ("lora_r32", "federa_r32", "lora_r32_lr5e-3", "federa_r32_lr5e-3", "full"), "lora_r32"),
    Headline("FedTT / FedTT+", "fedtt", "~10x less uplink than LoRA r=8 within ~1 point; FedTT+ less still and "
             "more robust under severe heterogeneity",
             (("sst2", "iid5"), ("sst2", "severe")),
             ("lora_r8", "fedtt", "fedtt_plus", "fedtt_up1e-3", "fedtt_plus_up1e-3"), "lora_r8"),
    Headline("FLASC", "flasc", "matches dense LoRA with several times less communication",
             (("20newsgroups", "dirichlet(alpha=0.1, clients=100)"),),
             ("lora_r16", "lora_r16_slr0.005", "flasc_d0.25", "flasc_down0.25_up0.0156", "sparse_adapter_d0.25"),
             "lora_r16"),
    Headline("Head pruning", "headprune", "90% head sparsity: ~1.8x less uplink, several times fewer training "
             "FLOPs, < 2 points lost",
             (("mnli", "iid_10x2"),), ("b1_random", "headprune_random", "headprune_lossgap"), "b1_random"),
    Headline("FedPepTAO", "fedpeptao", "more accurate than the prompt baselines with ~40% less communication "
             "than full P-tuning v2",
             (("mr", "dirichlet1.0"), ("rte", "dirichlet1.0")), ("p_tuning_v2", "prompt_tuning", "fedpeptao"),
             "p_tuning_v2"),
)


def load(benchmark: str) -> dict[str, Any] | None:
    path = RESULTS / f"{benchmark}.json"
    return json.loads(path.read_text()) if path.exists() else None


def rerun(result: dict[str, Any]) -> None:
    """The benchmark's own recorded command, from the repository root, with this interpreter."""
    argv = shlex.split(result["command"])
    if argv and argv[0].startswith("python"):
        argv[0] = sys.executable
    print("$", " ".join(argv), flush=True)
    subprocess.run(argv, cwd=ROOT, check=True)


def headline_rows(headline: Headline, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The headline's rows, each compared with the baseline of its own (task, partition) cell (the
    method a result names as its ``reference``, where it names one: FLASC's better dense LoRA)."""
    by_key = {(r["task"], r["partition"], r["method"]): r for r in result["rows"]}
    baseline = result.get("reference") or headline.baseline
    rows = []
    for task, partition in headline.cells:
        base = by_key.get((task, partition, baseline))
        for method in headline.methods:
            row = by_key.get((task, partition, method))
            if row is None:
                continue
            up = row["uplink_bytes_per_client_round"]
            rows.append({
                "paper": headline.paper, "task": task, "partition": partition, "method": method,
                "is_baseline": method == baseline,
                "metric": row["metric"], "best_metric": row["best_metric"], "final_metric": row["final_metric"],
                "trainable_params": row["trainable_params"], "uplink_bytes_per_client_round": up,
                "rounds_to_target": row.get("rounds_to_target"),
                "client_flops_per_step": row.get("client_flops_per_step"),
                "points_vs_baseline": None if base is None else 100 * (row["best_metric"] - base["best_metric"]),
                "uplink_vs_baseline": None if base is None or not up else base["uplink_bytes_per_client_round"] / up,
            })
    return rows


def human_bytes(value: float) -> str:
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| paper | task, partition | method | trainable params | best acc | vs baseline (points) | "
             "uplink / client / round | uplink saving vs baseline | rounds to target (the benchmark's rule) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        points = "baseline" if r["is_baseline"] else (
            "-" if r["points_vs_baseline"] is None else f"{r['points_vs_baseline']:+.1f}")
        saving = "-" if r["uplink_vs_baseline"] is None else f"{r['uplink_vs_baseline']:.1f}x"
        lines.append(f"| {r['paper']} | {r['task']}, {r['partition']} | `{r['method']}` | {r['trainable_params']:,} | "
                     f"{r['best_metric']:.3f} | {points} | {human_bytes(r['uplink_bytes_per_client_round'])} | "
                     f"{saving} | {r['rounds_to_target'] if r['rounds_to_target'] is not None else '-'} |")
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    papers = [h.paper for h in HEADLINES if any(r["paper"] == h.paper for r in rows)]
    columns = min(len(papers), 3)
    lines = -(-len(papers) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5.2 * columns, 4.2 * lines), squeeze=False)
    for ax in axes.flat[len(papers):]:
        ax.set_visible(False)
    for ax, paper in zip(axes.flat, papers):
        for r in (r for r in rows if r["paper"] == paper):
            point = (r["uplink_bytes_per_client_round"] / 1e3, r["best_metric"])
            ax.scatter(*point, s=28)
            ax.annotate(f"{r['method']}\n({r['task']}, {r['partition'][:12]})", point, fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(paper)
        ax.set_xlabel("uplink per client and round (KB, log)")
        ax.set_ylabel("best accuracy")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_readme(block: list[str]) -> None:
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(head + BEGIN + "\n" + "\n".join(block) + "\n" + END + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report-only", action="store_true", help="assemble from the committed results only")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    commands: dict[str, str] = {}
    baselines: dict[str, str] = {}
    missing = []
    for headline in HEADLINES:
        result = load(headline.benchmark)
        if result is None:
            missing.append(headline.benchmark)
            continue
        if not args.report_only:
            rerun(result)
            result = load(headline.benchmark) or result
        commands[headline.benchmark] = result["command"]
        baselines[headline.benchmark] = result.get("reference") or headline.baseline
        rows += headline_rows(headline, result)
    claims = [f"- **{h.paper}** (`benchmarks/{h.benchmark}.py`, baseline `{baselines[h.benchmark]}`): {h.claim}."
              for h in HEADLINES if h.benchmark in commands]
    block = [
        "Regenerate: `python benchmarks/suite.py` (reruns each benchmark's recorded command, reusing finished runs, "
        "then rebuilds this table and `benchmarks/results/suite.png`). Real all-MiniLM-L6-v2 on `../shared/data`, "
        "scaled to a 2-core CPU: absolute accuracies are far below the papers'; the comparisons are the point. "
        "Uplink = mean length of the real serialized client messages; \"vs baseline\" compares best accuracy "
        "(percentage points) and uplink with the paper's baseline in the same task and partition.",
        "",
        *table(rows),
        "",
        "Claims checked (each benchmark's markdown in `benchmarks/results/` says what was measured against them):",
        "",
        *claims,
    ]
    if missing:
        block += ["", f"Not yet run: {', '.join(missing)}."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "suite.json").write_text(json.dumps({"benchmark": "suite", "command": "python benchmarks/suite.py",
                                                    "benchmark_commands": commands, "rows": rows}, indent=1) + "\n")
    (RESULTS / "suite.md").write_text("# Headline comparisons of the five papers\n\n" + "\n".join(block) + "\n")
    if rows:
        plot(rows, RESULTS / "suite.png")
    write_readme(block)
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()

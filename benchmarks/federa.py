"""FeDeRA vs LoRA (FedLR) and the PEFT baselines under label skew, with the real MiniLM.

Paper claims checked (Yan et al. 2024, ``papers/001``): FeDeRA converges faster than LoRA
(Table 5: time to 90/95/99% of a target accuracy) and loses less accuracy as the Dirichlet alpha
falls (Fig. 1, Fig. 5); its global LoRA matrices change less in magnitude and direction from round
to round (Fig. 3-4, Eq. 11-14). Methods: ``full`` (FedFT), ``lora`` (FedLR, r = 32 = alpha on
query/value, PEFT's kaiming A / zero B), ``federa`` (same shape, SVD init), ``bitfit`` (FedBF),
``adapter`` (FedAP, Houlsby bottleneck adapters), all with FedAvg at an equal budget of rounds.

Scaled to a shared 2-core CPU: SST-2 and 20 Newsgroups, each subsampled to a fixed 2,000 training
/ 240 evaluation examples (50 per client on average), 64 tokens (20 Newsgroups: e-mail headers
kept, since the first 64 tokens of a stripped post carry too little signal to learn within a few
tens of rounds; the FLASC benchmark keeps them too, as its released code does), 40 clients with 4
sampled per round (10% participation, as the paper's 10 of 100; with 2 per round a Dirichlet(0.1)
SST-2 round averages two one-class clients and the global model only flips between the classes),
Dirichlet alpha in {0.1, 1.0} over labels and iid, 1 local epoch of AdamW at batch 16 (the
paper's). Learning rates: LoRA and FeDeRA at the top of the paper's grid (1e-3) and at 5e-3
(``_lr5e-3``: a budget of 12 rounds is tiny beside the paper's 200+, and at 1e-3 nothing moved off
chance on 20 Newsgroups within it); BitFit and adapters at 5e-3 (``--lr``); full fine-tuning at
1e-4 (``--full-lr``). The paper's 100 clients, 256 tokens and 200-1000 rounds are out of reach here.

Outputs (``benchmarks/results/``): ``federa.json`` (SPEC's results format plus per-round curves),
``federa.md`` (tables and what was measured), ``federa_accuracy.png`` (accuracy per round),
``federa_alpha.png`` (final accuracy vs alpha), ``federa_bytes.png`` (accuracy vs cumulative
bytes) and ``federa_variation.png`` (Eq. 13-14 per round, LoRA vs FeDeRA, as Fig. 3-4).

Run: ``.venv/bin/python benchmarks/federa.py`` (``--methods``/``--partitions``/``--tasks`` select a
subset; runs already finished in ``--work-dir`` are reused, interrupted ones resumed;
``--workers`` runs that many experiments in parallel, one thread each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import first_round_at, run_child
from fedpeft.config import deep_merge

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).parent / "results"
TARGET_FRACTIONS = (0.9, 0.95)  # of the best final accuracy of any method in the same task/partition cell

# name -> (recipe, overrides); in priority order: the paper's claim is about lora vs federa
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "lora_r32": ("lora", {"adapter": {"r": 32, "alpha": 32}, "client": {"lr": 0.001}}),
    "federa_r32": ("federa", {"client": {"lr": 0.001}}),
    "lora_r32_lr5e-3": ("lora", {"adapter": {"r": 32, "alpha": 32}, "client": {"lr": 0.005}}),
    "federa_r32_lr5e-3": ("federa", {"client": {"lr": 0.005}}),
    "full": ("full", {}),
    "bitfit": ("bitfit", {}),
    "adapter": ("adapter", {}),
}
PAIRS = (("lora_r32", "federa_r32"), ("lora_r32_lr5e-3", "federa_r32_lr5e-3"))
PARTITIONS: dict[str, dict[str, Any]] = {
    "dirichlet0.1": {"kind": "dirichlet", "alpha": 0.1},
    "dirichlet1.0": {"kind": "dirichlet", "alpha": 1.0},
    "iid": {"kind": "iid"},
}
TASKS: dict[str, dict[str, Any]] = {
    "sst2": {"name": "sst2", "max_train_examples": 2000, "max_eval_examples": 240, "max_length": 64},
    "20newsgroups": {"name": "20newsgroups", "max_train_examples": 2000, "max_eval_examples": 240, "max_length": 64,
                     "strip_newsgroup_metadata": False},
}


def experiment(task: str, partition: str, method: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    recipe, overrides = METHODS[method]
    lr = args.full_lr if recipe == "full" else args.lr
    raw = {
        "method": recipe,
        "seed": args.seed,
        "rounds": args.rounds,
        "task": TASKS[task],
        "partition": {**PARTITIONS[partition], "num_clients": args.clients},
        "model": {"name": "minilm"},
        "client": {"optimizer": "adamw", "lr": lr, "batch_size": 16, "local_epochs": 1},
        "strategy": {"name": "fedavg", "clients_per_round": args.per_round},
        "engine": {"threads": 1},
        "evaluation": {"every": args.eval_every, "at_start": True},
        "output": {"run_dir": str(run_dir), "progress": False},
    }
    return deep_merge(raw, overrides)


def finished(run_dir: Path, rounds: int) -> bool:
    from fedpeft.metrics.recorder import load_metrics

    records = load_metrics(run_dir)
    return bool(records) and records[-1]["round"] >= rounds


def launch(job: tuple[str, str, str], args: argparse.Namespace) -> None:
    task, partition, method = job
    run_dir = args.work_dir / f"{task}_{partition}_{method}_s{args.seed}"
    if finished(run_dir, args.rounds):
        return
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    config_path = args.work_dir / f"{run_dir.name}.json"
    config_path.write_text(json.dumps(experiment(task, partition, method, args, run_dir)))
    log = args.work_dir / f"{run_dir.name}.log"
    t0 = time.time()
    with log.open("a") as handle:
        code = subprocess.run([sys.executable, __file__, "--child", str(config_path)], stdout=handle,
                              stderr=subprocess.STDOUT).returncode
    print(f"{run_dir.name}: {time.time() - t0:.0f} s" + (f" (failed, see {log})" if code else ""), flush=True)


def failure_reasons(jobs: list[tuple[str, str, str]], args: argparse.Namespace) -> dict[tuple[str, str, str], str]:
    """Jobs that produced no finished run, with the last line of their log (e.g. a partition that a
    Dirichlet draw cannot fill)."""
    reasons = {}
    for job in jobs:
        name = f"{job[0]}_{job[1]}_{job[2]}_s{args.seed}"
        if finished(args.work_dir / name, args.rounds):
            continue
        log = args.work_dir / f"{name}.log"
        lines = log.read_text().strip().splitlines() if log.exists() else []
        reasons[job] = lines[-1] if lines else "not run"
    return reasons


# --- results ---------------------------------------------------------------------------------------

def variation_curves(records: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    keys = ("magnitude_variation_A", "magnitude_variation_B", "direction_variation_A", "direction_variation_B")
    trained = [r for r in records if r["round"] > 0]
    if not any(k in r.get("method", {}) for r in trained for k in keys):
        return {}
    return {k: [r["method"].get(k) for r in trained] for k in keys}


def build_rows(jobs: list[tuple[str, str, str]], args: argparse.Namespace) -> list[dict[str, Any]]:
    from fedpeft.metrics.recorder import load_metrics

    # a run with more rounds than the budget is cut at the budget: nothing in a round depends on the
    # total number of rounds, so its first ``args.rounds`` rounds are exactly a run of that length
    runs = {job: [r for r in load_metrics(args.work_dir / f"{job[0]}_{job[1]}_{job[2]}_s{args.seed}")
                  if r["round"] <= args.rounds] for job in jobs}
    runs = {job: records for job, records in runs.items() if records and records[-1]["round"] == args.rounds}
    metric = "accuracy"
    rows = []
    for (task, partition, method), records in runs.items():
        cell = [r for (t, p, _), r in runs.items() if (t, p) == (task, partition)]
        reference = max(r[-1]["eval"][metric] for r in cell)
        trained = [r for r in records if r["round"] > 0]
        evaluated = [r for r in records if metric in r["eval"]]
        ups = [b for r in trained for b in r["bytes_up"]]
        downs = [b for r in trained for b in r["bytes_down"]]
        last = records[-1]
        row: dict[str, Any] = {
            "task": task, "partition": partition, "method": method, "seed": args.seed, "rounds": args.rounds,
            "clients": args.clients, "clients_per_round": args.per_round, "metric": metric,
            "best_metric": max(r["eval"][metric] for r in evaluated),
            "final_metric": last["eval"][metric],
            "trainable_params": last["trainable_params"],
            "uplink_bytes_per_client_round": sum(ups) / len(ups),
            "downlink_bytes_per_client_round": sum(downs) / len(downs),
            "total_bytes": last["cum_bytes_up"] + last["cum_bytes_down"],
            "wall_seconds": last["cum_wall_seconds"],
            "client_flops_per_step": last["client_flops_per_step"],
            "reference_metric": reference,
        }
        for fraction in TARGET_FRACTIONS:
            hit = first_round_at(records, metric, fraction * reference)
            pct = round(fraction * 100)
            row[f"rounds_to_{pct}pct"] = hit["round"] if hit else None
            row[f"bytes_to_{pct}pct"] = hit["cum_bytes_up"] + hit["cum_bytes_down"] if hit else None
        row["rounds_to_target"] = row["rounds_to_90pct"]
        row["bytes_to_target"] = row["bytes_to_90pct"]
        row["accuracy_per_round"] = [[r["round"], r["eval"][metric]] for r in evaluated]
        row["cumulative_bytes_per_round"] = [r["cum_bytes_up"] + r["cum_bytes_down"] for r in records]
        row["train_loss_per_round"] = [r["train_loss"] for r in trained]
        row["variation_per_round"] = variation_curves(records)
        rows.append(row)
    return rows


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_markdown(rows: list[dict[str, Any]], args: argparse.Namespace, command: str, machine: str,
                   failures: dict[tuple[str, str, str], str]) -> None:
    lines = [
        "# FeDeRA benchmark: LoRA vs FeDeRA (and FedFT, BitFit, Adapter) under label skew",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}",
        "",
        f"Setup: MiniLM (all-MiniLM-L6-v2), {args.clients} clients, {args.per_round} per round, {args.rounds} "
        f"rounds, 1 local epoch, AdamW batch 16, lr 1e-3 (`lora_r32`, `federa_r32`), 5e-3 (`_lr5e-3` "
        f"variants), {args.lr} (BitFit, adapter), {args.full_lr} (full), "
        f"evaluation every {args.eval_every} rounds on a fixed test subsample; seed {args.seed}. "
        "LoRA and FeDeRA: r = alpha = 32 on query/value + head. See the script's docstring.",
        "",
        "Targets: `rounds_to_90pct` / `rounds_to_95pct` = first evaluated round whose accuracy reaches 90% / 95% of "
        "the best *final* accuracy of any method in the same task/partition cell (`reference`); `-` = never "
        "reached. `rounds_to_target` in the JSON is the 90% one; bytes count both directions, all clients.",
        "",
        "| task | partition | method | trainable | up B/client/round | final acc | best acc | reference | "
        "rounds to 90% | rounds to 95% | MB to 90% | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mb = None if r["bytes_to_90pct"] is None else r["bytes_to_90pct"] / 1e6
        lines.append(
            f"| {r['task']} | {r['partition']} | {r['method']} | {r['trainable_params']:,} | "
            f"{r['uplink_bytes_per_client_round']:,.0f} | {fmt(r['final_metric'])} | {fmt(r['best_metric'])} | "
            f"{fmt(r['reference_metric'])} | {r['rounds_to_90pct'] or '-'} | {r['rounds_to_95pct'] or '-'} | "
            f"{fmt(mb, 1)} | {r['wall_seconds']:.0f} |")
    if failures:
        lines += ["", "Runs without results:", ""]
        lines += [f"- {task}, {partition}, {method}: `{reason}`"
                  for (task, partition, method), reason in failures.items()]
    lines += ["", "## LoRA vs FeDeRA", ""]
    lines += comparison_lines(rows)
    (RESULTS / "federa.md").write_text("\n".join(lines) + "\n")


def mean_variation(row: dict[str, Any], key: str) -> float | None:
    values = [v for v in row["variation_per_round"].get(key, []) if v is not None]
    return sum(values) / len(values) if values else None


def comparison_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What was measured on the paper's two claims, stated from the numbers (whichever way they go)."""
    by = {(r["task"], r["partition"], r["method"]): r for r in rows}
    out = ["| task | partition | variant | final acc LoRA | final acc FeDeRA | rounds to 90% LoRA | "
           "rounds to 90% FeDeRA | mean dM_B LoRA | mean dM_B FeDeRA | mean dD_B LoRA | mean dD_B FeDeRA |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for task in sorted({r["task"] for r in rows}):
        for lora, federa in PAIRS:
            for partition in PARTITIONS:
                pair = [by.get((task, partition, lora)), by.get((task, partition, federa))]
                if None in pair:
                    continue
                cells = [fmt(r["final_metric"]) for r in pair] + [str(r["rounds_to_90pct"] or "-") for r in pair]
                cells += [fmt(mean_variation(r, key), 4) for key in ("magnitude_variation_B", "direction_variation_B")
                          for r in pair]
                variant = "lr " + (lora.split("_lr")[1] if "_lr" in lora else "1e-3")
                out.append(f"| {task} | {partition} | {variant} | " + " | ".join(cells) + " |")
    out.append("")
    for task in sorted({r["task"] for r in rows}):
        for method in METHODS:
            iid, skewed = by.get((task, "iid", method)), by.get((task, "dirichlet0.1", method))
            if iid and skewed:
                drop = iid["final_metric"] - skewed["final_metric"]
                out.append(f"- {task}, {method}: final accuracy iid {fmt(iid['final_metric'])} -> Dirichlet 0.1 "
                           f"{fmt(skewed['final_metric'])} (drop {fmt(drop)}).")
    return out


def cell_grid(plt: Any, rows: list[dict[str, Any]]) -> tuple[Any, dict[tuple[str, str], Any]]:
    """One panel per (task, partition) cell present in ``rows``: a row of panels per task."""
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    partitions = [p for p in PARTITIONS if any(r["partition"] == p for r in rows)]
    fig, axes = plt.subplots(len(tasks), len(partitions), figsize=(5 * len(partitions), 4 * len(tasks)),
                             squeeze=False)
    cells = {(t, p): axes[i][j] for i, t in enumerate(tasks) for j, p in enumerate(partitions)}
    return fig, cells


def plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, cells = cell_grid(plt, rows)
    for (task, partition), ax in cells.items():
        for r in rows:
            if (r["task"], r["partition"]) == (task, partition):
                rounds, acc = zip(*r["accuracy_per_round"])
                ax.plot(rounds, acc, marker=".", label=r["method"])
        ax.set_title(f"{task}, {partition}")
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    next(iter(cells.values())).legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "federa_accuracy.png", dpi=110)
    plt.close(fig)

    fig, cells = cell_grid(plt, rows)
    for (task, partition), ax in cells.items():
        for r in rows:
            if (r["task"], r["partition"]) == (task, partition):
                rounds, acc = zip(*r["accuracy_per_round"])
                cumulative = r["cumulative_bytes_per_round"]  # index = round (round 0 evaluated at start)
                ax.plot([cumulative[k] / 1e6 for k in rounds], acc, marker=".", label=r["method"])
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_title(f"{task}, {partition}")
        ax.set_xlabel("cumulative MB (up + down, all clients)")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    next(iter(cells.values())).legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "federa_bytes.png", dpi=110)
    plt.close(fig)

    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for method in METHODS:
            points = [(list(PARTITIONS).index(r["partition"]), r["final_metric"]) for r in rows
                      if r["task"] == task and r["method"] == method]
            if points:
                points.sort()
                ax.plot(*zip(*points), marker="o", label=method)
        ax.set_xticks(range(len(PARTITIONS)), list(PARTITIONS))
        ax.set_title(f"{task}: final accuracy vs heterogeneity")
        ax.set_ylabel("final accuracy")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "federa_alpha.png", dpi=110)
    plt.close(fig)

    variation_rows = [r for r in rows if r["variation_per_round"]]
    if not variation_rows:
        return
    keys = ("magnitude_variation_A", "magnitude_variation_B", "direction_variation_A", "direction_variation_B")
    partitions = [p for p in PARTITIONS if any(r["partition"] == p for r in variation_rows)]
    fig, axes = plt.subplots(len(keys), len(partitions), figsize=(5 * len(partitions), 3 * len(keys)), squeeze=False)
    for j, partition in enumerate(partitions):
        for i, key in enumerate(keys):
            ax = axes[i][j]
            for r in variation_rows:
                if r["partition"] == partition and r["task"] == tasks[0]:
                    values = r["variation_per_round"][key]
                    ax.plot(range(1, len(values) + 1), values, label=r["method"])
            ax.set_yscale("log")
            ax.set_title(f"{partition}: {key} (mean over matrices)", fontsize=9)
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "federa_variation.png", dpi=110)
    plt.close(fig)


def reproducing_arguments(argv: list[str]) -> list[str]:
    """The arguments that decide the results (not ``--workers``/``--report-only``/``--work-dir``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--workers", "--work-dir"):
            skip = True
        elif arg != "--report-only" and not arg.startswith(("--workers=", "--work-dir=")):
            kept.append(arg)
    return kept


def machine() -> str:
    load = os.getloadavg()[0]
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs (1-min load {load:.1f} at "
            f"the end), Python {platform.python_version()}, {platform.system()}, one torch thread per run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--partitions", default=",".join(PARTITIONS))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--per-round", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--lr", type=float, default=5e-3, help="BitFit and adapters")
    parser.add_argument("--full-lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench_federa"))
    parser.add_argument("--report-only", action="store_true", help="rebuild the results from finished runs")
    args = parser.parse_args()
    if args.child is not None:
        run_child(args.child)
        return

    jobs = [(t, p, m) for m in args.methods.split(",") for p in args.partitions.split(",")
            for t in args.tasks.split(",")]
    unknown = [x for t, p, m in jobs for x in (t, p, m) if x not in {**TASKS, **PARTITIONS, **METHODS}]
    if unknown:
        parser.error(f"unknown task/partition/method: {sorted(set(unknown))}")
    # priority: lora and federa over every partition first, then the baselines
    order = list(METHODS)
    jobs.sort(key=lambda job: (order.index(job[2]) // 2, list(TASKS).index(job[0]), list(PARTITIONS).index(job[1]),
                               order.index(job[2])))
    if not args.report_only:
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            for future in [pool.submit(launch, job, args) for job in jobs]:
                future.result()
    rows = build_rows(jobs, args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/federa.py " + " ".join(reproducing_arguments(sys.argv[1:]))
    host = machine()
    (RESULTS / "federa.json").write_text(json.dumps(
        {"benchmark": "federa", "command": command.strip(), "machine": host, "rows": rows}, indent=1) + "\n")
    write_markdown(rows, args, command.strip(), host, failure_reasons(jobs, args))
    plot(rows)
    print(f"wrote {RESULTS / 'federa.json'} ({len(rows)} rows)")


if __name__ == "__main__":
    main()

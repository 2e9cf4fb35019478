"""FeDeRA vs LoRA, full fine-tuning, BitFit and adapters on NER (WNUT 2017) and extractive QA (SQuAD v1.1).

Paper claim checked (Yan et al. 2024, ``papers/001``, Tables 3-4): FeDeRA is close to full
fine-tuning (FedFT) and ahead of LoRA (FedLR), BitFit (FedBF) and adapters (FedAP) in entity F1 on
WNUT 2017 and in EM/F1 on SQuAD v1.1, and reaches a target sooner (Table 5). Methods, all FedAvg at
an equal budget of rounds: ``full`` (FedFT), ``lora`` (FedLR: r = alpha = 32 on query/value, PEFT's
kaiming A / zero B), ``federa`` (same shape, SVD init), ``bitfit`` (FedBF), ``adapter`` (FedAP,
Houlsby bottleneck 64), each with its task head trained.

FeDeRA's settings (Table 1, Sec. 5.2, App. A.2) scaled to a shared 2-core CPU and MiniLM
(all-MiniLM-L6-v2, the one real model available offline):

- WNUT 2017: 30 clients, 5 sampled per round, Dirichlet alpha 0.1 over the label-set classes of
  App. A.2 (a sentence's class is the set of distinct tags it holds), 64 tokens (the paper's), a
  fixed subsample of the training sentences and of the dev sentences (entity F1 with seqeval);
- SQuAD v1.1: the dev file's articles split by title (39 train / 9 eval, see
  ``fedpeft.data.squad``); one client per training article (``partition: natural``, 39 clients:
  as many as the articles allow, where the paper has 300), 4 sampled per round; 192-token windows
  overlapping by 64 (the paper: 384), a fixed subsample of questions; EM and F1 per question.

One local epoch of AdamW at batch 16 (the paper's); lr 1e-3 for the PEFT methods and 1e-4 for full
fine-tuning (the paper picks each from a grid between 1e-5 and 1e-3). The paper's 100-500 rounds
are out of reach: a run here has ``--ner-rounds`` / ``--qa-rounds`` rounds.

Targets: ``rounds_to_target`` is the first evaluated round whose primary metric (entity F1; SQuAD
F1, with EM reported beside it) reaches 90% of the best value any method reached in the same task
(the scaled counterpart of Table 5's fixed targets); bytes and simulated time to it likewise.

Outputs (``--results-dir``, default ``benchmarks/results/``): ``federa_ner_qa.json`` (SPEC's results
format plus per-round curves), ``federa_ner_qa.md`` and ``federa_ner_qa.png`` (metric per round).

Run: ``.venv/bin/python benchmarks/federa_ner_qa.py --workers 2`` (``--tasks``/``--methods`` select a
subset; runs already finished in ``--work-dir`` are reused, interrupted ones resumed; ``--report-only``
rebuilds the results from finished runs). Measured on the shared 2-core CPU, a training step of
16 examples takes about 1-2 s on WNUT (64 tokens) and 7-15 s on SQuAD (192 tokens), so one run
with the defaults takes about 7 minutes (single thread) and the ten runs about 70 minutes of one
core: 40-50 minutes with two workers on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import first_round_at, run_child
from federa import finished, fmt, machine, reproducing_arguments
from fedpeft.config import deep_merge

TARGET_FRACTION = 0.9

METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "lora_r32": ("lora", {"adapter": {"r": 32, "alpha": 32}}),
    "federa_r32": ("federa", {}),
    "full": ("full", {}),
    "bitfit": ("bitfit", {}),
    "adapter": ("adapter", {}),
}


def task_settings(task: str, args: argparse.Namespace) -> dict[str, Any]:
    """The config sections that differ between the two tasks."""
    if task == "wnut17":
        return {
            "task": {"name": "wnut17", "max_length": 64, "max_train_examples": args.ner_train,
                     "max_eval_examples": args.ner_eval, "token_class_by": "tags"},
            "partition": {"kind": "dirichlet", "alpha": 0.1, "num_clients": 30},
            "strategy": {"name": "fedavg", "clients_per_round": 5},
            "rounds": args.ner_rounds,
            "evaluation": {"every": args.ner_eval_every, "at_start": True, "batch_size": 64},
        }
    return {
        "task": {"name": "squad", "max_length": 192, "doc_stride": 64, "max_train_examples": args.qa_train,
                 "max_eval_examples": args.qa_eval},
        "partition": {"kind": "natural", "num_clients": 39},
        "strategy": {"name": "fedavg", "clients_per_round": 4},
        "rounds": args.qa_rounds,
        "evaluation": {"every": args.qa_eval_every, "at_start": True, "batch_size": 32},
    }


TASKS = {"wnut17": ("entity_f1", ()), "squad": ("squad_f1", ("exact_match",))}
"""task -> (primary metric, metrics reported beside it)."""


def experiment(task: str, method: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    recipe, overrides = METHODS[method]
    raw = {
        "method": recipe,
        "seed": args.seed,
        "model": {"name": "minilm"},
        "client": {"optimizer": "adamw", "lr": args.full_lr if recipe == "full" else args.lr, "batch_size": 16,
                   "local_epochs": 1},
        "engine": {"threads": 1},
        "output": {"run_dir": str(run_dir), "progress": False},
        **task_settings(task, args),
    }
    return deep_merge(raw, overrides)


def run_dir_of(task: str, method: str, args: argparse.Namespace) -> Path:
    return args.work_dir / f"{task}_{method}_s{args.seed}"


def rounds_of(task: str, args: argparse.Namespace) -> int:
    return args.ner_rounds if task == "wnut17" else args.qa_rounds


def launch(job: tuple[str, str], args: argparse.Namespace) -> None:
    task, method = job
    run_dir = run_dir_of(task, method, args)
    if finished(run_dir, rounds_of(task, args)):
        return
    args.work_dir.mkdir(parents=True, exist_ok=True)
    config_path = args.work_dir / f"{run_dir.name}.json"
    config_path.write_text(json.dumps(experiment(task, method, args, run_dir)))
    t0 = time.time()
    with (args.work_dir / f"{run_dir.name}.log").open("a") as handle:
        subprocess.run([sys.executable, __file__, "--child", str(config_path)], check=True, stdout=handle,
                       stderr=subprocess.STDOUT)
    print(f"{run_dir.name}: {time.time() - t0:.0f} s", flush=True)


# --- results ---------------------------------------------------------------------------------------

def build_rows(jobs: list[tuple[str, str]], args: argparse.Namespace) -> list[dict[str, Any]]:
    from fedpeft.metrics.recorder import load_metrics

    runs = {}
    for task, method in jobs:
        budget = rounds_of(task, args)
        records = [r for r in load_metrics(run_dir_of(task, method, args)) if r["round"] <= budget]
        if records and records[-1]["round"] == budget:
            runs[(task, method)] = records
    rows = []
    for (task, method), records in runs.items():
        metric, extras = TASKS[task]
        evaluated = [r for r in records if metric in r["eval"]]
        reference = max(r["eval"][metric] for (t, _), cell in runs.items() if t == task for r in cell
                        if metric in r["eval"])
        hit = first_round_at(records, metric, TARGET_FRACTION * reference)
        trained = [r for r in records if r["round"] > 0]
        ups = [b for r in trained for b in r["bytes_up"]]
        downs = [b for r in trained for b in r["bytes_down"]]
        settings = task_settings(task, args)
        last = records[-1]
        row: dict[str, Any] = {
            "task": task,
            "partition": f"{settings['partition']['kind']}" + (
                f"{settings['partition']['alpha']}" if settings["partition"]["kind"] == "dirichlet" else ""),
            "method": method, "seed": args.seed, "rounds": rounds_of(task, args),
            "clients": settings["partition"]["num_clients"],
            "clients_per_round": settings["strategy"]["clients_per_round"],
            "metric": metric,
            "best_metric": max(r["eval"][metric] for r in evaluated),
            "final_metric": last["eval"][metric],
            "trainable_params": last["trainable_params"],
            "uplink_bytes_per_client_round": sum(ups) / len(ups),
            "downlink_bytes_per_client_round": sum(downs) / len(downs),
            "total_bytes": last["cum_bytes_up"] + last["cum_bytes_down"],
            "target_metric": TARGET_FRACTION * reference,
            "rounds_to_target": hit["round"] if hit else None,
            "bytes_to_target": hit["cum_bytes_up"] + hit["cum_bytes_down"] if hit else None,
            "simulated_seconds_to_target": hit["time"]["cum_simulated"] if hit else None,
            "wall_seconds": last["cum_wall_seconds"],
            "client_flops_per_step": last["client_flops_per_step"],
            "train_examples": settings["task"]["max_train_examples"],
            "eval_examples": settings["task"]["max_eval_examples"],
            "metric_per_round": {name: [[r["round"], r["eval"][name]] for r in evaluated]
                                 for name in (metric, *extras)},
            "train_loss_per_round": [r["train_loss"] for r in trained],
        }
        for name in extras:
            row[f"best_{name}"] = max(r["eval"][name] for r in evaluated)
            row[f"final_{name}"] = last["eval"][name]
        rows.append(row)
    return rows


def claim_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The paper's claim, stated from the numbers whichever way they go."""
    out = []
    by = {(r["task"], r["method"]): r for r in rows}
    for task in TASKS:
        federa, lora, full = by.get((task, "federa_r32")), by.get((task, "lora_r32")), by.get((task, "full"))
        if federa is None:
            continue
        parts = [f"- {task}: FeDeRA final {TASKS[task][0]} {fmt(federa['final_metric'])}"]
        if full is not None:
            parts.append(f"full fine-tuning {fmt(full['final_metric'])} "
                         f"(gap {fmt(full['final_metric'] - federa['final_metric'])})")
        if lora is not None:
            ahead = "ahead of" if federa["final_metric"] > lora["final_metric"] else "not ahead of"
            parts.append(f"LoRA {fmt(lora['final_metric'])}: FeDeRA is {ahead} LoRA; rounds to target FeDeRA "
                         f"{federa['rounds_to_target'] or '-'} vs LoRA {lora['rounds_to_target'] or '-'}")
        out.append(", ".join(parts) + ".")
    return out


def write_markdown(rows: list[dict[str, Any]], args: argparse.Namespace, command: str, host: str) -> None:
    lines = [
        "# FeDeRA on NER (WNUT 2017) and extractive QA (SQuAD v1.1)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {host}",
        "",
        f"MiniLM, 1 local epoch of AdamW at batch 16, lr {args.lr} (PEFT) / {args.full_lr} (full), seed {args.seed}. "
        f"WNUT: {args.ner_train} training sentences over 30 clients (Dirichlet 0.1 over label-set classes, "
        f"App. A.2), 5 per round, {args.ner_rounds} rounds, entity F1 on {args.ner_eval} dev sentences. "
        f"SQuAD: {args.qa_train} training questions of 39 articles, one client per article, 4 per round, "
        f"{args.qa_rounds} rounds, EM/F1 on {args.qa_eval} questions of the 9 held-out articles. "
        "See the script's docstring for what is scaled down and why.",
        "",
        f"Target: {round(TARGET_FRACTION * 100)}% of the best value any method reached on the task (column "
        "`target`); `-` = never reached. Bytes count both directions and all clients.",
        "",
        "| task | method | trainable | up B/client/round | final | best | final EM | target | rounds to target | "
        "MB to target | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mb = None if r["bytes_to_target"] is None else r["bytes_to_target"] / 1e6
        lines.append(
            f"| {r['task']} | {r['method']} | {r['trainable_params']:,} | {r['uplink_bytes_per_client_round']:,.0f} | "
            f"{fmt(r['final_metric'])} ({r['metric']}) | {fmt(r['best_metric'])} | "
            f"{fmt(r.get('final_exact_match'))} | {fmt(r['target_metric'])} | {r['rounds_to_target'] or '-'} | "
            f"{fmt(mb, 1)} | {r['wall_seconds']:.0f} |")
    lines += ["", "## The paper's claim, as measured", "", *claim_lines(rows)]
    (args.results_dir / "federa_ner_qa.md").write_text("\n".join(lines) + "\n")


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(task, name) for task, (metric, extras) in TASKS.items() for name in (metric, *extras)
              if any(r["task"] == task for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (task, name) in zip(axes[0], panels):
        for r in rows:
            if r["task"] == task:
                rounds, values = zip(*r["metric_per_round"][name])
                ax.plot(rounds, values, marker=".", label=r["method"])
        ax.set_title(f"{task}: {name}")
        ax.set_xlabel("round")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def without_results_dir(argv: list[str]) -> list[str]:
    """``argv`` minus ``--results-dir`` and its value (where results go does not change them)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--results-dir":
            skip = True
        elif not arg.startswith("--results-dir="):
            kept.append(arg)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--ner-rounds", type=int, default=15)
    parser.add_argument("--ner-train", type=int, default=1500)
    parser.add_argument("--ner-eval", type=int, default=300)
    parser.add_argument("--ner-eval-every", type=int, default=3)
    parser.add_argument("--qa-rounds", type=int, default=8)
    parser.add_argument("--qa-train", type=int, default=480)
    parser.add_argument("--qa-eval", type=int, default=100)
    parser.add_argument("--qa-eval-every", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--full-lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench_federa_ner_qa"))
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--report-only", action="store_true", help="rebuild the results from finished runs")
    args = parser.parse_args()
    if args.child is not None:
        run_child(args.child)
        return
    jobs = [(task, method) for method in args.methods.split(",") for task in args.tasks.split(",")]
    unknown = sorted({x for job in jobs for x in job if x not in {**TASKS, **METHODS}})
    if unknown:
        parser.error(f"unknown task/method: {unknown}")
    if not args.report_only:
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            for future in [pool.submit(launch, job, args) for job in jobs]:
                future.result()
    rows = build_rows(jobs, args)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    arguments = without_results_dir(reproducing_arguments(sys.argv[1:]))
    command = " ".join(["python benchmarks/federa_ner_qa.py", *arguments])
    host = machine()
    (args.results_dir / "federa_ner_qa.json").write_text(json.dumps(
        {"benchmark": "federa_ner_qa", "command": command, "machine": host, "rows": rows}, indent=1) + "\n")
    write_markdown(rows, args, command, host)
    plot(rows, args.results_dir / "federa_ner_qa.png")
    print(f"wrote {args.results_dir / 'federa_ner_qa.json'} ({len(rows)} rows)")


if __name__ == "__main__":
    main()

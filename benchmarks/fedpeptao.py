"""FedPepTAO vs the prompt baselines (P-tuning v2, prompt tuning, MomD, MomS+AdamD) and LoRA, real MiniLM.

Paper claims checked (Che et al. 2023, ``papers/004``): FedPepTAO reaches higher accuracy than the
prompt baselines (Table 1) in less time (Table 2), and exchanges fewer prompt parameters than full
P-tuning v2 (about 40% less communication, App. B.1 Table 7; 492K vs 6.3M parameters in Table 1).

Setup, scaled to a shared 2-core CPU: MR, RTE and MRPC by default (``--tasks`` adds SST-2, which a
2-core CPU could not afford beside the other benchmarks), all-MiniLM-L6-v2 (6 layers, hidden 384), 100 clients with
10 sampled per round, labels split by Dirichlet alpha 1.0 (the paper's), 1,000 training examples
per task (about 10 per client, so each client runs 1 batch of 16 per local epoch), 64 tokens,
2 local epochs (the paper's), 12 rounds (the paper runs 100), evaluation every 4 rounds on 300
examples of the official dev set (MR: its dev split). Deep prompts: T = 20 tokens per layer,
prefix dropout 0.1, a sequence-classification head (MiniLM ships no masked-LM head, so LM-BFF's
verbalizer, which the paper uses with RoBERTa, is not applicable here). FedPepTAO scores layers on
the clients of rounds 1-4 and selects after round 4 (the paper: t = 5..10) with the Hessian test on
one batch of 8 and 12 Lanczos steps (PyHessian's 50 is out of reach here).

Methods: ``fedpeptao`` (the paper's Alg. 1 eigen-gap ratio; device Adam reset per round, server
eta 1e-3, beta 0.9, control variates), ``fedpeptao_density`` (the same with the released code's
density-threshold ratio), ``p_tuning_v2`` (FedAvg over deep prompts, AdamW), ``prompt_tuning``
(20 input tokens, AdamW), ``lora`` (r 8 on query/value, AdamW 1e-3), ``moms_adamd`` (device Adam,
Alg. 2 server momentum without control variates, all layers), ``momd`` (device SGD momentum 0.9,
lr 0.5, server average). Every prompt method uses lr 0.03 (a few tens of local steps in total is
little for prompts initialised N(0, 1), so the recipes' 0.01 is raised for all of them alike);
``momd`` keeps SGD at 0.5, the most the trained head tolerates: prefix gradients are ~1e-5, so SGD
barely moves the prompts, as the paper's weak MomD suggests. Every method trains its head too.

Targets: per task the accuracy of the paper's Table 2 would be meaningless for MiniLM; the target is
0.9 x the best final accuracy of any method on that task (stated in the markdown). Simulated time
to target: per round the slowest client's download + measured compute + upload at 10/1 Mbps
(``fedpeft.metrics.compare.Bandwidth``), summed up to the round that first reaches the target.

Run: ``.venv/bin/python benchmarks/fedpeptao.py`` (``--tasks``/``--methods`` pick a subset; finished
runs in ``--work-dir`` are reused and interrupted ones resumed; ``--workers`` runs in parallel, one
torch thread each). Writes ``benchmarks/results/fedpeptao.{json,md}`` and ``fedpeptao_*.png``.
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

from common import run_child
from fedpeft.config import deep_merge

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).parent / "results"
TARGET_FRACTION = 0.9
BANDWIDTH = (10.0, 1.0)  # Mbps down / up

PROBE = {"selection_round": 4, "lanczos_iterations": 12, "hessian_batch_size": 8}
PROMPT_LR = 0.03
# name -> (recipe, overrides), in priority order
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "fedpeptao": ("fedpeptao", {"strategy": PROBE, "client": {"lr": PROMPT_LR}}),
    "fedpeptao_density": ("fedpeptao", {"strategy": {**PROBE, "ratio_rule": "density"}, "client": {"lr": PROMPT_LR}}),
    "p_tuning_v2": ("p_tuning_v2", {"client": {"lr": PROMPT_LR, "local_epochs": 2}}),
    "prompt_tuning": ("prompt_tuning", {"client": {"lr": PROMPT_LR, "local_epochs": 2}}),
    "lora": ("lora", {"adapter": {"r": 8, "alpha": 16}, "client": {"lr": 0.001, "local_epochs": 2}}),
    "moms_adamd": ("moms_adamd", {"client": {"lr": PROMPT_LR}}),
    "momd": ("momd", {}),
}
TASKS: dict[str, dict[str, Any]] = {
    name: {"name": name, "max_train_examples": 1000, "max_eval_examples": 300, "max_length": 64}
    for name in ("mr", "sst2", "rte", "mrpc")
}


def experiment(task: str, method: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    recipe, overrides = METHODS[method]
    raw = {
        "method": recipe,
        "seed": args.seed,
        "rounds": args.rounds,
        "task": TASKS[task],
        "partition": {"kind": "dirichlet", "alpha": 1.0, "num_clients": args.clients},
        "model": {"name": "minilm"},
        "strategy": {"clients_per_round": args.per_round},
        "engine": {"threads": 1},
        "evaluation": {"every": args.eval_every, "at_start": True},
        "output": {"run_dir": str(run_dir), "progress": False, "checkpoint_every": 1},
    }
    return deep_merge(raw, overrides)


def run_name(task: str, method: str, seed: int) -> str:
    return f"{task}_{method}_s{seed}"


def finished(run_dir: Path, rounds: int) -> bool:
    from fedpeft.metrics.recorder import load_metrics

    records = load_metrics(run_dir)
    return bool(records) and records[-1]["round"] == rounds


def launch(job: tuple[str, str], args: argparse.Namespace) -> None:
    task, method = job
    run_dir = args.work_dir / run_name(task, method, args.seed)
    if finished(run_dir, args.rounds):
        return
    args.work_dir.mkdir(parents=True, exist_ok=True)
    config_path = args.work_dir / f"{run_dir.name}.json"
    config_path.write_text(json.dumps(experiment(task, method, args, run_dir)))
    t0 = time.time()
    with (args.work_dir / f"{run_dir.name}.log").open("a") as log:
        subprocess.run([sys.executable, __file__, "--child", str(config_path)], check=True, stdout=log,
                       stderr=subprocess.STDOUT)
    print(f"{run_dir.name}: {time.time() - t0:.0f} s", flush=True)


# --- results ---------------------------------------------------------------------------------------

def build_rows(jobs: list[tuple[str, str]], args: argparse.Namespace) -> list[dict[str, Any]]:
    from fedpeft.metrics.compare import Bandwidth
    from fedpeft.metrics.recorder import load_metrics

    link = Bandwidth(*BANDWIDTH)
    runs = {job: load_metrics(args.work_dir / run_name(*job, args.seed)) for job in jobs}
    runs = {job: r for job, r in runs.items() if r and r[-1]["round"] == args.rounds}
    metric = "accuracy"
    rows = []
    for (task, method), records in runs.items():
        best_final = max(r[-1]["eval"][metric] for (t, _), r in runs.items() if t == task)
        target = TARGET_FRACTION * best_final
        trained = [r for r in records if r["round"] > 0]
        evaluated = [r for r in records if metric in r["eval"]]
        ups = [b for r in trained for b in r["bytes_up"]]
        downs = [b for r in trained for b in r["bytes_down"]]
        hit = next((r for r in evaluated if r["round"] > 0 and r["eval"][metric] >= target), None)
        seconds = 0.0
        simulated = None
        for r in trained:
            seconds += link.round_seconds(r)
            if hit is not None and r["round"] == hit["round"]:
                simulated = seconds
        last = records[-1]
        selection = next((r["method"] for r in trained if "selected_layers" in r.get("method", {})), {})
        row: dict[str, Any] = {
            "task": task, "partition": "dirichlet1.0", "method": method, "seed": args.seed, "rounds": args.rounds,
            "clients": args.clients, "clients_per_round": args.per_round, "metric": metric,
            "best_metric": max(r["eval"][metric] for r in evaluated if r["round"] > 0),
            "final_metric": last["eval"][metric],
            "initial_metric": records[0]["eval"][metric] if records[0]["round"] == 0 else None,
            "trainable_params": last["trainable_params"],
            "uplink_bytes_per_client_round": sum(ups) / len(ups),
            "downlink_bytes_per_client_round": sum(downs) / len(downs),
            "uplink_bytes_per_client_last_round": sum(last["bytes_up"]) / len(last["bytes_up"]),
            "total_bytes": last["cum_bytes_up"] + last["cum_bytes_down"],
            "target_metric": target,
            "rounds_to_target": hit["round"] if hit else None,
            "bytes_to_target": hit["cum_bytes_up"] + hit["cum_bytes_down"] if hit else None,
            "simulated_seconds_to_target": simulated,
            "simulated_link_mbps": {"down": BANDWIDTH[0], "up": BANDWIDTH[1]},
            "wall_seconds": last["cum_wall_seconds"],
            "client_flops_per_step": last["client_flops_per_step"],
            "selected_layers": selection.get("selected_layers"),
            "prompt_ratio": selection.get("ratio"),
            "layer_scores": selection.get("global_scores"),
            "accuracy_per_round": [[r["round"], r["eval"][metric]] for r in evaluated],
            "cumulative_bytes_per_round": [[r["round"], r["cum_bytes_up"] + r["cum_bytes_down"]] for r in records],
            "train_loss_per_round": [r["train_loss"] for r in trained],
        }
        rows.append(row)
    order = list(METHODS)
    rows.sort(key=lambda row: (list(TASKS).index(row["task"]), order.index(row["method"])))
    return rows


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def claim_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The paper's claims, stated from the measured numbers whichever way they come out."""
    by = {(r["task"], r["method"]): r for r in rows}
    lines = []
    for task in TASKS:
        for variant in ("fedpeptao", "fedpeptao_density"):
            ours = by.get((task, variant))
            if ours is None:
                continue
            others = [by[(task, m)] for m in ("p_tuning_v2", "prompt_tuning", "momd", "moms_adamd", "lora")
                      if (task, m) in by]
            better = [o["method"] for o in others if ours["best_metric"] > o["best_metric"]]
            worse = [o["method"] for o in others if ours["best_metric"] <= o["best_metric"]]
            lines.append(f"- {task}, {variant}: best accuracy {fmt(ours['best_metric'])}; higher than "
                         f"{', '.join(better) or 'none'}; not higher than {', '.join(worse) or 'none'}.")
            full = by.get((task, "p_tuning_v2"))
            if full is not None:
                saving = 1 - ours["total_bytes"] / full["total_bytes"]
                late = 1 - ours["uplink_bytes_per_client_last_round"] / full["uplink_bytes_per_client_last_round"]
                lines.append(f"  Communication vs P-tuning v2: {100 * saving:.1f}% fewer bytes over the run, "
                             f"{100 * late:.1f}% fewer uplink bytes per client after layer selection (selected "
                             f"layers {ours['selected_layers']}, ratio r = {fmt(ours['prompt_ratio'], 4)}; "
                             "paper: about 40%).")
    return lines


def write_markdown(rows: list[dict[str, Any]], args: argparse.Namespace, command: str, host: str) -> None:
    lines = [
        "# FedPepTAO benchmark: partial deep prompts + adaptive optimisation vs prompt baselines and LoRA",
        "",
        f"Command: `{command}`  ",
        f"Machine: {host}",
        "",
        f"Setup: MiniLM, {args.clients} clients, {args.per_round} per round, Dirichlet alpha 1.0, {args.rounds} "
        f"rounds, 2 local epochs, 1,000 training examples per task, 64 tokens, evaluation every {args.eval_every} "
        f"rounds on 300 dev examples; seed {args.seed}. See the script's docstring for every setting.",
        "",
        f"Target = {TARGET_FRACTION} x the best final accuracy of any method on the task (column `target`). "
        f"Simulated time: slowest client per round, {BANDWIDTH[0]:g}/{BANDWIDTH[1]:g} Mbps down/up plus its "
        "measured compute on this shared CPU. Bytes are the real message lengths, both directions, all clients.",
        "",
        "| task | method | trainable | up B/client/round (mean, last) | best acc | final acc | target | "
        "rounds to target | MB to target | sim. s to target | total MB | selected layers (r) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mb = None if r["bytes_to_target"] is None else r["bytes_to_target"] / 1e6
        chosen = "-" if r["selected_layers"] is None else f"{r['selected_layers']} ({fmt(r['prompt_ratio'], 4)})"
        lines.append(
            f"| {r['task']} | {r['method']} | {r['trainable_params']:,} | "
            f"{r['uplink_bytes_per_client_round']:,.0f}, {r['uplink_bytes_per_client_last_round']:,.0f} | "
            f"{fmt(r['best_metric'])} | {fmt(r['final_metric'])} | {fmt(r['target_metric'])} | "
            f"{r['rounds_to_target'] or '-'} | {fmt(mb, 2)} | {fmt(r['simulated_seconds_to_target'], 0)} | "
            f"{r['total_bytes'] / 1e6:.1f} | {chosen} | {r['wall_seconds']:.0f} |")
    lines += ["", "## The paper's claims, as measured here", "", *claim_lines(rows)]
    (RESULTS / "fedpeptao.md").write_text("\n".join(lines) + "\n")


def plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    for name, xlabel, x_of in (
        ("accuracy", "round", lambda r: [p[0] for p in r["accuracy_per_round"]]),
        ("bytes", "cumulative MB (up + down, all clients)",
         lambda r: [dict(r["cumulative_bytes_per_round"])[p[0]] / 1e6 for p in r["accuracy_per_round"]]),
    ):
        fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for r in rows:
                if r["task"] == task:
                    ax.plot(x_of(r), [p[1] for p in r["accuracy_per_round"]], marker=".", label=r["method"])
            ax.set_title(task)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("accuracy")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / f"fedpeptao_{name}.png", dpi=110)
        plt.close(fig)


def machine() -> str:
    load = os.getloadavg()[0]
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs (1-min load {load:.1f} at "
            f"the end), Python {platform.python_version()}, {platform.system()}, one torch thread per run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tasks", default="mr,rte,mrpc", help="subset of: " + ", ".join(TASKS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench_fedpeptao"))
    parser.add_argument("--report-only", action="store_true", help="rebuild the results from finished runs")
    args = parser.parse_args()
    if args.child is not None:
        run_child(args.child)
        return
    methods, tasks = args.methods.split(","), args.tasks.split(",")
    jobs = [(t, m) for m in methods for t in tasks]  # by method priority first, so the key ones finish early
    unknown = sorted({x for t, m in jobs for x in (t, m) if x not in {**TASKS, **METHODS}})
    if unknown:
        parser.error(f"unknown task/method: {unknown}")
    if not args.report_only:
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            for future in [pool.submit(launch, job, args) for job in jobs]:
                future.result()
    rows = build_rows(jobs, args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = ("python benchmarks/fedpeptao.py " + " ".join(a for a in sys.argv[1:] if a != "--report-only")).strip()
    host = machine()
    (RESULTS / "fedpeptao.json").write_text(json.dumps(
        {"benchmark": "fedpeptao", "command": command, "machine": host, "rows": rows}, indent=1) + "\n")
    write_markdown(rows, args, command, host)
    plot(rows)
    print(f"wrote {RESULTS / 'fedpeptao.json'} ({len(rows)} rows)")


if __name__ == "__main__":
    main()

"""Head pruning ("Assortment of Attention Heads", ``papers/003``) on real data with the real MiniLM.

Parts (``--parts``, all by default):

- ``table1``: the paper's Table 1 ablation on MNLI (glue_subsets): B1 = FedAvg-LoRA, B2 = FedAvg +
  random 90% head pruning, ours = importance pruning (90%) + head-weighted aggregation (Eq. 8), each
  with random (uniform) or loss-gap (Eq. 9) client selection; with 100 clients / 2 per round and
  10 clients / 2 per round. Accuracy, rounds to a target, uplink bytes per client per round (the
  codec's real message lengths), client training FLOPs per step (FlopCounterMode, forward +
  backward of the first local step of the first client of each round, averaged over rounds).
- ``newsgroups``: 20 Newsgroups, B1 + random selection vs ours (the paper's Table 2), same settings.
- ``sweep``: ours at head sparsity 0 / 0.5 / 0.75 / 0.9 / 0.95 on MNLI 10/2 (the paper's Fig. 4),
  plus FLOPs of one training step on a fixed batch (16 x 64 tokens) at each sparsity.
- ``e2e``: a tiny random T5 (no pretrained T5 is available offline) on E2E NLG, ours vs B1,
  ROUGE-1/2/L with greedy decoding: proof that the generation path runs end to end, not quality.

Scaled to a 2-core CPU shared with several other benchmarks (a MiniLM step ran 10-30x slower than
on an idle machine): a fixed subsample of 800 training examples (MNLI and 20NG; the same examples
for every run), 64 tokens, 12 rounds, evaluation every 3 rounds on a fixed 200-example subsample of
the dev/test set, one local epoch of AdamW at batch 16 and lr 1e-3 (the paper: batch 80, lr 5e-4,
100 rounds, T5-small with 400k MNLI pairs). Absolute accuracies are therefore low; the uplink bytes
and FLOPs are exact. LoRA r = alpha = 16 on query/key/value of
all 6 layers (12 heads each, 72 heads) + the classifier, as the paper's T5 setting (its 3.38 MB
matches LoRA on q/k/v). The importance pass reads at most 2 batches per client
(``importance_batches: 2``). Every method uploads through the same lossless ``zero_slices`` codec
(B1 too), so byte differences come from the methods, not the codec. ``--seed`` changes the training
seed; the partition and the subsamples stay fixed.

Outputs (``benchmarks/results/``): ``headprune.json`` (SPEC results format, one row per run),
``headprune.md``, ``headprune_table1.png`` (accuracy per round), ``headprune_sweep.png``
(accuracy, uplink bytes and FLOPs vs sparsity).

Run: ``.venv/bin/python benchmarks/headprune.py`` (``--parts``/``--workers``/``--work-dir``; runs
already finished in the work dir are reused and interrupted ones resumed).
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
TARGETS = {"mnli": 0.45, "20newsgroups": 0.15}  # accuracy targets for rounds_to_target (chance: 0.33, 0.05)
SETTINGS = {"100x2": (100, 2), "10x2": (10, 2)}
SWEEP = (0.0, 0.5, 0.75, 0.9, 0.95)

# method name -> (recipe, strategy overrides)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "b1_random": ("headprune_b1", {"selection": "uniform"}),
    "b1_lossgap": ("headprune_b1", {"selection": "loss_gap"}),
    "b2_random": ("headprune_b2", {"selection": "uniform"}),
    "b2_lossgap": ("headprune_b2", {"selection": "loss_gap"}),
    "headprune_random": ("headprune", {"selection": "uniform"}),
    "headprune_lossgap": ("headprune", {"selection": "loss_gap"}),
    **{f"headprune_s{s}": ("headprune", {"selection": "loss_gap", "head_sparsity": s}) for s in SWEEP if s != 0.9},
}
TASKS: dict[str, dict[str, Any]] = {
    "mnli": {"name": "mnli", "max_train_examples": 800, "max_eval_examples": 200, "max_length": 64},
    "20newsgroups": {"name": "20newsgroups", "max_train_examples": 800, "max_eval_examples": 200,
                     "max_length": 64, "strip_newsgroup_metadata": False},
    "e2e_nlg": {"name": "e2e_nlg", "max_train_examples": 400, "max_eval_examples": 40, "max_length": 48},
}


def jobs_for(parts: list[str]) -> list[tuple[str, str, str]]:
    jobs: list[tuple[str, str, str]] = []
    if "table1" in parts:
        table1 = ("b1_random", "b1_lossgap", "b2_random", "b2_lossgap", "headprune_random", "headprune_lossgap")
        jobs += [("mnli", setting, method) for setting in SETTINGS for method in table1]
    if "newsgroups" in parts:
        jobs += [("20newsgroups", setting, m) for setting in SETTINGS for m in ("b1_random", "headprune_lossgap")]
    if "sweep" in parts:
        jobs += [("mnli", "10x2", f"headprune_s{s}") for s in SWEEP if s != 0.9]
        jobs += [("mnli", "10x2", "headprune_lossgap")]
    if "e2e" in parts:
        jobs += [("e2e_nlg", "10x2", "b1_random"), ("e2e_nlg", "10x2", "headprune_lossgap")]
    return list(dict.fromkeys(jobs))


def experiment(task: str, setting: str, method: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    recipe, strategy = METHODS[method]
    clients, per_round = SETTINGS[setting]
    raw: dict[str, Any] = {
        "method": recipe,
        "seed": args.seed,
        "rounds": args.rounds,
        "task": TASKS[task],
        "partition": {"kind": "iid", "num_clients": clients, "seed": 0},
        "model": {"name": "minilm"},
        "client": {"optimizer": "adamw", "lr": args.lr, "batch_size": 16, "local_epochs": 1},
        "strategy": {"name": "fedavg", "clients_per_round": per_round, "importance_batches": 2, **strategy},
        "engine": {"threads": 1, "measure_flops": "every_round"},
        "evaluation": {"every": args.eval_every, "at_start": True},
        "output": {"run_dir": str(run_dir), "progress": False},
    }
    if task == "e2e_nlg":  # a tiny random T5: quality is not the point, the generation path is
        raw = deep_merge(raw, {
            "rounds": args.e2e_rounds,
            "model": {"name": "tiny-t5", "tiny_hidden_size": 64, "tiny_layers": 2, "tiny_heads": 4},
            "client": {"lr": 0.01},
            "strategy": {"head_sparsity": 0.5} if recipe == "headprune" else {},
            "evaluation": {"every": args.e2e_rounds // 2, "max_new_tokens": 32, "num_beams": 1, "batch_size": 20},
        })
    return raw


def run_dir_of(job: tuple[str, str, str], args: argparse.Namespace) -> Path:
    return args.work_dir / f"{job[0]}_{job[1]}_{job[2]}_s{args.seed}"


def finished(run_dir: Path) -> bool:
    from fedpeft.metrics.recorder import load_metrics

    if not (run_dir / "metrics.jsonl").exists():
        return False
    records = load_metrics(run_dir)
    config = json.loads((run_dir.parent / f"{run_dir.name}.json").read_text())
    return bool(records) and records[-1]["round"] == config["rounds"]


def launch(job: tuple[str, str, str], args: argparse.Namespace) -> None:
    run_dir = run_dir_of(job, args)
    config_path = args.work_dir / f"{run_dir.name}.json"
    config_path.write_text(json.dumps(experiment(*job, args, run_dir)))
    if finished(run_dir):
        return
    t0 = time.time()
    with (args.work_dir / f"{run_dir.name}.log").open("a") as handle:
        subprocess.run([sys.executable, __file__, "--child", str(config_path)], check=True, stdout=handle,
                       stderr=subprocess.STDOUT)
    print(f"{run_dir.name}: {time.time() - t0:.0f} s", flush=True)


# --- fixed-batch FLOPs of one local step at each sparsity -----------------------------------------

def sweep_flops(args: argparse.Namespace) -> list[dict[str, Any]]:
    """FLOPs of forward + backward on the same 16 x 64-token batch, heads kept by importance."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from fedpeft.config import build_config
    from fedpeft.experiment import prepare
    from fedpeft.methods.headprune import heads_to_keep
    from fedpeft.models.encoding import training_batch
    from fedpeft.models.heads import end_token_ids, head_importance, pruned_heads

    torch.set_num_threads(1)
    raw = experiment("mnli", "10x2", "headprune_lossgap", args, args.work_dir / "flops_probe")
    exp = prepare(build_config(raw))
    model, sites = exp.backbone.model, exp.algorithm.sites
    lengths = [len(f["input_ids"]) for f in exp.train_data.features]
    longest = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:16]  # 16 examples at the 64-token cap
    batch = training_batch(exp.train_data, longest)
    scores = head_importance(model, sites, [batch], end_token_ids(exp.backbone.tokenizer))
    rows = []
    model.train()
    for sparsity in SWEEP:
        kept = heads_to_keep(scores, exp.algorithm.shape, sparsity)
        kept_lists = [torch.nonzero(row).flatten().tolist() for row in kept]
        with pruned_heads(model, sites, kept_lists), FlopCounterMode(display=False) as counter:
            model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        rows.append({"head_sparsity": sparsity, "kept_heads": int(kept.sum()), "flops": int(counter.get_total_flops()),
                     "tokens": list(batch["input_ids"].shape)})
    return rows


# --- results ---------------------------------------------------------------------------------------

def build_rows(jobs: list[tuple[str, str, str]], args: argparse.Namespace) -> list[dict[str, Any]]:
    from fedpeft.metrics.recorder import load_metrics

    rows = []
    for job in jobs:
        task, setting, method = job
        run_dir = run_dir_of(job, args)
        if not finished(run_dir):
            continue
        records = load_metrics(run_dir)
        config = json.loads((run_dir.parent / f"{run_dir.name}.json").read_text())
        metric = "rougeL" if task == "e2e_nlg" else "accuracy"
        trained = [r for r in records if r["round"] > 0]
        evaluated = [r for r in records if metric in r["eval"]]
        ups = [b for r in trained for b in r["bytes_up"]]
        downs = [b for r in trained for b in r["bytes_down"]]
        flops = [r["client_flops_per_step"] for r in trained if r["client_flops_per_step"] is not None]
        sparsity = [r["method"].get("head_sparsity", 0.0) for r in trained]
        scoring = [r["method"]["importance_flops"] for r in trained if "importance_flops" in r["method"]]
        last = records[-1]
        target = TARGETS.get(task)
        hit = first_round_at(records, metric, target) if target is not None else None
        clients, per_round = SETTINGS[setting]
        row: dict[str, Any] = {
            "task": task, "partition": f"iid_{setting}", "method": method, "seed": args.seed,
            "rounds": config["rounds"], "clients": clients, "clients_per_round": per_round, "metric": metric,
            "best_metric": max(r["eval"][metric] for r in evaluated),
            "final_metric": last["eval"][metric],
            "trainable_params": last["trainable_params"],
            "uplink_bytes_per_client_round": sum(ups) / len(ups),
            "downlink_bytes_per_client_round": sum(downs) / len(downs),
            "total_bytes": last["cum_bytes_up"] + last["cum_bytes_down"],
            "target": target,
            "rounds_to_target": hit["round"] if hit else None,
            "bytes_to_target": hit["cum_bytes_up"] + hit["cum_bytes_down"] if hit else None,
            "wall_seconds": last["cum_wall_seconds"],
            "client_flops_per_step": sum(flops) / len(flops) if flops else None,
            "head_sparsity": sum(sparsity) / len(sparsity),
            "importance_pass_flops": sum(scoring) / len(scoring) if scoring else None,
            "selection": config["strategy"]["selection"],
            "metric_per_round": [[r["round"], r["eval"][metric]] for r in evaluated],
            "train_loss_per_round": [r["train_loss"] for r in trained],
        }
        if task == "e2e_nlg":
            row["rouge_final"] = {k: last["eval"][k] for k in ("rouge1", "rouge2", "rougeL")}
        rows.append(row)
    return rows


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_markdown(rows: list[dict[str, Any]], flops_rows: list[dict[str, Any]], args: argparse.Namespace,
                   command: str, machine: str) -> None:
    by = {(r["task"], r["partition"], r["method"]): r for r in rows}
    lines = [
        "# Head pruning benchmark (papers/003: Assortment of Attention Heads)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}",
        "",
        f"Setup: MiniLM (all-MiniLM-L6-v2, 6 layers x 12 heads), LoRA r = alpha = 16 on query/key/value + "
        f"classifier, {args.rounds} rounds, 1 local epoch of AdamW (batch 16, lr {args.lr}), iid partition of a fixed "
        "800-example training subsample, evaluation every "
        f"{args.eval_every} rounds on a fixed 200-example subsample, 64 tokens, seed {args.seed}. See the script's "
        "docstring. B1 = FedAvg-LoRA; B2 = FedAvg + random 90% head pruning (a head's slices averaged over "
        "the clients that kept it); ours (`headprune`) = importance pruning 90% + Eq. 8 aggregation. "
        "`random` = uniform selection, `lossgap` = Eq. 9.",
        "",
        f"Targets for `rounds to target`: accuracy {TARGETS['mnli']} on MNLI (chance 0.33), "
        f"{TARGETS['20newsgroups']} on 20 Newsgroups (chance 0.05); `-` = never reached. "
        "Uplink = mean real message length per client per round (LoRA A dense, kept heads' B rows, classifier, "
        "head scores); FLOPs = FlopCounterMode, forward + backward of one local step (mean over rounds of the "
        "first client's first step; the batch length varies with the data). The importance pass (ours) costs one "
        "no-grad forward over at most 2 batches per client and round, not included in FLOPs/step: see "
        "`importance_pass_flops` in the JSON.",
        "",
    ]

    def table(task: str, methods: list[str]) -> list[str]:
        out = ["| setting | method | final acc | best acc | rounds to target | uplink B/client/round | "
               "uplink vs B1 | FLOPs/step (G) | FLOPs vs B1 | measured sparsity | wall s |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        for setting in SETTINGS:
            base = by.get((task, f"iid_{setting}", "b1_random"))
            for method in methods:
                row = by.get((task, f"iid_{setting}", method))
                if row is None:
                    continue
                up_ratio = (base["uplink_bytes_per_client_round"] / row["uplink_bytes_per_client_round"]
                            if base else None)
                fl_ratio = (base["client_flops_per_step"] / row["client_flops_per_step"]
                            if base and row["client_flops_per_step"] else None)
                out.append(
                    f"| {setting} | {method} | {fmt(row['final_metric'])} | {fmt(row['best_metric'])} | "
                    f"{row['rounds_to_target'] if row['rounds_to_target'] is not None else '-'} | "
                    f"{row['uplink_bytes_per_client_round']:,.0f} | {fmt(up_ratio, 2)}x | "
                    f"{fmt(row['client_flops_per_step'] / 1e9 if row['client_flops_per_step'] else None, 2)} | "
                    f"{fmt(fl_ratio, 2)}x | {fmt(row['head_sparsity'], 2)} | {row['wall_seconds']:.0f} |")
        return out

    table1 = ["b1_random", "b1_lossgap", "b2_random", "b2_lossgap", "headprune_random", "headprune_lossgap"]
    if any(r["task"] == "mnli" for r in rows):
        lines += ["## Table 1 ablation: MNLI", "", *table("mnli", table1), ""]
    if any(r["task"] == "20newsgroups" for r in rows):
        lines += ["## 20 Newsgroups (Table 2 style)", "", *table("20newsgroups", ["b1_random", "headprune_lossgap"]),
                  ""]
    sweep = [by.get(("mnli", "iid_10x2", "headprune_lossgap" if s == 0.9 else f"headprune_s{s}")) for s in SWEEP]
    if any(sweep) or flops_rows:
        lines += ["## Sparsity sweep (Fig. 4): ours with loss-gap selection, MNLI 10/2", "",
                  "| sparsity | final acc | best acc | uplink B/client/round | FLOPs/step fixed batch (G) | "
                  "FLOPs vs 0% | kept heads |", "|---|---|---|---|---|---|---|"]
        flops_by = {f["head_sparsity"]: f for f in flops_rows}
        dense = flops_by.get(0.0, {}).get("flops")
        for s, row in zip(SWEEP, sweep):
            probe = flops_by.get(s, {})
            uplink = f"{row['uplink_bytes_per_client_round']:,.0f}" if row else "-"
            lines.append(
                f"| {s} | {fmt(row['final_metric']) if row else '-'} | {fmt(row['best_metric']) if row else '-'} | "
                f"{uplink} | "
                f"{fmt(probe.get('flops', 0) / 1e9 if probe else None, 2)} | "
                f"{fmt(dense / probe['flops'] if probe and dense else None, 2)}x | {probe.get('kept_heads', '-')} |")
        lines.append("")
    e2e = [r for r in rows if r["task"] == "e2e_nlg"]
    if e2e:
        lines += ["## E2E NLG with a tiny random T5 (generation path end to end; quality is not the point)", "",
                  "| method | rounds | ROUGE-1 | ROUGE-2 | ROUGE-L | first / last train loss | uplink B/client/round |",
                  "|---|---|---|---|---|---|---|"]
        for row in e2e:
            rouge = row["rouge_final"]
            losses = row["train_loss_per_round"]
            lines.append(f"| {row['method']} | {row['rounds']} | {fmt(rouge['rouge1'])} | {fmt(rouge['rouge2'])} | "
                         f"{fmt(rouge['rougeL'])} | {losses[0]:.2f} / {losses[-1]:.2f} | "
                         f"{row['uplink_bytes_per_client_round']:,.0f} |")
        lines.append("")
    (RESULTS / "headprune.md").write_text("\n".join(lines) + "\n")


def write_plots(rows: list[dict[str, Any]], flops_rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mnli = [r for r in rows if r["task"] == "mnli" and not r["method"].startswith("headprune_s")]
    if mnli:
        fig, axes = plt.subplots(1, len(SETTINGS), figsize=(12, 4), sharey=True)
        for ax, setting in zip(axes, SETTINGS):
            for row in (r for r in mnli if r["partition"] == f"iid_{setting}"):
                xs, ys = zip(*row["metric_per_round"])
                style = "-" if row["selection"] == "loss_gap" else "--"
                ax.plot(xs, ys, style, marker="o", markersize=3, label=row["method"])
            ax.axhline(TARGETS["mnli"], color="grey", lw=0.8)
            ax.set_title(f"MNLI, {setting.replace('x', ' clients / ')} per round")
            ax.set_xlabel("round")
        axes[0].set_ylabel("accuracy")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / "headprune_table1.png", dpi=120)
        plt.close(fig)
    by = {r["method"]: r for r in rows if r["task"] == "mnli" and r["partition"] == "iid_10x2"}
    points = [(s, by.get("headprune_lossgap" if s == 0.9 else f"headprune_s{s}")) for s in SWEEP]
    points = [(s, r) for s, r in points if r is not None]
    if points or flops_rows:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        if points:
            axes[0].plot([s for s, _ in points], [r["final_metric"] for _, r in points], marker="o", label="final")
            axes[0].plot([s for s, _ in points], [r["best_metric"] for _, r in points], marker="s", label="best")
            axes[0].legend()
            axes[1].plot([s for s, _ in points], [r["uplink_bytes_per_client_round"] / 1e6 for _, r in points],
                         marker="o")
        if flops_rows:
            axes[2].plot([f["head_sparsity"] for f in flops_rows], [f["flops"] / 1e9 for f in flops_rows], marker="o")
        for ax, label in zip(axes, ("accuracy (MNLI 10/2)", "uplink MB / client / round", "GFLOPs / step (16x64)")):
            ax.set_xlabel("head sparsity")
            ax.set_ylabel(label)
        fig.tight_layout()
        fig.savefig(RESULTS / "headprune_sweep.png", dpi=120)
        plt.close(fig)


def machine_line() -> str:
    load = os.getloadavg()[0]
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs (1-min load {load:.1f} at the "
            f"end), Python {platform.python_version()}, {platform.system()}, one torch thread per run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--parts", default="table1,newsgroups,sweep,e2e")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--e2e-rounds", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench_headprune"))
    parser.add_argument("--no-write", action="store_true", help="run, but do not write benchmarks/results")
    args = parser.parse_args()
    if args.child is not None:
        run_child(args.child)
        return
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    jobs = jobs_for(parts)
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        list(pool.map(lambda job: launch(job, args), jobs))
    flops_path = args.work_dir / "sweep_flops.json"
    if "sweep" in parts and not flops_path.exists():
        flops_path.write_text(json.dumps(sweep_flops(args)))
    flops_rows = json.loads(flops_path.read_text()) if flops_path.exists() else []
    rows = build_rows(jobs_for(["table1", "newsgroups", "sweep", "e2e"]), args)
    if args.no_write:
        print(json.dumps([{k: v for k, v in r.items() if not k.endswith("per_round")} for r in rows], indent=1))
        return
    command = "python benchmarks/headprune.py " + " ".join(sys.argv[1:])
    machine = machine_line()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "headprune.json").write_text(json.dumps(
        {"benchmark": "headprune", "command": command.strip(), "machine": machine, "rows": rows,
         "sweep_flops_fixed_batch": flops_rows}, indent=1))
    write_markdown(rows, flops_rows, args, command.strip(), machine)
    write_plots(rows, flops_rows)


if __name__ == "__main__":
    main()

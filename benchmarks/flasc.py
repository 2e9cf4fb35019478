"""FLASC vs dense LoRA and the sparsity baselines on 20 Newsgroups with the real MiniLM.

Paper claims checked (Kuo et al. 2024, Fig. 2-3): FLASC matches dense LoRA with several times
less communication; sparse upload helps most when upload is slow; SparseAdapter falls short of
LoRA. Scaled to a shared 2-core CPU: a seeded subsample of the training set, short sequences,
100 Dirichlet(0.1) clients, 10 per round, a few tens of rounds. Every method shares the FLASC
setup of the released code: LoRA r=16 (alpha 16, dropout 0.1) on query/value + classifier, client
SGD (momentum 0.9, batch 16, 1 epoch), server AdamW on the plain mean of the client updates. As in
the released code (``fetch_20newsgroups(subset='train')``), the e-mail headers are kept.

Outputs (``benchmarks/results/``): ``flasc.json`` (SPEC's results format), ``flasc.md`` (tables,
the target accuracy and the time model), ``flasc_accuracy.png`` (accuracy vs rounds and vs
cumulative bytes) and ``flasc_time.png`` (simulated communication time to the target at upload
bandwidth 1, 1/4, 1/16 of the download bandwidth, relative to dense LoRA, as in Fig. 3).

Run: ``.venv/bin/python benchmarks/flasc.py`` (all methods; ``--methods a,b`` for a subset; runs
already finished in ``--work-dir`` are reused, interrupted ones resumed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from fedpeft.config import deep_merge

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).parent / "results"
DOWN_MBPS = 10.0
UPLOAD_RATIOS = (1.0, 1 / 4, 1 / 16)
TARGET_FRACTION = 0.9  # target accuracy = this fraction of dense LoRA r=16's best accuracy
DENSE = ("lora_r16", "lora_r16_slr0.005")  # dense LoRA r=16 at two server lrs; the better one is the reference

FLASC_COMMON = {"strategy": {"name": "fedadamw"}, "codec": {"down": {"kind": "topk"}, "up": {"kind": "topk"}}}

# name -> (recipe, overrides); in priority order (the first four are the must-haves)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "lora_r16": ("lora", {}),
    "flasc_d0.25": ("flasc", {"strategy": {"down_density": 0.25, "up_density": 0.25}}),
    "flasc_down0.25_up0.0156": ("flasc", {"strategy": {"down_density": 0.25, "up_density": 1 / 64}}),
    "sparse_adapter_d0.25": ("sparse_adapter", {"strategy": {"down_density": 0.25}}),
    "flasc_d0.0625": ("flasc", {"strategy": {"down_density": 1 / 16, "up_density": 1 / 16}}),
    "flasc_down0.25_up0.0625": ("flasc", {"strategy": {"down_density": 0.25, "up_density": 1 / 16}}),
    "adapter_lth": ("adapter_lth", {"strategy": {"prune_fraction": 0.02, "prune_every": 1}}),
    "lora_r4": ("lora", {"adapter": {"r": 4, "alpha": 4}}),
    "lora_r16_slr0.005": ("lora", {"strategy": {"server_lr": 0.005}}),
}


def experiment(args: argparse.Namespace, name: str, run_dir: Path) -> dict[str, Any]:
    recipe, overrides = METHODS[name]
    base = {
        "method": recipe,
        "seed": args.seed,
        "rounds": args.rounds,
        "task": {"name": "20newsgroups", "max_train_examples": args.train_examples,
                 "max_eval_examples": args.eval_examples, "max_length": args.max_length,
                 "strip_newsgroup_metadata": False},
        "partition": {"kind": "dirichlet", "alpha": 0.1, "num_clients": args.clients},
        "model": {"name": "minilm"},
        "adapter": {"kind": "lora", "r": 16, "alpha": 16, "dropout": 0.1, "init": "kaiming",
                    "target_modules": ["query", "value"]},
        "client": {"optimizer": "sgd", "lr": args.client_lr, "momentum": 0.9, "batch_size": 16, "local_epochs": 1},
        "strategy": {"name": "fedadamw", "server_lr": args.server_lr, "beta1": 0.9, "beta2": 0.999,
                     "weight_decay": 0.01, "weighting": "uniform", "clients_per_round": args.per_round},
        "network": {"down_mbps": DOWN_MBPS, "up_mbps": DOWN_MBPS / 16},
        "engine": {"threads": args.threads},
        "evaluation": {"every": args.eval_every, "at_start": True, "batch_size": 64},
        "output": {"run_dir": str(run_dir), "progress": False},
    }
    if recipe != "lora":
        base = deep_merge(base, FLASC_COMMON)
    return deep_merge(base, overrides)


def run_method(args: argparse.Namespace, name: str) -> tuple[list[dict[str, Any]], float]:
    """Run (or reuse, or resume) one method; returns its metrics records and wall seconds."""
    from fedpeft.config import build_config
    from fedpeft.engines.local import LocalEngine
    from fedpeft.experiment import prepare
    from fedpeft.metrics.recorder import load_metrics

    run_dir = Path(args.work_dir) / name
    raw = experiment(args, name, run_dir)
    done = run_dir / "metrics.jsonl"
    if done.exists():
        records = load_metrics(run_dir)
        if records and records[-1]["round"] >= args.rounds:
            return records, sum(r["time"]["round"] for r in records)
    resume = (run_dir / "checkpoint.pt").exists()
    t0 = time.perf_counter()
    exp = prepare(build_config(raw))
    engine = LocalEngine(exp, run_dir)
    records = engine.run(resume=resume, on_round=lambda r: print(
        f"  {name} round {r['round']}: acc={r['eval'].get('accuracy', float('nan')):.4f} "
        f"down={sum(r['bytes_down'])} up={sum(r['bytes_up'])} ({r['time']['round']:.0f}s)", flush=True))
    print(f"{name}: {time.perf_counter() - t0:.0f}s", flush=True)
    return load_metrics(run_dir), sum(r["time"]["round"] for r in load_metrics(run_dir))


def communication_seconds(record: dict[str, Any], up_mbps: float) -> float:
    """FLASC Fig. 3's noiseless channel: the slowest client's bytes / bandwidth, down then up."""
    from fedpeft.federated.timing import transfer_seconds

    return max((transfer_seconds(d, DOWN_MBPS) + transfer_seconds(u, up_mbps)
                for d, u in zip(record["bytes_down"], record["bytes_up"])), default=0.0)


def total_seconds(record: dict[str, Any], up_mbps: float) -> float:
    """Communication plus the measured compute of each client (synchronous round: the slowest)."""
    from fedpeft.federated.timing import Link, client_seconds

    link = Link(DOWN_MBPS, up_mbps, 0.0)
    return max((client_seconds(link, d, u, c)["total"]
                for d, u, c in zip(record["bytes_down"], record["bytes_up"], record["client_seconds"])), default=0.0)


def to_target(records: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """First round whose accuracy reaches ``target``, with the bytes and simulated times spent until then."""
    cum_bytes = 0
    comm = {ratio: 0.0 for ratio in UPLOAD_RATIOS}
    total = {ratio: 0.0 for ratio in UPLOAD_RATIOS}
    for record in records:
        if record["round"] > 0:
            cum_bytes += sum(record["bytes_down"]) + sum(record["bytes_up"])
            for ratio in UPLOAD_RATIOS:
                comm[ratio] += communication_seconds(record, DOWN_MBPS * ratio)
                total[ratio] += total_seconds(record, DOWN_MBPS * ratio)
        if record["eval"].get("accuracy", -1.0) >= target:
            return {"round": record["round"], "bytes": cum_bytes,
                    "communication_seconds": {str(r): s for r, s in comm.items()},
                    "simulated_seconds": {str(r): s for r, s in total.items()}}
    return {"round": None, "bytes": None, "communication_seconds": None, "simulated_seconds": None}


def row(args: argparse.Namespace, name: str, records: list[dict[str, Any]], wall: float,
        target: float) -> dict[str, Any]:
    trained = [r for r in records if r["round"] > 0]
    accuracies = [r["eval"]["accuracy"] for r in records if "accuracy" in r["eval"]]
    ups = [b for r in trained for b in r["bytes_up"]]
    downs = [b for r in trained for b in r["bytes_down"]]
    reach = to_target(records, target)
    return {
        "task": "20newsgroups", "partition": f"dirichlet(alpha=0.1, clients={args.clients})",
        "method": name, "recipe": METHODS[name][0], "seed": args.seed, "rounds": len(trained),
        "clients": args.clients, "clients_per_round": args.per_round, "metric": "accuracy",
        "best_metric": max(accuracies), "final_metric": accuracies[-1], "initial_metric": accuracies[0],
        "trainable_params": trained[0]["trainable_params"],
        "uplink_bytes_per_client_round": sum(ups) / len(ups),
        "downlink_bytes_per_client_round": sum(downs) / len(downs),
        "total_bytes": sum(ups) + sum(downs),
        "target_metric": target, "rounds_to_target": reach["round"], "bytes_to_target": reach["bytes"],
        "communication_seconds_to_target": reach["communication_seconds"],
        "simulated_seconds_to_target": reach["simulated_seconds"],
        "wall_seconds": wall, "client_flops_per_step": trained[0].get("client_flops_per_step"),
        "method_metrics_last_round": trained[-1].get("method", {}),
        "curve": [{"round": r["round"], "accuracy": r["eval"].get("accuracy"),
                   "cum_bytes": r.get("cum_bytes_down", 0) + r.get("cum_bytes_up", 0)}
                  for r in records if "accuracy" in r["eval"]],
    }


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lora = next(r for r in rows if r["method"] == result["reference"])
    target = rows[0]["target_metric"]
    lines = [
        "# FLASC benchmark: 20 Newsgroups, MiniLM, LoRA r=16",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}",
        "",
        f"Setup: {result['setup']}",
        "",
        f"Target accuracy: **{target:.4f}** = {TARGET_FRACTION} x the best accuracy of dense LoRA r=16 in this "
        f"run (`{result['reference']}`, the better of its server learning rates).",
        "",
        "| method | best acc | final acc | up / client / round | down / client / round | total bytes "
        "| rounds to target | bytes to target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['best_metric']:.4f} | {r['final_metric']:.4f} "
            f"| {fmt_bytes(r['uplink_bytes_per_client_round'])} | {fmt_bytes(r['downlink_bytes_per_client_round'])} "
            f"| {fmt_bytes(r['total_bytes'])} | {r['rounds_to_target'] or '-'} | {fmt_bytes(r['bytes_to_target'])} |")
    lines += [
        "",
        f"## Simulated communication time to the target (download {DOWN_MBPS:g} Mbps)",
        "",
        "Noiseless channels as in the paper's Fig. 3: per round, the slowest client's download bytes / download",
        "bandwidth + upload bytes / upload bandwidth, summed over the rounds until the target is reached.",
        f"In brackets: relative to dense LoRA r=16 (`{result['reference']}`; lower is better).",
        "`total` adds each client's measured compute time on this shared CPU (noisy; the paper reports",
        "communication only).",
        "",
        "| method | " + " | ".join(f"upload = {label} of download" for label in ("1", "1/4", "1/16")) + " | "
        + " | ".join(f"total, upload {label}" for label in ("1", "1/4", "1/16")) + " |",
        "|---|" + "---|" * 6,
    ]
    for r in rows:
        cells = []
        for key in ("communication_seconds_to_target", "simulated_seconds_to_target"):
            for ratio in UPLOAD_RATIOS:
                seconds = (r[key] or {}).get(str(ratio))
                base = ((lora or {}).get(key) or {}).get(str(ratio))
                if seconds is None:
                    cells.append("not reached")
                else:
                    rel = f" ({seconds / base:.2f}x)" if base else ""
                    cells.append(f"{seconds:.1f} s{rel}")
        lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    lines += ["", "![accuracy](flasc_accuracy.png)", "", "![time to target](flasc_time.png)", ""]
    if result.get("notes"):
        lines += ["## What we measured", "", *result["notes"], ""]
    return "\n".join(lines)


def plots(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    reference = result["reference"]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in rows:
        rounds = [p["round"] for p in r["curve"]]
        acc = [p["accuracy"] for p in r["curve"]]
        mb = [p["cum_bytes"] / 1e6 for p in r["curve"]]
        ax1.plot(rounds, acc, marker=".", label=r["method"])
        ax2.plot(mb, acc, marker=".", label=r["method"])
    target = rows[0]["target_metric"]
    for ax in (ax1, ax2):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_ylabel("eval accuracy")
        ax.grid(alpha=0.3)
    ax1.set_xlabel("round")
    ax2.set_xlabel("cumulative bytes, both directions, all clients (MB)")
    ax2.set_xscale("log")
    ax1.legend(fontsize=8)
    fig.suptitle("20 Newsgroups, MiniLM, Dirichlet 0.1, 10 of 100 clients per round")
    fig.tight_layout()
    fig.savefig(out / "flasc_accuracy.png", dpi=120)
    plt.close(fig)

    lora = next((r for r in rows if r["method"] == reference), None)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        heights = []
        for ratio in UPLOAD_RATIOS:
            seconds = (r["communication_seconds_to_target"] or {}).get(str(ratio))
            base = ((lora or {}).get("communication_seconds_to_target") or {}).get(str(ratio))
            heights.append(seconds / base if seconds is not None and base else float("nan"))
        xs = [j + i * width for j in range(len(UPLOAD_RATIOS))]
        ax.bar(xs, heights, width=width, label=r["method"])
        for x, h in zip(xs, heights):
            if math.isnan(h):
                ax.text(x, 0.02, "x", ha="center", color="red")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(UPLOAD_RATIOS))],
                  ["upload = download", "upload = 1/4 download", "upload = 1/16 download"])
    ax.set_ylabel("communication time to target / dense LoRA's")
    ax.set_title("Simulated communication time to the target accuracy (x: not reached)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "flasc_time.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of: " + ", ".join(METHODS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--train-examples", type=int, default=1500)
    parser.add_argument("--eval-examples", type=int, default=250)
    parser.add_argument("--max-length", type=int, default=48)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--client-lr", type=float, default=0.01)
    parser.add_argument("--server-lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work-dir", default="runs/bench_flasc")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--no-write", action="store_true", help="run only; do not write results")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; allowed: {', '.join(METHODS)}")
    if not args.no_write:
        names = [n for n in DENSE if n not in names] + names  # the target and time ratios are relative to them

    runs = {name: run_method(args, name) for name in names}
    if args.no_write:
        return 0
    best = {name: max(r["eval"]["accuracy"] for r in runs[name][0] if "accuracy" in r["eval"]) for name in DENSE}
    reference = max(DENSE, key=best.__getitem__)
    target = TARGET_FRACTION * best[reference]
    result = {
        "benchmark": "flasc",
        "command": "python benchmarks/flasc.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores shared with other jobs, "
                   f"torch threads {args.threads}, Python {platform.python_version()}",
        "setup": (f"20 Newsgroups (headers kept), {args.train_examples} training examples (seeded subsample), "
                  f"{args.eval_examples} eval examples, max length {args.max_length}; Dirichlet alpha 0.1 over "
                  f"{args.clients} clients, {args.per_round} per round, {args.rounds} rounds (evaluated every "
                  f"{args.eval_every}), seed {args.seed}; "
                  f"LoRA r=16 (alpha 16, dropout 0.1) on query/value + classifier (lora_r4: r=4, alpha 4); "
                  f"client SGD lr {args.client_lr} momentum 0.9 batch 16, 1 epoch; server AdamW lr "
                  f"{args.server_lr} (lora_r16_slr0.005: 0.005), betas 0.9/0.999, weight decay 0.01, plain mean "
                  f"of client updates."),
        "reference": reference,
        "target": {"metric": "accuracy", "value": target, "rule": f"{TARGET_FRACTION} x best accuracy of {reference}"},
        "time_model": {"down_mbps": DOWN_MBPS, "upload_ratios": list(UPLOAD_RATIOS), "latency_s": 0.0},
        "rows": [row(args, name, records, wall, target) for name, (records, wall) in runs.items()],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    notes_path = out / "flasc_notes.md"
    if notes_path.exists():
        result["notes"] = notes_path.read_text().strip().splitlines()
    (out / "flasc.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "flasc.md").write_text(markdown(result))
    plots(result, out)
    print((out / "flasc.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

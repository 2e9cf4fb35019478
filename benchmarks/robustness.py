"""Robustness benchmark: what a federated run survives, and what local DP-SGD costs in accuracy.

Two tables, both on real data (SST-2, seeded subsamples) with the real all-MiniLM-L6-v2:

**Faults** (LoRA r=8 on query/value + head, FedAvg, cross-silo: every client every round, so each
injected fault hits every round). A clean run is compared with runs in which one client (client 1)
sends, every round, a bad update of each kind the server validates (``nan``, ``inf``,
``wrong_shape``, ``unknown_key``, ``missing_key``, ``oversize`` against ``strategy.max_update_bytes``,
``zero_samples``), a damaged message (``truncated``, ``wrong_dtype``), a x10^6 update (``huge``:
well-formed, so it is aggregated unless a robust aggregation is on: ``huge+median``), raises
(``raise``), never replies within ``client.timeout_seconds`` (``timeout``), or is 20x slower
(``straggler``: same model, slower simulated rounds); runs in which every client drops out with
probability 10/30/50% per round (``dropout_p``); and a run killed with SIGKILL at several points
(after round k's metrics line, and mid-round) and resumed each time with ``--resume``
(``sigkill``). Each row: rounds completed of those expected, the final accuracy against the
clean run's, how many (round, client) faults were injected and how many replies the server
dropped, and the simulated time (bandwidth model: 10/1 Mbps) against the clean run's.

**Local DP** (FedTT Table 4 setting scaled to a CPU: 3 clients, cross-silo, DP-SGD on every client
through Opacus, delta 1e-5, clip norm C, epsilon 1/3/6 over the whole run, and the non-private run
as reference) for LoRA, FedTT (Up projections x 1e-3 at init, ``adapter.tt_up_init_scale``) and
BitFit: best and final accuracy and the epsilon actually spent.

Outputs: ``robustness.json`` (``rows``: one per fault; ``dp``: one per method and epsilon) and
``robustness.md`` in ``--out``. Finished runs in ``--work-dir`` are reused, interrupted ones
resumed. ``--smoke`` runs everything at toy scale (tiny random BERT, a few examples) to check the
script, not to measure anything.

Run: ``.venv/bin/python benchmarks/robustness.py`` (``--parts faults`` or ``--parts dp`` runs one
table; the JSON holds what the call ran, so a last call with both parts assembles cached runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from fedpeft.config import deep_merge

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).parent / "results"
SRC = Path(__file__).resolve().parents[1] / "src"
FAULTY = 1  # the client that misbehaves in the single-client fault runs

# fault name -> (what is injected, config overrides)
FAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "clean": ("nothing", {}),
    **{kind: (f"client {FAULTY} sends a {kind} update every round", {"faults": [{"kind": kind, "clients": [FAULTY]}]})
       for kind in ("nan", "inf", "wrong_shape", "unknown_key", "missing_key", "oversize", "zero_samples")},
    "truncated": (f"client {FAULTY}'s upload cut in half every round",
                  {"faults": [{"kind": "truncated", "clients": [FAULTY]}]}),
    "wrong_dtype": (f"client {FAULTY}'s upload holds an int64 tensor every round",
                    {"faults": [{"kind": "wrong_dtype", "clients": [FAULTY]}]}),
    "huge": (f"client {FAULTY}'s update x 10^6 every round (well-formed), FedAvg",
             {"faults": [{"kind": "huge", "clients": [FAULTY]}]}),
    "huge+median": (f"client {FAULTY}'s update x 10^6 every round, coordinate-wise median",
                    {"faults": [{"kind": "huge", "clients": [FAULTY]}], "strategy": {"robust": "median"}}),
    "raise": (f"client {FAULTY} raises every round", {"faults": [{"kind": "raise", "clients": [FAULTY]}]}),
    "timeout": (f"client {FAULTY} never replies within client.timeout_seconds = 600",
                {"faults": [{"kind": "timeout", "clients": [FAULTY]}], "client": {"timeout_seconds": 600.0}}),
    "straggler": (f"client {FAULTY} computes 20x slower (time model)",
                  {"faults": [{"kind": "straggler", "clients": [FAULTY], "slowdown": 20.0}]}),
    **{f"dropout_{p}": (f"every client drops out with probability {p} per round",
                        {"faults": [{"kind": "dropout", "probability": p}]}) for p in (0.1, 0.3, 0.5)},
}
DP_METHODS = {
    "lora": ("lora", {"adapter": {"kind": "lora", "r": 8, "alpha": 16, "target_modules": ["query", "value"]}}),
    "fedtt_up1e-3": ("fedtt", {"adapter": {"tt_up_init_scale": 1e-3}}),  # near-identity start: see fedtt.md
    "bitfit": ("bitfit", {}),
}


def base_config(args: argparse.Namespace, run_dir: Path, clients: int, rounds: int, train: int, local_steps: int,
                batch_size: int) -> dict[str, Any]:
    return {
        "method": "lora",
        "seed": args.seed,
        "rounds": rounds,
        "task": {"name": "sst2", "max_train_examples": train, "max_eval_examples": args.eval_examples,
                 "max_length": args.max_length},
        "partition": {"kind": "iid", "num_clients": clients},
        "model": {"name": args.model},
        "adapter": {"kind": "lora", "r": 8, "alpha": 16, "target_modules": ["query", "value"]},
        "client": {"optimizer": "adamw", "lr": args.lr, "batch_size": batch_size, "local_steps": local_steps},
        "strategy": {"name": "fedavg", "selection": "all", "max_update_bytes": 4_000_000},
        "network": {"down_mbps": 10.0, "up_mbps": 1.0},
        "engine": {"threads": args.threads},
        "evaluation": {"every": 1, "at_start": False, "batch_size": 64},
        "output": {"run_dir": str(run_dir), "progress": False},
    }


def fault_config(args: argparse.Namespace, name: str, run_dir: Path) -> dict[str, Any]:
    base = base_config(args, run_dir, args.clients, args.rounds, args.train_examples, args.local_steps,
                       args.batch_size)
    return deep_merge(base, FAULTS[name][1])


def dp_config(args: argparse.Namespace, method: str, epsilon: float | None, clip: float, run_dir: Path
              ) -> dict[str, Any]:
    recipe, overrides = DP_METHODS[method]
    base = base_config(args, run_dir, args.dp_clients, args.dp_rounds, args.dp_train_examples, args.dp_local_steps,
                       args.dp_batch_size)
    base = {**base, "method": recipe}
    if recipe != "lora":
        base.pop("adapter")  # the recipe's own adapter, with the method's overrides on top
    base = deep_merge(deep_merge(base, overrides), {"client": {"lr": args.dp_lr}})
    if epsilon is not None:
        base["client"]["dp"] = {"epsilon": epsilon, "delta": args.delta, "clip_norm": clip}
    return base


def finished(run_dir: Path, rounds: int) -> list[dict[str, Any]] | None:
    from fedpeft.metrics.recorder import load_metrics

    records = load_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    return records if records and records[-1]["round"] >= rounds else None


def run_in_process(raw: dict[str, Any], run_dir: Path, label: str) -> list[dict[str, Any]]:
    """Run (or reuse, or resume) one experiment here; a RoundFailed ends it early, which is an outcome."""
    from fedpeft.config import build_config
    from fedpeft.engines.local import LocalEngine
    from fedpeft.experiment import prepare
    from fedpeft.federated.validation import RoundFailed
    from fedpeft.metrics.recorder import load_metrics

    done = finished(run_dir, raw["rounds"])
    if done is not None:
        return done
    failed_marker = run_dir / "round_failed.txt"
    if failed_marker.exists():
        return load_metrics(run_dir)
    t0 = time.perf_counter()
    engine = LocalEngine(prepare(build_config(raw)), run_dir)
    try:
        engine.run(resume=(run_dir / "checkpoint.pt").exists(), on_round=lambda r: print(
            f"  {label} round {r['round']}: acc={r['eval'].get('accuracy', float('nan')):.4f} "
            f"failures={len(r.get('failures', []))} ({r['time']['round']:.0f}s)", flush=True))
    except RoundFailed as err:
        failed_marker.write_text(str(err))
        print(f"  {label}: {err}", flush=True)
    print(f"{label}: {time.perf_counter() - t0:.0f}s", flush=True)
    return load_metrics(run_dir)


def run_with_kills(args: argparse.Namespace, raw: dict[str, Any], run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """Run in a subprocess, SIGKILL it at each ``--kill-points`` entry (metrics lines, extra seconds),
    ``--resume`` after each kill, and finish; returns the metrics and the number of kills made."""
    done = finished(run_dir, raw["rounds"])
    kills_file = run_dir / "kills.json"
    if done is not None and kills_file.exists():
        return done, int(json.loads(kills_file.read_text()))
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, "-m", "fedpeft", "run", str(config)]
    kills = 0
    for lines, delay in args.kill_points:
        started = (run_dir / "config.yaml").exists()
        proc = subprocess.Popen([*command, *(["--resume", str(run_dir)] if started else ["--run-dir", str(run_dir)])],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        metrics = run_dir / "metrics.jsonl"
        while proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= lines:
                break
            time.sleep(0.05)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
            print(f"  sigkill: killed after {lines} metrics lines + {delay}s", flush=True)
        proc.wait()
    final = subprocess.run([*command, "--resume", str(run_dir)], env=env, capture_output=True, text=True)
    if final.returncode != 0:
        raise RuntimeError(f"resume after kills failed: {final.stderr[-2000:]}")
    kills_file.write_text(json.dumps(kills))
    from fedpeft.metrics.recorder import load_metrics

    return load_metrics(run_dir), kills


def injected_faults(raw: dict[str, Any], records: list[dict[str, Any]]) -> int:
    """(round, client) pairs hit by a configured fault, from the seeded draws the engine made."""
    from fedpeft.config import build_config
    from fedpeft.federated.faults import active_faults

    cfg = build_config(raw)
    return sum(len(active_faults(cfg.faults, cfg.seed, r["round"], c)) > 0
               for r in records if r["round"] > 0 for c in r.get("selected", r["clients"]))


def metric_of(records: list[dict[str, Any]], which: str) -> float | None:
    values = [r["eval"]["accuracy"] for r in records if r["round"] > 0 and "accuracy" in r["eval"]]
    if not values:
        return None
    return values[-1] if which == "final" else max(values)


def fault_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(args.work_dir) / "faults"
    runs: dict[str, tuple[dict[str, Any], list[dict[str, Any]], int | None]] = {}
    for name in FAULTS:
        raw = fault_config(args, name, work / name)
        runs[name] = (raw, run_in_process(raw, work / name, name), None)
    raw = fault_config(args, "clean", work / "sigkill")
    records, kills = run_with_kills(args, raw, work / "sigkill")
    runs["sigkill"] = (raw, records, kills)
    clean = runs["clean"][1]
    rows = []
    for name, (raw, records, kills) in runs.items():
        trained = [r for r in records if r["round"] > 0]
        failures = [f for r in trained for f in r.get("failures", [])]
        description = (f"SIGKILL at {kills} points ({', '.join(f'{n} lines + {d}s' for n, d in args.kill_points)}),"
                       f" --resume after each" if name == "sigkill" else FAULTS[name][0])
        rows.append({
            "fault": name,
            "description": description,
            "injected": kills if name == "sigkill" else injected_faults(raw, records),
            "replies_dropped": len(failures),
            "dropped_by_stage": {s: sum(f["stage"] == s for f in failures)
                                 for s in sorted({f["stage"] for f in failures})},
            "first_reason": failures[0]["reason"] if failures else None,
            "rounds_completed": len(trained),
            "rounds_expected": raw["rounds"],
            "final_metric": metric_of(records, "final"),
            "best_metric": metric_of(records, "best"),
            "clean_final_metric": metric_of(clean, "final"),
            "simulated_seconds": trained[-1]["time"]["cum_simulated"] if trained else None,
            "clean_simulated_seconds": clean[-1]["time"]["cum_simulated"] if clean else None,
            "wall_seconds": sum(r["time"]["round"] for r in records),
        })
    return rows


def dp_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for method in args.dp_methods:
        for epsilon in [None, *args.epsilons]:
            for clip in (args.clip_norms if epsilon is not None else [None]):
                name = f"{method}_eps{epsilon}_C{clip}" if epsilon is not None else f"{method}_nodp"
                run_dir = Path(args.work_dir) / "dp" / name
                raw = dp_config(args, method, epsilon, clip or 0.0, run_dir)
                records = run_in_process(raw, run_dir, name)
                trained = [r for r in records if r["round"] > 0]
                privacy = trained[-1].get("privacy", {}) if trained else {}
                rows.append({
                    "method": method, "epsilon": epsilon, "delta": args.delta if epsilon is not None else None,
                    "clip_norm": clip, "best_metric": metric_of(records, "best"),
                    "final_metric": metric_of(records, "final"),
                    "epsilon_spent": privacy.get("max_epsilon"),
                    "noise_multiplier": privacy.get("noise_multiplier", {}).get("0"),
                    "rounds": len(trained), "clients": args.dp_clients,
                    "trainable_params": trained[0]["trainable_params"] if trained else None,
                    "wall_seconds": sum(r["time"]["round"] for r in records),
                })
    return rows


def fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Robustness: faults survived, and the accuracy cost of local DP-SGD", "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine']}", ""]
    if result["rows"]:
        lines += [f"## Faults ({result['fault_setup']})", "",
                  "| fault | injected (what) | injected (round, client) | replies dropped | rounds | final acc "
                  "| clean final acc | simulated s | clean simulated s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            lines.append(f"| {r['fault']} | {r['description']} | {r['injected']} | {r['replies_dropped']} "
                         f"| {r['rounds_completed']}/{r['rounds_expected']} | {fmt(r['final_metric'])} "
                         f"| {fmt(r['clean_final_metric'])} | {fmt(r['simulated_seconds'], 1)} "
                         f"| {fmt(r['clean_simulated_seconds'], 1)} |")
        lines.append("")
    if result["dp"]:
        lines += [f"## Local DP-SGD ({result['dp_setup']})", "",
                  "| method | epsilon (target) | delta | C | epsilon spent | noise multiplier | best acc | final acc "
                  "| trainable params |", "|---|---|---|---|---|---|---|---|---|"]
        for r in result["dp"]:
            lines.append(f"| {r['method']} | {'none (no DP)' if r['epsilon'] is None else r['epsilon']} "
                         f"| {r['delta'] if r['delta'] is not None else '-'} | {r['clip_norm'] or '-'} "
                         f"| {fmt(r['epsilon_spent'], 3)} | {fmt(r['noise_multiplier'], 3)} "
                         f"| {fmt(r['best_metric'])} | {fmt(r['final_metric'])} | {r['trainable_params']:,} |")
        lines.append("")
    return "\n".join(lines)


def parse_kill_points(text: str) -> list[tuple[int, float]]:
    points = []
    for item in text.split(","):
        lines, _, delay = item.partition(":")
        points.append((int(lines), float(delay or 0)))
    return points


SMOKE = {"model": "tiny-bert", "train_examples": 60, "eval_examples": 32, "clients": 3, "rounds": 2, "local_steps": 1,
         "dp_train_examples": 60, "dp_clients": 3, "dp_rounds": 2, "dp_local_steps": 1, "epsilons": [3.0],
         "kill_points": [(1, 0.0)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="faults,dp", help="faults, dp or both")
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--eval-examples", type=int, default=400)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train-examples", type=int, default=1200, help="faults: SST-2 training subsample")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--kill-points", type=parse_kill_points, default=parse_kill_points("1:0,2:4,4:0.2"),
                        help="LINES:SECONDS,...: kill once the metrics file has LINES lines, SECONDS later")
    parser.add_argument("--dp-methods", type=lambda s: s.split(","), default=list(DP_METHODS))
    parser.add_argument("--epsilons", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 3.0, 6.0])
    parser.add_argument("--clip-norms", type=lambda s: [float(x) for x in s.split(",")], default=[2.0])
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--dp-train-examples", type=int, default=3000)
    parser.add_argument("--dp-clients", type=int, default=3)
    parser.add_argument("--dp-rounds", type=int, default=8)
    parser.add_argument("--dp-local-steps", type=int, default=6)
    parser.add_argument("--dp-batch-size", type=int, default=32)
    parser.add_argument("--dp-lr", type=float, default=2e-3)
    parser.add_argument("--work-dir", default="runs/bench_robustness")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--smoke", action="store_true", help="toy scale: checks the script, measures nothing")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    unknown = [m for m in args.dp_methods if m not in DP_METHODS]
    if unknown:
        parser.error(f"unknown --dp-methods {unknown}; allowed: {', '.join(DP_METHODS)}")
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}

    result = {
        "benchmark": "robustness",
        "command": "python benchmarks/robustness.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores shared with other jobs, "
                   f"torch threads {args.threads}, Python {platform.python_version()}",
        "fault_setup": (f"{args.model}, LoRA r=8 q/v + head, SST-2: {args.train_examples} training examples "
                        f"(seeded subsample) over {args.clients} iid clients, all selected every round, "
                        f"{args.eval_examples} dev examples, max length {args.max_length}; {args.rounds} rounds of "
                        f"{args.local_steps} local AdamW steps (lr {args.lr}, batch {args.batch_size}); FedAvg; "
                        f"strategy.max_update_bytes 4 MB; time model 10 Mbps down / 1 Mbps up; seed {args.seed}"),
        "dp_setup": (f"{args.model}, SST-2: {args.dp_train_examples} training examples over {args.dp_clients} iid "
                     f"clients (cross-silo, as FedTT Table 4), {args.eval_examples} dev examples, max length "
                     f"{args.max_length}; {args.dp_rounds} rounds of {args.dp_local_steps} local DP-SGD steps "
                     f"(AdamW lr {args.dp_lr}, Poisson batches of expected size {args.dp_batch_size}); epsilon is "
                     f"the budget of the whole run at delta {args.delta} (RDP accountant); FedAvg; seed {args.seed}"),
        "rows": fault_rows(args) if "faults" in parts else [],
        "dp": dp_rows(args) if "dp" in parts else [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "robustness.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "robustness.md").write_text(markdown(result))
    print((out / "robustness.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

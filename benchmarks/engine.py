"""Local-engine overhead and memory on the real MiniLM with LoRA.

(a) ``overhead_fraction``: of each round's wall time (evaluation excluded: it is its own phase
and is reported separately), the part spent outside forward/backward/optimizer steps, i.e. in
selection, state swaps, batching, codec and aggregation. Measured on rounds 2..R (round 1 also
counts FLOPs once, which is a one-off).
(b) ``rss_ratio_1000_vs_10``: peak resident memory of a run with 1000 registered clients over
one with 10 clients, both sampling 10 clients a round on the same 20,000 training examples, every
sampled client running the same 5 steps of batch 16 (with 1000 clients a shard holds 20 examples,
enough for full batches, so the two runs do identical work): memory must not grow with the number
of registered clients.

Run: ``.venv/bin/python benchmarks/engine.py`` (writes benchmarks/results/engine.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

RESULTS = Path(__file__).parent / "results"
COMMAND = "python benchmarks/engine.py"
TRAIN_EXAMPLES = 20_000  # 20 per client with 1000 clients: every sampled client runs full batches


def experiment(num_clients: int, rounds: int, run_dir: str) -> dict[str, Any]:
    return {
        "method": "lora",
        "seed": 0,
        "rounds": rounds,
        "task": {"name": "sst2", "max_train_examples": TRAIN_EXAMPLES, "max_eval_examples": 64, "max_length": 64},
        "partition": {"kind": "iid", "num_clients": num_clients},
        "model": {"name": "minilm"},
        "adapter": {"kind": "lora", "r": 8, "alpha": 16},
        "client": {"optimizer": "adamw", "lr": 0.001, "batch_size": 16, "local_steps": 5},
        "strategy": {"name": "fedavg", "clients_per_round": 10},
        "evaluation": {"every": rounds},
        "output": {"run_dir": run_dir, "progress": False},
    }


def run_once(num_clients: int, rounds: int) -> dict[str, Any]:
    """Run in this process; return per-round timings and peak RSS (MiB)."""
    from fedpeft.config import build_config
    from fedpeft.engines.local import LocalEngine
    from fedpeft.experiment import prepare

    with TemporaryDirectory() as tmp:
        exp = prepare(build_config(experiment(num_clients, rounds, tmp)))
        records = LocalEngine(exp, Path(tmp)).run()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"records": [{"round": r["round"], "time": r["time"]} for r in records], "peak_rss_mib": peak_mib}


def measure_in_subprocess(num_clients: int, rounds: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", str(num_clients), str(rounds)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def overhead(records: list[dict[str, Any]]) -> dict[str, float]:
    steady = [r for r in records if r["round"] > 1]
    round_seconds = sum(r["time"]["round"] - r["time"]["evaluation"] for r in steady)
    step_seconds = sum(r["time"]["train_steps"] for r in steady)
    phases = {k: sum(r["time"][k] for r in steady) for k in ("codec", "aggregation")}
    return {"round_seconds": round_seconds, "step_seconds": step_seconds,
            "overhead_fraction": 1 - step_seconds / round_seconds, **{f"{k}_seconds": v for k, v in phases.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child:
        print(json.dumps(run_once(*args.child)))
        return

    small = measure_in_subprocess(10, args.rounds)
    large = measure_in_subprocess(1000, args.rounds)
    timing = overhead(small["records"])
    result = {
        "benchmark": "engine",
        "command": COMMAND,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "overhead_fraction": timing["overhead_fraction"],
        "rss_ratio_1000_vs_10": large["peak_rss_mib"] / small["peak_rss_mib"],
        "peak_rss_mib_10_clients": small["peak_rss_mib"],
        "peak_rss_mib_1000_clients": large["peak_rss_mib"],
        "steady_rounds": args.rounds - 1,
        "round_seconds": timing["round_seconds"],
        "step_seconds": timing["step_seconds"],
        "codec_seconds": timing["codec_seconds"],
        "aggregation_seconds": timing["aggregation_seconds"],
        "workload": f"MiniLM LoRA r=8 q/v, SST-2 {TRAIN_EXAMPLES} examples, seq<=64, "
                    "10 clients/round x 5 steps of batch 16",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "engine.md").write_text(
        "# Local engine: overhead and memory\n\n"
        f"Command: `{COMMAND}`  \nMachine: {result['machine']}  \nWorkload: {result['workload']}\n\n"
        "| measure | value | goal |\n|---|---|---|\n"
        f"| time outside forward/backward/optimizer (rounds 2..{args.rounds}, eval excluded) | "
        f"{result['overhead_fraction']:.2%} | <= 5% |\n"
        f"| peak RSS, 1000 vs 10 registered clients (10 sampled per round) | "
        f"{result['rss_ratio_1000_vs_10']:.3f} "
        f"({large['peak_rss_mib']:.0f} / {small['peak_rss_mib']:.0f} MiB) | <= 1.1 |\n"
        f"| codec seconds / aggregation seconds (steady rounds) | {timing['codec_seconds']:.3f} / "
        f"{timing['aggregation_seconds']:.3f} | |\n"
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

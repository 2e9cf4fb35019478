"""Engines on MiniLM LoRA-FedAvg: torchrun scaling, and the local engine beside Flower's.

(a) ``torchrun_speedup_2_vs_1``: clients trained per second with ``torchrun --nproc-per-node 2``
over ``--nproc-per-node 1`` (one thread per rank, so 2 ranks use the machine's 2 cores), from
each run's metrics.jsonl: clients / sum(round seconds - evaluation seconds) over rounds 2..R
(round 1 also counts FLOPs once). Rank 0 evaluates alone, so evaluation is left out of both.

(b) ``local_vs_flower_speedup``: Flower's seconds per round (rounds 2..R, as the same round loop
records them) over the local engine's, on the same config (clients, data, rounds, seeds).
"Flower" is fedpeft's ServerApp/ClientApp on Flower's Simulation Engine (Ray; one virtual
SuperNode per client, one CPU per ClientApp worker) when ray is installed, else on a loopback
deployment (SuperLink + 2 SuperNodes, a ClientApp process per node and round). torchrun with 2
ranks runs the same workload too, for context: fedpeft's own way of training clients in parallel.
``local_vs_flower_memory_ratio``: peak memory of the Flower run over the local run's, each the
largest sum over time of the proportional set size (PSS, so shared libraries count once) of every
process the run started (SuperLink, SuperExec, ServerApp, Ray or SuperNodes, ClientApps),
sampled every 0.25 s. The local engine runs one process with 2 threads; every Flower ClientApp
and torchrun rank runs with 1.

Run on a quiet machine: ``python benchmarks/engines.py`` (writes benchmarks/results/engines.{json,md});
``--rounds 1 --out /tmp/engines`` checks the script in a few minutes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
import yaml

from fedpeft.config import build_config
from fedpeft.engines.deploy import LocalDeployment, descendants, free_port, write_app
from fedpeft.metrics.recorder import load_metrics

RESULTS = Path(__file__).parent / "results"
COMMAND = "python benchmarks/engines.py"


def workload(rounds: int, num_clients: int, kind: str, threads: int) -> dict[str, Any]:
    """MiniLM LoRA r=8 (q/v) FedAvg on SST-2, every client every round, 5 local steps of 16 at seq <= 64."""
    return {
        "method": "lora", "seed": 0, "rounds": rounds,
        "task": {"name": "sst2", "max_train_examples": 100 * num_clients, "max_eval_examples": 128, "max_length": 64},
        "partition": {"kind": "iid", "num_clients": num_clients},
        "model": {"name": "minilm"},
        "adapter": {"kind": "lora", "r": 8, "alpha": 16},
        "client": {"optimizer": "adamw", "lr": 0.001, "batch_size": 16, "local_steps": 5},
        "strategy": {"name": "fedavg", "selection": "all"},
        "evaluation": {"every": rounds},
        "engine": {"kind": kind, "threads": threads},
        "output": {"progress": False},
    }


def pss_kib(pid: int) -> int:
    """Proportional set size of ``pid`` (KiB); its RSS where smaps_rollup is unreadable; 0 once gone."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakMemory:
    """Samples the summed PSS of the process trees under ``roots()`` until stopped; keeps the peak."""

    def __init__(self, roots: Any, interval: float = 0.25) -> None:
        self.roots = roots
        self.interval = interval
        self.peak_kib = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.done.is_set():
            pids = {pid for root in self.roots() for pid in descendants(root)}
            self.peak_kib = max(self.peak_kib, sum(pss_kib(pid) for pid in pids))
            self.done.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    @property
    def mib(self) -> float:
        return self.peak_kib / 1024


def steady(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rounds 2..R (all rounds when there is only one)."""
    trained = [r for r in records if r["round"] > 0]
    return [r for r in trained if r["round"] > 1] or trained


def run_command(command: list[str], log: Path, env: dict[str, str]) -> tuple[float, float]:
    """Run ``command`` to the end; returns (wall seconds, peak MiB of its process tree)."""
    t0 = time.perf_counter()
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        with PeakMemory(lambda: [process.pid]) as memory:
            status = process.wait()
    if status != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {status}; see {log}")
    return time.perf_counter() - t0, memory.mib


def write_config(raw: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["global_state"]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def run_fedpeft(work: Path, name: str, raw: dict[str, Any], ranks: int | None, env: dict[str, str]
                ) -> dict[str, Any]:
    """``fedpeft run`` (``ranks`` None) or ``torchrun --nproc-per-node ranks -m fedpeft run``; its measures."""
    config = write_config(raw, work / f"{name}.yaml")
    launcher = [] if ranks is None else ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                                         "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    command = [sys.executable, *launcher, "-m", "fedpeft", "run", str(config), "--run-dir", str(work / name)]
    wall, peak = run_command(command, work / f"{name}.log", env)
    return measures(work / name, wall, peak)


def measures(run_dir: Path, wall: float, peak: float) -> dict[str, Any]:
    """Seconds per round and clients per second (rounds 2..R; evaluation left out of the latter)."""
    rounds = steady(load_metrics(run_dir))
    training = sum(r["time"]["round"] - r["time"]["evaluation"] for r in rounds)
    return {"seconds_per_round": sum(r["time"]["round"] for r in rounds) / len(rounds),
            "clients_per_second": sum(len(r["clients"]) for r in rounds) / training,
            "wall_seconds": wall, "peak_memory_mib": peak, "final_state": final_state(run_dir)}


def torchrun_scaling(work: Path, rounds: int, num_clients: int, env: dict[str, str]) -> dict[str, Any]:
    """(a) clients per second with 1 and 2 ranks (one thread each) on the same rounds."""
    runs = {str(k): run_fedpeft(work, f"torchrun{k}", workload(rounds, num_clients, "torchrun", 1), k, env)
            for k in (1, 2)}
    return {
        "clients_per_second": {k: r["clients_per_second"] for k, r in runs.items()},
        "wall_seconds": {k: r["wall_seconds"] for k, r in runs.items()},
        "peak_memory_mib": {k: r["peak_memory_mib"] for k, r in runs.items()},
        "speedup": runs["2"]["clients_per_second"] / runs["1"]["clients_per_second"],
        "max_weight_difference": max_difference(runs["1"]["final_state"], runs["2"]["final_state"]),
    }


def flower_run(work: Path, raw: dict[str, Any], nodes: int, simulation: bool, gpus_per_client: float = 0.0
               ) -> dict[str, Any]:
    """fedpeft's Flower app on Flower's Simulation Engine (its workers sharing a GPU by ``gpus_per_client``)
    or a loopback deployment; its measures."""
    run_dir = work / "flower"
    app = write_app(build_config(raw), work / "app", run_dir)
    t0 = time.perf_counter()
    with LocalDeployment(work / "deployment", nodes, simulation=simulation,
                         gpus_per_client=gpus_per_client) as deployment, \
            (work / "flower.log").open("wb") as log, \
            PeakMemory(lambda: [p.pid for p in list(deployment.processes.values())]) as memory:
        status = deployment.start_run(app, log).wait()
        superlink_log = (deployment.work_dir / "superlink.log").read_text(errors="replace")
    if status != 0 or not (run_dir / "summary.json").exists():  # flwr run exits 0 even when the ServerApp failed
        tail = (work / "flower.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"the Flower run failed (flwr run status {status}):\n{tail}\n--- SuperLink ---\n"
                           f"{superlink_log[-3000:]}")
    return measures(run_dir, time.perf_counter() - t0, memory.mib)


def local_and_flower(work: Path, rounds: int, num_clients: int, flower: str, env: dict[str, str]) -> dict[str, Any]:
    """(b) the same experiment on the local engine (1 process, 2 threads), on torchrun (2 ranks, 1 thread
    each: fedpeft's own parallel engine, for context) and on Flower; seconds per round and peak memory."""
    simulation = flower == "simulation"
    nodes = num_clients if simulation else 2
    runs = {"local": run_fedpeft(work, "local", workload(rounds, num_clients, "local", 2), None, env),
            "torchrun": run_fedpeft(work, "torchrun2-b", workload(rounds, num_clients, "torchrun", 1), 2, env),
            "flower": flower_run(work, workload(rounds, num_clients, "flower", 1), nodes, simulation)}
    engine = (f"simulation (Ray {importlib.metadata.version('ray')}, {nodes} virtual SuperNodes)" if simulation
              else f"deployment (loopback, {nodes} SuperNodes)")
    seconds = {name: r["seconds_per_round"] for name, r in runs.items()}
    memory = {name: r["peak_memory_mib"] for name, r in runs.items()}
    return {
        "flower_engine_used": engine,
        "seconds_per_round": seconds,
        "speedup": seconds["flower"] / seconds["local"],
        "peak_memory_mib": memory,
        "memory_ratio": memory["flower"] / memory["local"],
        "wall_seconds": {name: r["wall_seconds"] for name, r in runs.items()},
        "max_weight_difference": max_difference(runs["local"]["final_state"], runs["flower"]["final_state"]),
    }


def markdown(result: dict[str, Any]) -> str:
    a, b = result["torchrun"], result["local_vs_flower"]
    labels = {"local": "local (1 process, 2 threads)", "torchrun": "torchrun (2 ranks, 1 thread each)",
              "flower": f"Flower {b['flower_engine_used']}, 1 thread per ClientApp"}
    return (
        "# Engines: torchrun scaling; local engine vs Flower\n\n"
        f"Command: `{result['command']}`  \nMachine: {result['machine']}  \nWorkload: {result['workload']}\n\n"
        "## (a) torchrun, 1 vs 2 ranks (1 thread each)\n\n"
        "| ranks | clients / s (rounds 2..R, evaluation excluded) | wall s | peak memory MiB |\n|---|---|---|---|\n"
        + "".join(f"| {k} | {a['clients_per_second'][k]:.3f} | {a['wall_seconds'][k]:.1f} | "
                  f"{a['peak_memory_mib'][k]:.0f} |\n" for k in ("1", "2"))
        + f"\nSpeedup 2 vs 1: **{a['speedup']:.2f}x** (goal >= 1.7x); final weights of the two runs differ by at most "
          f"{a['max_weight_difference']:.1e}.\n\n"
        "## (b) the same workload on the local engine and on Flower\n\n"
        "| engine | s / round (rounds 2..R) | peak memory MiB (PSS, all processes) | wall s (with start-up) |\n"
        "|---|---|---|---|\n"
        + "".join(f"| {labels[name]} | {b['seconds_per_round'][name]:.2f} | {b['peak_memory_mib'][name]:.0f} | "
                  f"{b['wall_seconds'][name]:.1f} |\n" for name in ("local", "torchrun", "flower"))
        + f"\nFlower / local: **{b['speedup']:.2f}x** the seconds per round, **{b['memory_ratio']:.2f}x** the peak "
          f"memory. Final weights differ by at most {b['max_weight_difference']:.1e} (the local run uses 2 threads, "
          "Flower's workers 1: float sums in another order).\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--torchrun-clients", type=int, default=8, help="clients (all trained every round) for (a)")
    parser.add_argument("--flower-clients", type=int, default=4, help="clients (all trained every round) for (b)")
    parser.add_argument("--flower", choices=["auto", "simulation", "deployment"], default="auto",
                        help="Flower engine for (b); auto: simulation when ray is installed")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for engines.json and engines.md")
    parser.add_argument("--work-dir", type=Path, help="keep the runs, configs and logs here (default: a temp folder)")
    parser.add_argument("--only", choices=["torchrun", "flower"], help="run one part (no results are written)")
    args = parser.parse_args()
    flower = args.flower
    if flower == "auto":
        flower = "simulation" if importlib.util.find_spec("ray") else "deployment"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    with TemporaryDirectory(prefix="fedpeft-engines-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.only:
            part = (torchrun_scaling(work, args.rounds, args.torchrun_clients, env) if args.only == "torchrun"
                    else local_and_flower(work, args.rounds, args.flower_clients, flower, env))
            print(json.dumps(part, indent=2))
            return
        scaling = torchrun_scaling(work, args.rounds, args.torchrun_clients, env)
        versus = local_and_flower(work, args.rounds, args.flower_clients, flower, env)
    result = {
        "benchmark": "engines",
        "command": " ".join([COMMAND, *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "workload": (f"MiniLM LoRA r=8 q/v FedAvg, SST-2 100 examples per client, seq <= 64, 5 steps of batch 16 per "
                     f"client and round, {args.rounds} round{'s' if args.rounds != 1 else ''}; "
                     f"(a) {args.torchrun_clients} clients, (b) {args.flower_clients} clients"),
        "torchrun_speedup_2_vs_1": scaling["speedup"],
        "local_vs_flower_speedup": versus["speedup"],
        "local_vs_flower_memory_ratio": versus["memory_ratio"],
        "flower_engine_used": versus["flower_engine_used"],
        "torchrun": scaling,
        "local_vs_flower": versus,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engines.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "engines.md").write_text(markdown(result))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

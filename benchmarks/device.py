"""Accelerators: LoRA-FedAvg rounds on one device at each precision, and on Flower's Simulation Engine.

For each backbone (MiniLM; MPNet-base when ``fedpeft.models`` has an ``mpnet`` alias) and each
precision (``--precisions``, default fp32 and bf16), one run of the same workload with
``engine.device: --device``, each in a child process of its own so that its peak memory is its
own: clients per second (rounds 2..R, evaluation left out), seconds per round split by phase
(client compute, of which the train steps; codec; aggregation; evaluation), and peak memory:
``torch.cuda.max_memory_allocated`` on a CUDA device, else the child's peak RSS (``ru_maxrss``).
Then the fp32 MiniLM workload on Flower's Simulation Engine (Ray; one virtual SuperNode per client,
the GPU shared by the ClientApp workers through ``client-resources-num-gpus``) when ``flwr[simulation]``
is installed, else recorded as skipped with the reason.

A GPU owner runs ``python benchmarks/device.py --device cuda --rounds 5 --clients 8 --examples 64
--precisions fp32,bf16,bf16+cudnn`` (``bf16+cudnn``: bf16 with ``engine.cudnn_attention``, PyTorch's own
attention-kernel choice, against fedpeft's default that keeps half-precision attention off cuDNN).
``--profile N`` adds, for MiniLM at each precision, one more run under ``torch.profiler`` (kept apart
from the timed runs, whose numbers it would distort) and records its N operators with the most self
time, on the CPU side and, on a GPU, the device side: where a precision's time goes (cast kernels,
kernel launches, attention backend) rather than only how much there is.

Writes benchmarks/results/device.{json,md,png} for a CPU run and device_<type>.{json,md,png} for an
accelerator (``device_cuda.*``), so each device's committed results sit side by side: a small CPU run
(``--device cpu``, the defaults below, one thread) and the command above on an NVIDIA H200.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch

from engines import flower_run, steady
from fedpeft.devices import device_name, resolve_device
from fedpeft.metrics.recorder import load_metrics

RESULTS = Path(__file__).parent / "results"
COMMAND = "python benchmarks/device.py"
PHASES = ("client_compute", "train_steps", "codec", "aggregation", "evaluation")


def model_aliases() -> dict[str, str | None]:
    """Backbone alias -> None when it resolves to a local model, else why it is skipped."""
    from fedpeft.config import ConfigError
    from fedpeft.models.backbone import _resolve_source

    reasons: dict[str, str | None] = {}
    for alias in ("minilm", "mpnet"):
        try:
            source = _resolve_source(alias)
        except ConfigError as err:  # the alias exists, its package is not installed
            reasons[alias] = str(err)
            continue
        reasons[alias] = None if source != alias else f"fedpeft.models has no `{alias}` alias in this branch"
    return reasons


def precision_settings(precision: str) -> dict[str, Any]:
    """``bf16``, ``fp32``, ...: ``engine.precision``; ``+cudnn`` (``bf16+cudnn``) also sets
    ``engine.cudnn_attention``, PyTorch's own attention-kernel choice, to measure against the default."""
    base, _, variant = precision.partition("+")
    if variant not in ("", "cudnn"):
        raise SystemExit(f"--precisions: unknown variant {variant!r} in {precision!r} (allowed: +cudnn)")
    return {"precision": base, "cudnn_attention": variant == "cudnn"}


def workload(args: argparse.Namespace, model: str, precision: str, kind: str = "local") -> dict[str, Any]:
    """LoRA r=8 (q/v) FedAvg on SST-2, every client every round, ``--steps`` local steps of ``--batch``."""
    return {
        "method": "lora", "seed": 0, "rounds": args.rounds,
        "task": {"name": "sst2", "max_train_examples": args.examples * args.clients, "max_eval_examples": args.eval,
                 "max_length": args.max_length},
        "partition": {"kind": "iid", "num_clients": args.clients},
        "model": {"name": model},
        "adapter": {"kind": "lora", "r": 8, "alpha": 16},
        "client": {"optimizer": "adamw", "lr": 0.001, "batch_size": args.batch, "local_steps": args.steps},
        "strategy": {"name": "fedavg", "selection": "all"},
        "evaluation": {"every": args.rounds},
        "engine": {"kind": kind, "threads": args.threads, "device": args.device, **precision_settings(precision)},
        "output": {"progress": False},
    }


def top_operators(events: Any, top: int, device_side: bool) -> list[dict[str, Any]]:
    """The ``top`` operators by self time (device time when ``device_side``, else CPU time) of a
    profiler's ``key_averages()``: name, calls, self milliseconds and share of all self time."""
    def self_us(event: Any) -> float:
        return event.self_device_time_total if device_side else event.self_cpu_time_total

    total = sum(self_us(e) for e in events) or 1.0
    ranked = sorted(events, key=self_us, reverse=True)[:top]
    return [{"op": e.key, "calls": e.count, "self_ms": self_us(e) / 1000, "share": self_us(e) / total}
            for e in ranked if self_us(e) > 0]


def child(config: Path, run_dir: Path, out: Path, profile: int = 0) -> None:
    """One run in this process; writes its peak memory (or, with ``profile``, its top operators)."""
    from fedpeft.config import build_config
    from fedpeft.engines.local import LocalEngine
    from fedpeft.experiment import prepare

    exp = prepare(build_config(json.loads(config.read_text())))
    device = exp.slot.device
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiled

        gpu = device.type == "cuda"
        with profiled(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
            LocalEngine(exp, run_dir).run()
        events = prof.key_averages()
        out.write_text(json.dumps({"cpu_side": top_operators(events, profile, False),
                                   "device_side": top_operators(events, profile, True) if gpu else None}))
        return
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    LocalEngine(exp, run_dir).run()
    peak = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    kind = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS of the process"
    out.write_text(json.dumps({"peak_memory_mib": peak, "memory_kind": kind, "device": str(device)}))


def measures(run_dir: Path) -> dict[str, Any]:
    """Clients per second and seconds per round by phase over rounds 2..R."""
    rounds = steady(load_metrics(run_dir))
    training = sum(r["time"]["round"] - r["time"]["evaluation"] for r in rounds)
    return {"clients_per_second": sum(len(r["clients"]) for r in rounds) / training,
            "seconds_per_round": sum(r["time"]["round"] for r in rounds) / len(rounds),
            "phase_seconds_per_round": {p: sum(r["time"][p] for r in rounds) / len(rounds) for p in PHASES},
            "final_accuracy": rounds[-1]["eval"].get("accuracy")}


def run_one(work: Path, args: argparse.Namespace, model: str, precision: str, profile: int = 0) -> dict[str, Any]:
    """The timed run (``profile`` 0), or the profiled run's top operators."""
    name = f"{model}_{precision}" + ("_profiled" if profile else "")
    config, out = work / f"{name}.json", work / f"{name}.out.json"
    config.write_text(json.dumps(workload(args, model, precision)))
    command = [sys.executable, __file__, "--child", str(config), str(work / name), str(out), str(profile)]
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)})
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        return {"skipped": f"the run failed: {last}"}
    if profile:
        return json.loads(out.read_text())
    return {**measures(work / name), **json.loads(out.read_text())}


def flower_simulation(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    if importlib.util.find_spec("ray") is None:
        return {"skipped": "flwr[simulation] (ray) is not installed: pip install 'fedpeft[simulation]'"}
    gpus = 1.0 / args.clients if resolve_device(args.device).type == "cuda" else 0.0
    run = flower_run(work / "flower", workload(args, "minilm", "fp32", "flower"), args.clients, True, gpus)
    return {"seconds_per_round": run["seconds_per_round"], "clients_per_second": run["clients_per_second"],
            "peak_memory_mib": run["peak_memory_mib"], "memory_kind": "PSS of every process of the run",
            "gpus_per_client": gpus}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Command: `{result['command']}`\n", f"# Device benchmark ({result['label']})\n",
             f"Machine: {result['machine']}  ", f"Device: {result['device']}  ", f"Workload: {result['workload']}\n",
             "| model | precision | clients / s | s / round | client compute | train steps (fwd+bwd+step) | codec | "
             "aggregation | evaluation | peak memory MiB | accuracy |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, by_precision in result["runs"].items():
        for precision, run in by_precision.items():
            if "skipped" in run:
                lines.append(f"| {model} | {precision} | skipped: {run['skipped']} |||||||||")
                continue
            phases = " | ".join(f"{run['phase_seconds_per_round'][p]:.2f}" for p in PHASES)
            lines.append(f"| {model} | {precision} | {run['clients_per_second']:.2f} | {run['seconds_per_round']:.2f} "
                         f"| {phases} | {run['peak_memory_mib']:.0f} | {run['final_accuracy']:.3f} |")
    flower = result["flower_simulation"]
    lines += ["", "Phases are seconds per round (rounds 2..R); peak memory is "
              f"{next(iter(result['runs']['minilm'].values())).get('memory_kind', 'n/a')}.", "",
              "Flower Simulation Engine, MiniLM fp32: " + (f"skipped ({flower['skipped']})" if "skipped" in flower else
              f"{flower['seconds_per_round']:.2f} s / round, {flower['clients_per_second']:.2f} clients / s, "
              f"peak {flower['peak_memory_mib']:.0f} MiB ({flower['memory_kind']})"), ""]
    for precision, ops in result.get("profile", {}).items():
        if "skipped" in ops:
            lines += [f"Profile, MiniLM {precision}: skipped ({ops['skipped']})", ""]
            continue
        for side in ("device_side", "cpu_side"):
            if ops.get(side):
                lines += [f"#### Profile, MiniLM {precision}: top operators by self {side.split('_')[0].upper()} "
                          "time (a separate run under torch.profiler)\n", "| operator | calls | self ms | share |",
                          "|---|---|---|---|"]
                lines += [f"| `{o['op']}` | {o['calls']} | {o['self_ms']:.1f} | {o['share']:.1%} |" for o in ops[side]]
                lines.append("")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Stacked seconds per round by phase, one bar per model and precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{m}\n{p}", run) for m, runs in result["runs"].items() for p, run in runs.items() if "skipped" not in run]
    fig, ax = plt.subplots(figsize=(1.6 * len(bars) + 2, 3.6))
    bottom = [0.0] * len(bars)
    for phase in ("train_steps", "codec", "aggregation", "evaluation"):
        values = [run["phase_seconds_per_round"][phase] for _, run in bars]
        ax.bar([label for label, _ in bars], values, bottom=bottom, label=phase.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds per round")
    ax.set_title(f"LoRA FedAvg rounds, {result['label']}: {result['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="engine.device: auto, cpu, cuda, cuda:N, mps")
    parser.add_argument("--precisions", default="fp32,bf16",
                        help="comma-separated engine.precision values; bf16+cudnn: bf16 with engine.cudnn_attention")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4, help="clients, all trained every round")
    parser.add_argument("--examples", type=int, default=16, help="training examples per client")
    parser.add_argument("--steps", type=int, default=2, help="local steps per client and round")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--eval", type=int, default=32, help="evaluation examples (scored after the last round)")
    parser.add_argument("--threads", type=int, default=1, help="engine.threads (CPU threads per run)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile MiniLM at each precision in a separate run; record its N top operators")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = resolve_device(args.device)
    precisions = args.precisions.split(",")
    for precision in precisions:  # a typo stops here, before any run
        precision_settings(precision)
    with TemporaryDirectory(prefix="fedpeft-device-") as tmp:
        work = Path(tmp)
        runs = {model: ({p: run_one(work, args, model, p) for p in precisions} if reason is None
                        else {p: {"skipped": reason} for p in precisions})
                for model, reason in model_aliases().items()}
        flower = flower_simulation(work, args)
        profiles = ({p: run_one(work, args, "minilm", p, args.profile) for p in precisions} if args.profile else {})
    name = device_name(device)
    result = {
        "command": " ".join([COMMAND, *sys.argv[1:]]),
        "benchmark": "device",
        "label": "CPU" if device.type == "cpu" else device.type.upper(),
        "device": f"{device} ({name})",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                   f"torch {torch.__version__}",
        "workload": (f"LoRA r=8 q/v FedAvg on SST-2, {args.clients} clients x {args.examples} examples, all every "
                     f"round, {args.steps} steps of batch {args.batch} at seq <= {args.max_length}, {args.rounds} "
                     f"rounds, {args.eval} eval examples, {args.threads} thread(s)"),
        "runs": runs,
        "flower_simulation": flower,
        **({"profile": profiles} if profiles else {}),
    }
    stem = "device" if device.type == "cpu" else f"device_{device.type}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result))
    plot(result, args.out / f"{stem}.png")
    print(markdown(result))


if __name__ == "__main__":
    main()

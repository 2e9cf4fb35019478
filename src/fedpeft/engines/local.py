"""The local engine: every client in one process, one frozen backbone, states swapped in and out.

A round: the method selects clients and configures their tasks; each task's payload is encoded
with the down codec (bytes counted), decoded, trained on by the client, and its update encoded
with the up codec (bytes counted) and decoded for the server; the method aggregates; the global
state is evaluated every ``evaluation.every`` rounds; the round is recorded and checkpointed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedpeft.config import FaultConfig
from fedpeft.data.partition import describe_partition
from fedpeft.experiment import Experiment, evaluate
from fedpeft.federated.codec import CodecError
from fedpeft.federated.faults import MESSAGE_FAULTS, UPDATE_FAULTS, ClientCrashed, active_faults, corrupt, damage
from fedpeft.federated.timing import client_round_seconds, simulate_round
from fedpeft.federated.types import ClientResult, ClientTask, State
from fedpeft.federated.validation import RoundFailed, check_update, expected_upload_shapes
from fedpeft.metrics.recorder import Recorder, resume_fingerprint
from fedpeft.seeding import derive_seed, rng_for


@dataclass
class ClientRun:
    """One client's round as the wire saw it."""

    result: ClientResult
    bytes_down: int
    bytes_up: int
    codec_seconds: float
    compute_seconds: float
    step_seconds: float
    flops_per_step: int | None


def run_client(exp: Experiment, task: ClientTask, round_idx: int, count_flops: bool,
               faults: Sequence[FaultConfig] = ()) -> ClientRun:
    """Encode down, train, encode up. Shared by every engine's client side.

    ``faults`` (simulation only) crash the client, corrupt its reply or slow it down. With
    ``client.dp`` the client trains with its own DP-SGD state from ``exp.privacy``.
    """
    if any(f.kind == "raise" for f in faults):
        raise ClientCrashed(f"injected failure of client {task.client_id}")
    if exp.privacy is not None:
        task.privacy = exp.privacy.client(task.client_id)
    t0 = time.perf_counter()
    message = exp.down_codec.encode(task.payload)
    task.payload = exp.down_codec.decode(message)
    codec_seconds = time.perf_counter() - t0
    missing = [k for k in exp.slot.trainable if k not in task.payload]
    if missing:
        exp.slot.load({k: exp.initial_state[k] for k in missing})
    seed = derive_seed(exp.cfg.seed, "client", round_idx, task.client_id)
    shard = exp.shards[task.client_id]
    result, stats = exp.algorithm.client_update(exp.slot, exp.train_data, shard, task, seed, count_flops)
    for fault in faults:
        if fault.kind in UPDATE_FAULTS:
            result = corrupt(result, fault.kind)
        elif fault.kind == "straggler":
            stats.total_seconds *= fault.slowdown
    t0 = time.perf_counter()
    up_message = exp.up_codec.encode(result.update)
    for fault in faults:
        if fault.kind in MESSAGE_FAULTS:
            up_message = damage(up_message, fault.kind)
    result.update = exp.up_codec.decode(up_message)
    codec_seconds += time.perf_counter() - t0
    return ClientRun(result, len(message), len(up_message), codec_seconds, stats.total_seconds,
                     stats.step_seconds, stats.flops_per_step)


def partition_summary(exp: Experiment) -> dict[str, Any]:
    """Shard sizes and label histograms, for reports (no examples, only counts)."""
    labels = [ex.label for ex in exp.task.train]
    return {"label_names": list(exp.task.label_names),
            "clients": describe_partition(exp.shards, labels, exp.task.label_names)}


class LocalEngine:
    def __init__(self, exp: Experiment, run_dir: Path, console: Console | None = None) -> None:
        self.exp = exp
        self.recorder = Recorder(run_dir)
        self.console = console or Console()
        self.flops_per_step: int | None = None
        self.checkpoint_seconds = 0.0

    def _count_flops(self, round_idx: int, first_round: int) -> bool:
        mode = self.exp.cfg.engine.measure_flops
        # a resumed run keeps the checkpoint's count: re-measuring on other batches (Poisson-sampled
        # under DP, other padding) would make its metrics differ from an uninterrupted run's
        return mode == "every_round" or (mode == "first_round" and round_idx == first_round
                                         and self.flops_per_step is None)

    def _run_clients(self, round_idx: int, tasks: Sequence[ClientTask], global_state: State, count_flops: bool
                     ) -> tuple[list[ClientRun], list[dict[str, Any]]]:
        """Train every task; a client that drops out, fails or sends a bad reply is logged and skipped."""
        exp, cfg = self.exp, self.exp.cfg
        runs: list[ClientRun] = []
        failures: list[dict[str, Any]] = []
        for task in tasks:
            cid = task.client_id
            faults = active_faults(cfg.faults, cfg.seed, round_idx, cid)
            if any(f.kind == "dropout" for f in faults):
                failures.append({"client": cid, "stage": "dropout", "reason": "dropped out"})
                continue
            if any(f.kind == "timeout" for f in faults):
                failures.append({"client": cid, "stage": "timeout", "reason": "no reply before the deadline of "
                                 f"client.timeout_seconds = {cfg.client.timeout_seconds} s"})
                continue
            expected = {**expected_upload_shapes(task, global_state, exp.slot.trainable),
                        **exp.algorithm.extra_upload_shapes(task)}
            try:
                run = run_client(exp, task, round_idx, count_flops and not runs, faults)
            except CodecError as err:
                failures.append({"client": cid, "stage": "rejected", "reason": f"undecodable message: {err}"})
                continue
            except Exception as err:  # a failing client must not take the round down
                failures.append({"client": cid, "stage": "raised", "reason": f"{type(err).__name__}: {err}"})
                self.console.print(f"[yellow]client {cid} failed in round {round_idx}:[/] {type(err).__name__}: {err}")
                continue
            seconds = client_round_seconds(cfg.network, cfg.seed, round_idx, cid, run.bytes_down, run.bytes_up,
                                           run.compute_seconds)["total"]
            if cfg.client.timeout_seconds is not None and seconds > cfg.client.timeout_seconds:
                failures.append({"client": cid, "stage": "timeout", "reason": f"simulated round time {seconds:.3g} s "
                                 f"exceeds client.timeout_seconds = {cfg.client.timeout_seconds} s"})
                continue
            reason = check_update(run.result, expected, run.bytes_up, cfg.strategy.max_update_bytes)
            if reason is not None:
                failures.append({"client": cid, "stage": "rejected", "reason": reason})
                continue
            runs.append(run)
        return runs, failures

    def run_round(self, round_idx: int, global_state: State, first_round: int) -> tuple[State, dict[str, Any]]:
        exp, cfg = self.exp, self.exp.cfg
        t_round = time.perf_counter()
        clients = exp.algorithm.select(round_idx, rng_for(cfg.seed, "select", round_idx))
        tasks = exp.algorithm.configure_train(round_idx, clients, global_state)
        count_flops = self._count_flops(round_idx, first_round)
        runs, failures = self._run_clients(round_idx, tasks, global_state, count_flops)
        if len(runs) < cfg.strategy.min_clients:
            reasons = "; ".join(f"client {f['client']}: {f['reason']}" for f in failures)
            raise RoundFailed(f"round {round_idx}: {len(runs)} valid replies, strategy.min_clients is "
                              f"{cfg.strategy.min_clients} ({reasons})")
        selected = [int(c) for c in clients]
        clients = [r.result.client_id for r in runs]
        results = [r.result for r in runs]

        t0 = time.perf_counter()
        new_state = exp.algorithm.aggregate(round_idx, global_state, results)
        aggregation_seconds = time.perf_counter() - t0

        eval_metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        if round_idx % cfg.evaluation.every == 0 or round_idx == cfg.rounds:
            eval_metrics = evaluate(exp.slot, exp.eval_data, exp.task, new_state, cfg.evaluation.batch_size)
        client_eval = {}
        if cfg.evaluation.per_client:
            for c in clients:
                client_eval[str(c)] = evaluate(exp.slot, exp.train_data, exp.task, new_state,
                                               cfg.evaluation.batch_size, exp.shards[c])
        evaluation_seconds = time.perf_counter() - t0
        exp.algorithm.observe(round_idx, results, eval_metrics)

        flops = next((r.flops_per_step for r in runs if r.flops_per_step is not None), None)
        if flops is not None:
            self.flops_per_step = flops
        record: dict[str, Any] = {
            "round": round_idx,
            "selected": selected,
            "clients": [int(c) for c in clients],
            "num_samples": [r.num_samples for r in results],
            "train_loss": float(np.average([r.train_loss for r in results], weights=[r.num_samples for r in results])),
            "client_losses": [r.train_loss for r in results],
            "eval": eval_metrics,
            "bytes_down": [r.bytes_down for r in runs],
            "bytes_up": [r.bytes_up for r in runs],
            "client_seconds": [r.compute_seconds for r in runs],
            "trainable_params": exp.trainable_params,
            "client_flops_per_step": self.flops_per_step,
            "time": {
                "client_compute": sum(r.compute_seconds for r in runs),
                "train_steps": sum(r.step_seconds for r in runs),
                "codec": sum(r.codec_seconds for r in runs),
                "aggregation": aggregation_seconds,
                "evaluation": evaluation_seconds,
            },
            "method": exp.algorithm.round_metrics(round_idx, new_state),
        }
        if client_eval:
            record["client_eval"] = client_eval
        if failures:
            record["failures"] = failures
        record["time"].update(simulate_round(cfg.network, cfg.seed, round_idx, clients, record["bytes_down"],
                                             record["bytes_up"], [r.compute_seconds for r in runs]))
        if any(f["stage"] == "timeout" for f in failures):  # the server waited until the deadline
            record["time"]["simulated"] = max(record["time"]["simulated"], cfg.client.timeout_seconds)
        if exp.privacy is not None:
            record["privacy"] = exp.privacy.round_record()
        record["time"]["round"] = time.perf_counter() - t_round
        return new_state, record

    def _initial_record(self, state: State) -> dict[str, Any]:
        """Round 0: the global model before any training (no clients, no bytes)."""
        exp = self.exp
        t0 = time.perf_counter()
        metrics = evaluate(exp.slot, exp.eval_data, exp.task, state, exp.cfg.evaluation.batch_size)
        seconds = time.perf_counter() - t0
        return {
            "round": 0, "clients": [], "num_samples": [], "train_loss": None, "client_losses": [], "eval": metrics,
            "bytes_down": [], "bytes_up": [], "client_seconds": [], "cum_bytes_down": 0, "cum_bytes_up": 0,
            "cum_wall_seconds": 0.0,
            "trainable_params": exp.trainable_params, "client_flops_per_step": None, "method": {},
            "time": {"client_compute": 0.0, "train_steps": 0.0, "codec": 0.0, "aggregation": 0.0,
                     "evaluation": seconds, "round": seconds},
        }

    def run(self, resume: bool = False, on_round: Callable[[dict[str, Any]], None] | None = None
            ) -> list[dict[str, Any]]:
        exp, cfg = self.exp, self.exp.cfg
        global_state = exp.initial_state
        start = 1
        totals = {"bytes_down": 0, "bytes_up": 0, "wall_seconds": 0.0}
        ckpt = self.recorder.resume(cfg, exp.initial_state) if resume else None
        if resume and ckpt is None:
            self.console.print("no checkpoint was written before the run stopped: restarting from round 1")
        if ckpt is not None:
            global_state = ckpt["global_state"]
            exp.algorithm.load_state_dict(ckpt["algorithm"])
            if exp.privacy is not None:
                exp.privacy.load_state_dict(ckpt["privacy"])
            totals = dict(ckpt["totals"])
            self.flops_per_step = ckpt.get("client_flops_per_step")
            start = int(ckpt["round"]) + 1
        else:
            if resume:
                self.recorder.begin(cfg)
            else:
                self.recorder.start(cfg)
            self.recorder.write_partition(partition_summary(exp))
            if cfg.evaluation.at_start:
                self.recorder.append(self._initial_record(global_state))
        fingerprint = resume_fingerprint(cfg)

        progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=self.console, disable=not cfg.output.progress)
        with progress:
            bar = progress.add_task("rounds", total=cfg.rounds, completed=start - 1)
            for round_idx in range(start, cfg.rounds + 1):
                global_state, record = self.run_round(round_idx, global_state, start)
                totals["bytes_down"] += sum(record["bytes_down"])
                totals["bytes_up"] += sum(record["bytes_up"])
                totals["wall_seconds"] += record["time"]["round"]
                record["cum_bytes_down"] = totals["bytes_down"]
                record["cum_bytes_up"] = totals["bytes_up"]
                record["cum_wall_seconds"] = totals["wall_seconds"]
                totals["simulated_seconds"] = totals.get("simulated_seconds", 0.0) + record["time"]["simulated"]
                record["time"]["cum_simulated"] = totals["simulated_seconds"]
                self.recorder.append(record)
                if round_idx % cfg.output.checkpoint_every == 0 or round_idx == cfg.rounds:
                    t0 = time.perf_counter()
                    self.recorder.save_checkpoint({
                        "round": round_idx,
                        "global_state": global_state,
                        "algorithm": exp.algorithm.state_dict(),
                        "totals": totals,
                        "client_flops_per_step": self.flops_per_step,
                        "fingerprint": fingerprint,
                        **({"privacy": exp.privacy.state_dict()} if exp.privacy is not None else {}),
                    })
                    self.checkpoint_seconds += time.perf_counter() - t0
                metric = record["eval"].get(exp.task.primary_metric)
                shown = f" {exp.task.primary_metric}={metric:.4f}" if metric is not None else ""
                progress.update(bar, advance=1, description=f"round {round_idx} loss={record['train_loss']:.4f}{shown}")
                if on_round is not None:
                    on_round(record)
        self.final_state = global_state
        return self.recorder.records

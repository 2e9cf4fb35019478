"""The round loop every engine shares: select, configure, execute (by a transport), validate,
aggregate, evaluate, record, checkpoint, resume.

A round: the method selects clients and configures their tasks; each task's payload is encoded
with the down codec (bytes counted) into a :class:`WireTask`; the transport runs the tasks where
the clients live and returns, in task order, replies whose updates are up-codec messages (bytes
counted); the server decodes and validates each reply (bad ones are logged and skipped), the
method aggregates the valid ones in task order; the global state is evaluated every
``evaluation.every`` rounds; the round is recorded and checkpointed. Only the transport differs
between the local, torchrun and Flower engines, so they give the same results for the same seeds.

A reply whose simulated round time (:func:`~fedpeft.federated.timing.client_round_seconds`)
exceeds ``client.timeout_seconds`` is dropped as late. With ``client.dp`` the round's ``privacy``
record is built from what the clients report in their replies' metrics
(:func:`~fedpeft.federated.privacy.privacy_record`); their accountants are device-side state.
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

from fedpeft.data.partition import describe_partition
from fedpeft.engines.protocol import ClientFailure, Transport, WireReply, WireTask
from fedpeft.experiment import Experiment, evaluate, evaluate_splits
from fedpeft.federated.codec import CodecError
from fedpeft.federated.privacy import privacy_record
from fedpeft.federated.timing import client_round_seconds, simulate_round
from fedpeft.federated.types import ClientResult, ClientTask, State
from fedpeft.federated.validation import RoundFailed, check_update, expected_upload_shapes
from fedpeft.metrics.recorder import Recorder, resume_fingerprint
from fedpeft.seeding import rng_for


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


def split_sizes(exp: Experiment, scored: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The validation metrics (when scored) and how many examples each scored split holds: every
    interval over a metric needs its sample size."""
    sizes = {"eval": len(exp.task.eval), "validation": len(exp.task.validation)}
    out: dict[str, Any] = {f"{split}_examples": sizes[split] for split in scored}
    if "validation" in scored:
        out["validation"] = scored["validation"]
    return out


def partition_summary(exp: Experiment) -> dict[str, Any]:
    """Shard sizes and label (class) histograms, for reports (no examples, only counts)."""
    labels = [ex.label for ex in exp.task.train]
    return {"label_names": list(exp.task.class_names),
            "clients": describe_partition(exp.shards, labels, exp.task.class_names)}


def encode_task(exp: Experiment, task: ClientTask, round_idx: int, count_flops: bool) -> WireTask:
    """The server's half of the down link: the payload becomes the down codec's message."""
    return WireTask(
        client_id=int(task.client_id), round_idx=round_idx, message=exp.down_codec.encode(task.payload),
        train_keys=None if task.train_keys is None else sorted(task.train_keys),
        upload_keys=None if task.upload_keys is None else sorted(task.upload_keys),
        config=dict(task.config), count_flops=count_flops,
    )


def decode_reply(exp: Experiment, wire: WireTask, reply: WireReply) -> ClientRun:
    """The server's half of the up link (raises :class:`CodecError` on an undecodable message)."""
    update = exp.up_codec.decode(reply.message)
    result = ClientResult(client_id=reply.client_id, update=update, num_samples=reply.num_samples,
                          train_loss=reply.train_loss, metrics=dict(reply.metrics))
    return ClientRun(result, len(wire.message), len(reply.message), reply.codec_seconds, reply.compute_seconds,
                     reply.step_seconds, reply.flops_per_step)


class RoundEngine:
    """Runs ``cfg.rounds`` rounds of ``exp`` through ``transport``, recording to ``run_dir``."""

    def __init__(self, exp: Experiment, run_dir: Path, transport: Transport, console: Console | None = None) -> None:
        self.exp = exp
        self.transport = transport
        self.recorder = Recorder(run_dir)
        exp.algorithm.attach_run_dir(run_dir)
        self.console = console or Console()
        self.flops_per_step: int | None = None
        self.checkpoint_seconds = 0.0

    def _count_flops(self) -> bool:
        """Whether the round's first task counts its FLOPs (``first_round``: until one count succeeded).

        A resumed run keeps the checkpoint's count: re-measuring on other batches (Poisson-sampled
        under DP, other padding) would make its metrics differ from an uninterrupted run's.
        """
        mode = self.exp.cfg.engine.measure_flops
        return mode == "every_round" or (mode == "first_round" and self.flops_per_step is None)

    def _late(self, wire: WireTask, reply: WireReply) -> str | None:
        """Why the reply missed ``client.timeout_seconds`` in the time model (None: on time)."""
        cfg = self.exp.cfg
        deadline = cfg.client.timeout_seconds
        if deadline is None:
            return None
        seconds = client_round_seconds(cfg.network, cfg.seed, wire.round_idx, wire.client_id, len(wire.message),
                                       len(reply.message), reply.compute_seconds)["total"]
        if seconds <= deadline:
            return None
        return f"simulated round time {seconds:.3g} s exceeds client.timeout_seconds = {deadline} s"

    def _collect(self, tasks: Sequence[ClientTask], wires: Sequence[WireTask], global_state: State
                 ) -> tuple[list[ClientRun], list[dict[str, Any]], dict[int, dict[str, float]]]:
        """Execute the wire tasks; decode and validate the replies; a bad, late or missing one is logged
        and skipped. Also returns the metrics of every reply that arrived, valid or not (privacy reports)."""
        exp, cfg = self.exp, self.exp.cfg
        outcomes = self.transport.train(wires[0].round_idx, wires) if wires else []
        if len(outcomes) != len(wires):
            raise RuntimeError(f"the transport returned {len(outcomes)} outcomes for {len(wires)} tasks")
        runs: list[ClientRun] = []
        failures: list[dict[str, Any]] = []
        reported: dict[int, dict[str, float]] = {}
        for task, wire, outcome in zip(tasks, wires, outcomes):
            cid = wire.client_id
            if isinstance(outcome, ClientFailure):
                failures.append(outcome.record())
                if outcome.stage in ("raised", "unreachable"):
                    self.console.print(f"[yellow]client {cid} failed in round {wire.round_idx}:[/] {outcome.reason}")
                continue
            if outcome.client_id != cid:
                failures.append({"client": cid, "stage": "rejected",
                                 "reason": f"reply names client {outcome.client_id}"})
                continue
            reported[cid] = dict(outcome.metrics)
            late = self._late(wire, outcome)
            if late is not None:
                failures.append({"client": cid, "stage": "timeout", "reason": late})
                continue
            t0 = time.perf_counter()
            try:
                run = decode_reply(exp, wire, outcome)
            except CodecError as err:
                failures.append({"client": cid, "stage": "rejected", "reason": f"undecodable message: {err}"})
                continue
            run.codec_seconds += time.perf_counter() - t0
            expected = {**expected_upload_shapes(task, global_state, exp.slot.trainable),
                        **exp.algorithm.extra_upload_shapes(task)}
            reason = check_update(run.result, expected, run.bytes_up, cfg.strategy.max_update_bytes)
            if reason is not None:
                failures.append({"client": cid, "stage": "rejected", "reason": reason})
                continue
            runs.append(run)
        return runs, failures, reported

    def run_round(self, round_idx: int, global_state: State) -> tuple[State, dict[str, Any]]:
        exp, cfg = self.exp, self.exp.cfg
        t_round = time.perf_counter()
        clients = exp.algorithm.select(round_idx, rng_for(cfg.seed, "select", round_idx))
        tasks = exp.algorithm.configure_train(round_idx, clients, global_state)
        count_flops = self._count_flops()
        t0 = time.perf_counter()
        wires = [encode_task(exp, task, round_idx, count_flops and i == 0) for i, task in enumerate(tasks)]
        encode_seconds = (time.perf_counter() - t0) / max(len(wires), 1)
        runs, failures, reported = self._collect(tasks, wires, global_state)
        if len(runs) < cfg.strategy.min_clients:
            reasons = "; ".join(f"client {f['client']}: {f['reason']}" for f in failures)
            raise RoundFailed(f"round {round_idx}: {len(runs)} valid replies, strategy.min_clients is "
                              f"{cfg.strategy.min_clients} ({reasons})")
        for run in runs:
            run.codec_seconds += encode_seconds
        selected = [int(c) for c in clients]
        clients = [r.result.client_id for r in runs]
        results = [r.result for r in runs]

        t0 = time.perf_counter()
        new_state = exp.algorithm.aggregate(round_idx, global_state, results)
        aggregation_seconds = time.perf_counter() - t0

        scored: dict[str, dict[str, float]] = {}
        t0 = time.perf_counter()
        if round_idx % cfg.evaluation.every == 0 or round_idx == cfg.rounds:
            scored = evaluate_splits(exp, new_state)
        eval_metrics = scored.get("eval", {})
        client_eval = {}
        if cfg.evaluation.per_client:
            measured = self.transport.evaluate_clients(round_idx, new_state, clients)
            client_eval = {str(c): measured[c] for c in clients if c in measured}
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
        record.update(split_sizes(exp, scored))
        server_privacy = exp.algorithm.strategy.server_privacy(round_idx, cfg.clients_per_round(),
                                                               cfg.partition.num_clients)
        if server_privacy is not None:  # DP-FedAdam: the client-level guarantee after this round
            record["server_privacy"] = server_privacy
        if client_eval:
            record["client_eval"] = client_eval
        if failures:
            record["failures"] = failures
        record["time"].update(simulate_round(cfg.network, cfg.seed, round_idx, clients, record["bytes_down"],
                                             record["bytes_up"], [r.compute_seconds for r in runs]))
        if cfg.client.timeout_seconds is not None and any(f["stage"] == "timeout" for f in failures):
            # the server waited until the deadline
            record["time"]["simulated"] = max(record["time"]["simulated"], cfg.client.timeout_seconds)
        if cfg.client.dp is not None:
            previous = next((r["privacy"]["max_epsilon"] for r in reversed(self.recorder.records) if "privacy" in r),
                            0.0)
            record["privacy"] = privacy_record(cfg.client.dp, reported, previous)
        record["time"]["round"] = time.perf_counter() - t_round
        return new_state, record

    def _initial_record(self, state: State) -> dict[str, Any]:
        """Round 0: the global model before any training (no clients, no bytes)."""
        exp = self.exp
        t0 = time.perf_counter()
        scored = evaluate_splits(exp, state)
        seconds = time.perf_counter() - t0
        return {
            "round": 0, "clients": [], "num_samples": [], "train_loss": None, "client_losses": [],
            "eval": scored.get("eval", {}), **split_sizes(exp, scored),
            "bytes_down": [], "bytes_up": [], "client_seconds": [], "cum_bytes_down": 0, "cum_bytes_up": 0,
            "cum_wall_seconds": 0.0,
            "trainable_params": exp.trainable_params, "client_flops_per_step": None, "method": {},
            "time": {"client_compute": 0.0, "train_steps": 0.0, "codec": 0.0, "aggregation": 0.0,
                     "evaluation": seconds, "round": seconds},
        }

    def run(self, resume: bool = False, on_round: Callable[[dict[str, Any]], None] | None = None
            ) -> list[dict[str, Any]]:
        """All rounds from the start (or the last checkpoint); the transport is closed at the end."""
        try:
            return self._run(resume, on_round)
        finally:
            self.transport.close()

    def _run(self, resume: bool, on_round: Callable[[dict[str, Any]], None] | None) -> list[dict[str, Any]]:
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
                exp.privacy.load_state_dict(ckpt.get("privacy", {}))
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
                global_state, record = self.run_round(round_idx, global_state)
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


def evaluate_on_shards(exp: Experiment, state: State, clients: Sequence[int]) -> dict[int, dict[str, float]]:
    """Per-client evaluation where the server process holds every shard (local and torchrun engines)."""
    cfg = exp.cfg
    return {int(c): evaluate(exp.slot, exp.train_data, exp.task, state, cfg.evaluation.batch_size, exp.shards[c])
            for c in clients}

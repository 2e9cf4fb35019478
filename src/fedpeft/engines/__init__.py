"""Engines run rounds: one shared loop (:mod:`.rounds`), one transport per engine.

``local`` (:mod:`.local`): every client in this process. ``torchrun`` (:mod:`.torchrun`): ranks
share each round's clients. ``flower`` (:mod:`.flower`): a Flower ServerApp and ClientApp over a
SuperLink and SuperNodes (:mod:`.deploy` starts them). :func:`run_and_report` drives any of them
with the same console output and run-directory summary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:  # the engines' modules import torch; a Flower query handler needs none of it
    from fedpeft.engines.rounds import RoundEngine


def run_and_report(engine: RoundEngine, console: Console, resume: bool = False, plot: bool = False) -> None:
    """Run every round with a line per round, then write ``summary.json`` (and ``metric.png``)."""
    from fedpeft.engines.rounds import partition_summary
    from fedpeft.metrics.summary import (
        CLASSIFIED,
        human_bytes,
        label_skew,
        majority_rate,
        not_learned,
        plot_metric,
        rounds_table,
        summarize,
    )
    from fedpeft.metrics.task_metrics import constant_score
    from fedpeft.models.pooling import pooling_applies

    exp, cfg = engine.exp, engine.exp.cfg
    run_dir = engine.recorder.run_dir
    pooling = exp.backbone.pooling  # model.pooling with auto resolved: say what the classifier reads
    pooled = (f", classifier reads the {'mean' if pooling != 'head' else 'first token'} ({pooling})"
              if pooling_applies(exp.backbone.architecture, exp.backbone.head) else "")
    console.print(f"[bold]{cfg.method}[/] on [bold]{exp.task.name}[/] ({cfg.engine.kind} engine): "
                  f"{len(exp.task.train)} train / {len(exp.task.eval)} eval examples, {cfg.partition.num_clients} "
                  f"clients ({cfg.clients_per_round()} per round), {exp.trainable_params:,} trainable parameters"
                  f"{pooled} -> {run_dir}")
    metric = exp.task.primary_metric

    def report(record: dict) -> None:
        value = record["eval"].get(metric)
        shown = f"  {metric} {value:.4f}" if value is not None else ""
        failed = f"  {len(record['failures'])} failed" if record.get("failures") else ""
        console.print(f"round {record['round']:>3}  loss {record['train_loss']:.4f}{shown}  "
                      f"up {human_bytes(sum(record['bytes_up']))}  down {human_bytes(sum(record['bytes_down']))}  "
                      f"{record['time']['round']:.1f} s{failed}")

    records = engine.run(resume=resume, on_round=report)
    summary = summarize(records, metric)
    # computed_on: this process's device (local: every client; torchrun: rank 0; flower: the ServerApp's evaluation)
    classified = exp.task.problem_type in CLASSIFIED
    majority = majority_rate(exp.eval_data.labels) if classified else None
    constant = constant_score(metric, exp.eval_data.labels) if classified else None
    skew = label_skew(partition_summary(exp)["clients"]) if exp.task.problem_type == "classification" else None
    summary.update(method=cfg.method, task=exp.task.name, engine=cfg.engine.kind,
                   computed_on=exp.slot.placement.describe(), pooling=pooling, majority_rate=majority,
                   not_learned=not_learned(records, metric, constant, len(exp.eval_data), skew,
                                           (cfg.clients_per_round(), cfg.partition.num_clients)))
    engine.recorder.write_summary(summary)
    console.print(rounds_table(records, metric, f"{cfg.method} on {exp.task.name}"))
    console.print(f"best {metric} {summary['best_metric']} (round {summary['best_round']}); "
                  f"run directory {run_dir}")
    if summary["not_learned"]:
        console.print(f"[yellow]not learned:[/] {summary['not_learned']}")
    if plot:
        path = plot_metric(records, metric, run_dir / "metric.png", f"{cfg.method} on {exp.task.name}")
        console.print(f"plot: {path}")

"""Command line: ``fedpeft run | recipes | data``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console

from fedpeft.config import ConfigError, load_config
from fedpeft.metrics.recorder import CheckpointError

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set partition.num_clients=20 (repeatable)")
    parser.add_argument("--data-dir", help="folder of the benchmark data (default: $FEDPEFT_DATA or ../shared/data)")


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from fedpeft.engines.local import LocalEngine
    from fedpeft.experiment import default_run_dir, prepare
    from fedpeft.metrics.recorder import Recorder, load_run_config
    from fedpeft.metrics.summary import plot_metric, rounds_table, summarize

    config_path = args.config
    if args.resume and config_path is None:
        config_path = str(Path(args.resume) / "config.yaml")
    if config_path is None:
        raise ConfigError("config", "give a CONFIG file (or --resume RUN_DIR)")
    cfg = load_config(config_path, args.overrides)
    run_dir = Path(args.resume or args.run_dir or cfg.output.run_dir or default_run_dir(cfg))
    if args.resume and not (run_dir / "config.yaml").exists():
        raise ConfigError("--resume", f"{run_dir} is not a run directory (no config.yaml)")
    if args.resume:
        load_run_config(run_dir)
    else:
        Recorder(run_dir).check_new()
    exp = prepare(cfg, args.data_dir)
    console.print(f"[bold]{cfg.method}[/] on [bold]{exp.task.name}[/]: {len(exp.task.train)} train / "
                  f"{len(exp.task.eval)} eval examples, {cfg.partition.num_clients} clients "
                  f"({cfg.clients_per_round()} per round), {exp.trainable_params:,} trainable parameters "
                  f"-> {run_dir}")
    engine = LocalEngine(exp, run_dir, console)
    records = engine.run(resume=bool(args.resume))
    metric = exp.task.primary_metric
    summary = summarize(records, metric)
    summary.update(method=cfg.method, task=exp.task.name)
    engine.recorder.write_summary(summary)
    console.print(rounds_table(records, metric, f"{cfg.method} on {exp.task.name}"))
    console.print(f"best {metric} {summary['best_metric']} (round {summary['best_round']}); "
                  f"run directory {run_dir}")
    if args.plot:
        path = plot_metric(records, metric, run_dir / "metric.png", f"{cfg.method} on {exp.task.name}")
        console.print(f"plot: {path}")
    return 0


def cmd_recipes(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from fedpeft.recipes import RECIPES

    table = Table(title="fedpeft recipes")
    table.add_column("method")
    table.add_column("what it is")
    table.add_column("from")
    for name, recipe in sorted(RECIPES.items()):
        table.add_row(name, recipe.summary, recipe.paper)
    console.print(table)
    return 0


def cmd_data(args: argparse.Namespace, console: Console) -> int:
    from fedpeft.config import apply_overrides, build_config
    from fedpeft.data.partition import describe_partition, format_partition_table
    from fedpeft.experiment import load_data

    raw = {"task": {"name": args.task}, "partition": {"kind": args.partition, "num_clients": args.num_clients}}
    if args.alpha is not None:
        raw["partition"]["alpha"] = args.alpha
    cfg = build_config(apply_overrides(raw, args.overrides))
    task, shards = load_data(cfg, args.data_dir)
    console.print(f"[bold]{task.name}[/]: {len(task.train)} train / {len(task.eval)} eval, "
                  f"{task.problem_type}, labels {list(task.label_names)}, metrics {list(task.metrics)}")
    rows = describe_partition(shards, [ex.label for ex in task.train], task.label_names)
    console.print(format_partition_table(rows, task.label_names))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedpeft", description="Federated parameter-efficient fine-tuning")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment from a YAML config",
                         description="Run federated rounds; writes RUN_DIR/{config.yaml,metrics.jsonl,checkpoint.pt}")
    run.add_argument("config", nargs="?", help="experiment YAML (optional with --resume)")
    run.add_argument("--run-dir",
                     help="where to write the run (default: output.run_dir or runs/<method>_<task>_s<seed>)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    run.add_argument("--plot", action="store_true", help="write RUN_DIR/metric.png at the end")
    _add_config_args(run)
    run.set_defaults(func=cmd_run)

    recipes = sub.add_parser("recipes", help="list the named methods", description="List the named methods")
    recipes.set_defaults(func=cmd_recipes)

    data = sub.add_parser("data", help="show a task and its partition",
                          description="Load a task and print per-client sizes and label histograms")
    data.add_argument("task", help="built-in task name (sst2, mnli, 20newsgroups, ...) or 'file'")
    data.add_argument("--partition", default="iid",
                      choices=["iid", "dirichlet", "quantity_skew", "label_proportions", "natural"])
    data.add_argument("--num-clients", type=int, default=10)
    data.add_argument("--alpha", type=float, help="Dirichlet concentration")
    _add_config_args(data)
    data.set_defaults(func=cmd_data)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        return args.func(args, console)
    except ConfigError as err:
        console.print(f"[red]config error[/] {err}")
        return 2
    except CheckpointError as err:
        console.print(f"[red]cannot resume[/] {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())

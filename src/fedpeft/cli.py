"""Command line: ``fedpeft run | tune | recipes | data | compare | report | sweep | deploy | export | predict``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedpeft.config import ConfigError, ExperimentConfig, load_config
from fedpeft.metrics.recorder import CheckpointError, ExportError

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set partition.num_clients=20 (repeatable)")
    parser.add_argument("--data-dir", help="folder of the benchmark data (default: $FEDPEFT_DATA or ../shared/data)")


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from fedpeft.engines.torchrun import process_rank
    from fedpeft.experiment import default_run_dir
    from fedpeft.metrics.recorder import Recorder, load_run_config

    config_path = args.config
    if args.resume and config_path is None:
        config_path = str(Path(args.resume) / "config.yaml")
    if config_path is None:
        raise ConfigError("config", "give a CONFIG file (or --resume RUN_DIR)")
    cfg = load_config(config_path, args.overrides)
    run_dir = Path(args.resume or args.run_dir or cfg.output.run_dir or default_run_dir(cfg))
    if process_rank() == 0:  # under torchrun only rank 0 reads and writes the run directory
        if args.resume and not (run_dir / "config.yaml").exists():
            raise ConfigError("--resume", f"{run_dir} is not a run directory (no config.yaml)")
        if args.resume:
            load_run_config(run_dir)
        else:
            Recorder(run_dir).check_new()
    run_experiment(cfg, run_dir, console, args.data_dir, bool(args.resume), args.plot)
    return 0


def run_experiment(cfg: ExperimentConfig, run_dir: Path, console: Console, data_dir: str | None, resume: bool,
                   plot: bool) -> None:
    """Prepare and run on the configured engine (local, or a rank of a torchrun job)."""
    from fedpeft.engines import run_and_report
    from fedpeft.engines.local import LocalEngine
    from fedpeft.experiment import prepare

    if cfg.engine.kind == "flower":
        raise ConfigError("engine.kind", "flower runs as a Flower app on a SuperLink: `fedpeft deploy local CONFIG` "
                                         "starts one on this machine; `fedpeft deploy app CONFIG --out DIR` then "
                                         "`flwr run DIR CONNECTION` uses yours (README: Run on several machines)")
    if cfg.engine.kind == "torchrun":
        from fedpeft.engines.rounds import RoundEngine
        from fedpeft.engines.torchrun import TorchrunTransport, check_launched, process_group, serve_until_stopped

        check_launched()
        exp = prepare(cfg, data_dir)
        with process_group(cfg, exp) as rank:
            if rank == 0:
                run_and_report(RoundEngine(exp, run_dir, TorchrunTransport(exp), console), console, resume, plot)
            else:
                serve_until_stopped(exp)
        return
    run_and_report(LocalEngine(prepare(cfg, data_dir), run_dir, console), console, resume, plot)


def cmd_recipes(args: argparse.Namespace, console: Console) -> int:
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
    from fedpeft.metrics.summary import label_skew, skew_remedy

    if Path(args.task).suffix in (".yaml", ".yml") or Path(args.task).is_file():
        cfg = load_config(args.task, args.overrides)  # the exact partition a run of this config uses
    else:
        raw = {"task": {"name": args.task}, "partition": {"kind": args.partition, "num_clients": args.num_clients}}
        if args.alpha is not None:
            raw["partition"]["alpha"] = args.alpha
        cfg = build_config(apply_overrides(raw, args.overrides))
    task, shards = load_data(cfg, args.data_dir)
    held = f" / {len(task.validation)} validation" if task.validation else ""
    console.print(f"[bold]{task.name}[/]: {len(task.train)} train / {len(task.eval)} eval{held}, "
                  f"{task.problem_type}, labels {list(task.label_names)}, metrics {list(task.metrics)}")
    partition = cfg.partition
    skew = f", alpha {partition.alpha}" if partition.kind in ("dirichlet", "quantity_skew") else ""
    seed = partition.seed if partition.seed is not None else cfg.seed
    console.print(f"partition {partition.kind}{skew}: {partition.num_clients} clients, "
                  f"{cfg.clients_per_round()} per round, seed {seed}")
    if task.class_names != task.label_names:
        console.print(f"{len(task.class_names)} partition classes (FeDeRA App. A.2): {list(task.class_names)[:8]} ...")
    rows = describe_partition(shards, [ex.label for ex in task.train], task.class_names)
    console.print(format_partition_table(rows, task.class_names))
    if task.problem_type == "classification" and (skewed := label_skew(rows)):
        taken = cfg.clients_per_round()
        console.print(f"label skew: {skewed}; a round of {taken} pulls the model toward its clients' classes; if "
                      f"a run does not learn, try {skew_remedy((taken, partition.num_clients))}")
    return 0


def _compare(run_dirs: list[str], out: str | None, target: float | None, bandwidth: str | None,
             console: Console, title: str) -> Path:
    from fedpeft.metrics.compare import Bandwidth, aggregate_seeds, default_target, load_run, mark_noise, run_row
    from fedpeft.metrics.report import TABLE_COLUMNS, build_report, table_rows

    runs = [load_run(d) for d in run_dirs]
    link = Bandwidth.parse(bandwidth) if bandwidth else None
    goal = target if target is not None else default_target(runs)
    rows = [run_row(run, goal, link) for run in runs]
    if len({r["seed"] for r in rows}) > 1:
        rows = aggregate_seeds(rows)
    mark_noise(rows)
    out_dir = Path(out) if out else (Path(run_dirs[0]) if len(run_dirs) == 1 else Path("runs/compare"))
    notes = [f"target {runs[0].metric} = {goal:.4f}" + (" (95% of the best run's best)" if target is None else "")
             if goal is not None else "no target",
             "best/final: mean ± std over seeds [95% interval: t over seeds; one seed: binomial from the eval "
             "size]; 'within noise' = its final interval overlaps the best run's",
             "bytes: lengths of the serialized messages; "
             "time: " + (f"simulated at {bandwidth} Mbps down/up plus measured client compute" if link
                         else "the runs' simulated time when they had a network model, else wall clock")]
    path = build_report(runs, rows, out_dir, title, link, notes)
    table = Table(title=title)
    for _, label in TABLE_COLUMNS:
        table.add_column(label, justify="right")
    for cells in table_rows(rows):
        table.add_row(*cells)
    console.print(table)
    (out_dir / "compare.json").write_text(json.dumps(rows, indent=2, default=str))
    console.print(f"report: {path}")
    return path


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    _compare(args.run_dirs, args.out, args.target_accuracy, args.bandwidth, console, "fedpeft comparison")
    return 0


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    _compare([args.run_dir], args.out, args.target_accuracy, args.bandwidth, console,
             f"fedpeft run {Path(args.run_dir).name}")
    return 0


def _check_device(device: str) -> None:
    """``--device`` refused before anything runs, as ``engine.device`` would refuse it in every run."""
    from pydantic import ValidationError

    from fedpeft.config import EngineConfig, _format_validation_error

    try:
        EngineConfig(device=device)
    except ValidationError as err:
        problem = _format_validation_error(err)  # the message `engine.device` gives, under the flag's name
        raise ConfigError("--device", str(problem).removeprefix(f"{problem.field}: ")) from None


def cmd_sweep(args: argparse.Namespace, console: Console) -> int:
    from fedpeft.sweep import load_sweep, parse_only, restrict, run_sweep

    only = parse_only(args.only)
    if args.device is not None:
        _check_device(args.device)
    if args.rejudge:
        unused = [flag for flag, value in (("--only", args.only), ("--workers", args.workers != 1),
                                           ("--device", args.device), ("--data-dir", args.data_dir),
                                           ("--allow-fewer-runs", args.allow_fewer_runs)) if value]
        if unused:
            raise ConfigError("--rejudge", f"runs nothing, so {', '.join(unused)} would do nothing")
        sweep = load_sweep(Path(args.sweep))
        if not sweep.is_benchmark:
            raise ConfigError("--rejudge", f"{args.sweep} is not a benchmark (no results_dir:): it has no claims")
        from fedpeft.metrics.results import rejudge_results

        for path in rejudge_results(sweep).values():
            console.print(f"wrote {path}")
        return 0
    if args.report_only:
        sweep = load_sweep(Path(args.sweep))
        restrict(sweep, only)  # a misspelt --only fails here too
        from fedpeft.records import bring_back

        bring_back(sweep, console.print)  # a stale tune on disk would be reported (and recorded) as the file's
    else:
        sweep = run_sweep(Path(args.sweep), workers=args.workers, data_dir=args.data_dir, say=console.print,
                          only=only, device=args.device, allow_fewer=args.allow_fewer_runs)
    if sweep.is_benchmark:
        from fedpeft.metrics.results import write_results

        command = " ".join(["fedpeft sweep", args.sweep, *(["--workers", str(args.workers)] if args.workers > 1
                                                           else []), *(f"--only {item}" for item in args.only),
                            *(["--device", args.device] if args.device else [])])
        for path in write_results(sweep, command, allow_fewer=args.allow_fewer_runs).values():
            console.print(f"wrote {path}")
        return 0
    dirs = [str(run.run_dir) for run in sweep.runs if (run.run_dir / "metrics.jsonl").exists()]
    if not dirs:
        console.print("[red]no run finished[/]; see the logs in " + str(sweep.out_dir / "logs"))
        return 1
    _compare(dirs, str(sweep.out_dir), args.target_accuracy, args.bandwidth, console,
             f"fedpeft sweep {Path(args.sweep).name}")
    return 0


def _seed_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_tune(args: argparse.Namespace, console: Console) -> int:
    from fedpeft.config import load_raw
    from fedpeft.tune import load_space, tune

    raw = load_raw(args.config, args.overrides)
    out = Path(args.out) if args.out else Path("runs") / f"tune_{Path(args.config).stem}"
    space = load_space(args.space) if args.space else None
    tune(raw, out, args.trials, seed=args.seed, space=space, pruner=args.pruner, rounds=args.rounds,
         validation_fraction=args.validation_fraction, prune_after=args.prune_after,
         include_defaults=args.include_defaults, grid=args.grid, seeds=args.seeds, score_rounds=args.score_rounds,
         data_dir=args.data_dir, console=console)
    console.print(f"next: fedpeft run {out / 'best.yaml'}")
    return 0


def cmd_deploy_app(args: argparse.Namespace, console: Console) -> int:
    from fedpeft.engines.deploy import write_app
    from fedpeft.experiment import default_run_dir

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir or cfg.output.run_dir or default_run_dir(cfg))
    out = write_app(cfg, Path(args.out), run_dir, args.data_dir, args.resume)
    console.print(f"Flower app in {out}: `flwr run {out} CONNECTION --stream` writes the run to {run_dir.resolve()} "
                  "on the SuperLink's machine")
    return 0


def cmd_deploy_certs(args: argparse.Namespace, console: Console) -> int:
    from fedpeft.engines.deploy import write_certificates

    hosts = tuple(args.host or ("127.0.0.1", "localhost"))
    certs = write_certificates(Path(args.out), hosts, args.days)
    console.print(f"CA {certs.ca} (to every SuperNode and to flwr), SuperLink certificate {certs.server_cert} and key "
                  f"{certs.server_key} (stay on the SuperLink), valid for {', '.join(hosts)}")
    return 0


def cmd_deploy_keys(args: argparse.Namespace, console: Console) -> int:
    from fedpeft.engines.deploy import write_node_keys

    for private, public in write_node_keys(Path(args.out), args.nodes):
        console.print(f"{private} (stays on its SuperNode)  {public} (`flwr supernode register {public} CONNECTION`)")
    return 0


def cmd_deploy_local(args: argparse.Namespace, console: Console) -> int:
    import tempfile
    import time

    from fedpeft.engines.deploy import LocalDeployment, write_app
    from fedpeft.experiment import default_run_dir

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir or cfg.output.run_dir or default_run_dir(cfg))
    with tempfile.TemporaryDirectory(prefix="fedpeft-flower-") as scratch:
        work = Path(args.work_dir or scratch)
        app = write_app(cfg, work / "app", run_dir, args.data_dir, args.resume)
        with LocalDeployment(work / "deployment", args.nodes, tls=args.tls, auth=args.auth,
                             data_dir=args.data_dir) as deployment:
            security = (" with TLS" if deployment.certs else "") + (" and node authentication" if args.auth else "")
            console.print(f"SuperLink on 127.0.0.1:{deployment.port}, {args.nodes} SuperNodes{security}; "
                          f"logs in {deployment.work_dir}")
            started = time.time()
            status = deployment.start_run(app).wait()
    summary = run_dir / "summary.json"
    if status == 0 and not (summary.exists() and summary.stat().st_mtime >= started):
        console.print(f"[red]the ServerApp did not finish the run[/] (no new {summary}); see the log above")
        return 1
    return status


def _add_deploy_parser(sub: argparse._SubParsersAction) -> None:
    deploy = sub.add_parser("deploy", help="run on Flower's Deployment Engine (SuperLink + SuperNodes)",
                            description="Flower deployment: app folder, certificates, node keys, or a loopback run")
    steps = deploy.add_subparsers(dest="step", required=True)

    app = steps.add_parser("app", help="write the Flower app folder for `flwr run`",
                           description="Write a Flower app (pyproject.toml) that runs CONFIG with the flower engine")
    app.add_argument("config", help="experiment YAML")
    app.add_argument("--out", required=True, help="app folder (letters, digits, hyphens)")
    app.add_argument("--run-dir", help="run directory on the SuperLink's machine (default: output.run_dir or runs/...)")
    app.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its checkpoint")
    _add_config_args(app)
    app.set_defaults(func=cmd_deploy_app)

    certs = steps.add_parser("certs", help="self-signed CA and SuperLink TLS certificate",
                             description="Write ca.crt, server.pem and server.key (EC P-384, SHA-384)")
    certs.add_argument("--out", required=True)
    certs.add_argument("--host", action="append", default=None,
                       help="IP or DNS name the SuperNodes use to reach the SuperLink (repeatable)")
    certs.add_argument("--days", type=int, default=365)
    certs.set_defaults(func=cmd_deploy_certs)

    keys = steps.add_parser("keys", help="SuperNode authentication key pairs",
                            description="Write nodeI / nodeI.pub (EC P-384, OpenSSH format) for each SuperNode")
    keys.add_argument("--out", required=True)
    keys.add_argument("--nodes", type=int, required=True)
    keys.set_defaults(func=cmd_deploy_keys)

    local = steps.add_parser("local", help="SuperLink + N SuperNodes on 127.0.0.1, run CONFIG, stop them",
                             description="Start a loopback deployment (free ports), `flwr run` CONFIG on it, stop it")
    local.add_argument("config", help="experiment YAML")
    local.add_argument("--nodes", type=int, default=2, help="SuperNodes (partition-id 0..N-1, num-partitions N)")
    local.add_argument("--tls", action="store_true", help="self-signed certificates for every connection")
    local.add_argument("--auth", action="store_true", help="SuperNode authentication (implies --tls)")
    local.add_argument("--run-dir", help="run directory (default: output.run_dir or runs/...)")
    local.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its checkpoint")
    local.add_argument("--work-dir", help="keep the app, certificates, keys and logs here (default: a temp folder)")
    _add_config_args(local)
    local.set_defaults(func=cmd_deploy_local)


def cmd_export(args: argparse.Namespace, console: Console) -> int:
    from fedpeft.export import check_hub_available, export_run, pooling_note, push_to_hub

    if args.push_to_hub:
        check_hub_available()  # before the export's work, not after it
    out = export_run(Path(args.run_dir), Path(args.out), args.format, args.data_dir)
    console.print(f"{args.format} export of {args.run_dir} in {out}")
    note = pooling_note(out)
    if note:
        console.print(f"note: {escape(note)}")
    if args.push_to_hub:
        console.print(f"pushed to {push_to_hub(out, args.push_to_hub)}")
    return 0


def cmd_predict(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fedpeft.export import load
    from fedpeft.predict import output_format, predict_rows, read_input, write_predictions

    output = Path(args.output) if args.output else None
    output_format(output)  # a bad extension fails before the model loads
    loaded = load(args.model, args.data_dir)
    batch = read_input(loaded, Path(args.input), args.text_column)
    batch_size = args.batch_size or loaded.cfg.evaluation.batch_size
    progress = Progress(TextColumn("[bold]predict"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)
    with progress:
        bar = progress.add_task("predict", total=len(batch))
        table = predict_rows(loaded, batch, batch_size, lambda done, _: progress.update(bar, completed=done))
    write_predictions(table, output)
    if output is not None:
        console.print(f"{len(table)} predictions in {output}")
    return 0


def _add_use_parsers(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="write a run's model as a PEFT adapter, a merged model or a bundle",
                            description="Export RUN_DIR's model: peft (PeftModel.from_pretrained loads it), merged "
                                        "(AutoModelFor<Task>.from_pretrained loads it) or bundle (fedpeft.load)")
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--out", required=True, help="the export folder")
    export.add_argument("--format", default="peft", help="peft (default), merged or bundle")
    export.add_argument("--push-to-hub", metavar="REPO", help="upload the export to this Hugging Face hub repository")
    export.add_argument("--data-dir", help="folder of the benchmark data (the run's labels come from its data)")
    export.set_defaults(func=cmd_export)

    predict = sub.add_parser("predict", help="predict the rows of a data file with a run or an export",
                             description="Predict every row of a CSV/TSV/JSON/JSONL/Parquet file; writes the text "
                                         "columns with the predicted label and probability, value, text, entity "
                                         "spans (token classification) or answer span (extractive QA)")
    predict.add_argument("model", metavar="RUN_DIR_OR_EXPORT")
    predict.add_argument("--input", required=True, help="the data file")
    predict.add_argument("--output", help="CSV, TSV or JSONL file, by extension (default: CSV on stdout)")
    predict.add_argument("--text-column", action="append", default=[],
                         help="input text column (repeatable: joined; default: the run's task.text_columns); "
                              "token classification: one column of words or text (default: tokens, words, text); "
                              "extractive QA: question, then context (default: question, context)")
    predict.add_argument("--batch-size", type=int, help="input rows per batch (default: evaluation.batch_size)")
    predict.add_argument("--data-dir", help="folder of the benchmark data (a run's labels come from its data)")
    predict.set_defaults(func=cmd_predict)


def _add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target-accuracy", type=float,
                        help="metric value to reach (default: 95%% of the best value any run reached)")
    parser.add_argument("--bandwidth", metavar="DOWN/UP",
                        help="link speeds in Mbps, e.g. 10/1: time to target is simulated from the real bytes")
    parser.add_argument("--out", help="folder for report.html, figures and compare.json")


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
                          description="Load a task and print per-client sizes and label histograms; given an "
                                      "experiment YAML, the exact partition its run will use")
    data.add_argument("task", metavar="TASK_OR_CONFIG",
                      help="an experiment YAML, or a built-in task name (sst2, mnli, 20newsgroups, ...) or 'file'")
    data.add_argument("--partition", default="iid", help="with a task name: the partition kind",
                      choices=["iid", "dirichlet", "quantity_skew", "label_proportions", "natural", "centralized"])
    data.add_argument("--num-clients", type=int, default=10, help="with a task name: clients")
    data.add_argument("--alpha", type=float, help="with a task name: Dirichlet concentration")
    _add_config_args(data)
    data.set_defaults(func=cmd_data)

    compare = sub.add_parser("compare", help="put finished runs side by side: table + report.html",
                             description="Compare runs: table, report.html, PNG/SVG figures, compare.json")
    compare.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    _add_report_args(compare)
    compare.set_defaults(func=cmd_compare)

    report = sub.add_parser("report", help="report.html for one run", description="The report page for one run")
    report.add_argument("run_dir", metavar="RUN_DIR")
    _add_report_args(report)
    report.set_defaults(func=cmd_report)

    tune = sub.add_parser("tune", help="search a config's learning rates on a validation split",
                          description="Federated hyperparameter search (Optuna TPE + pruning) on a validation split "
                                      "carved from the training data; writes best.yaml, trials.csv, trials.png")
    tune.add_argument("config", help="experiment YAML")
    tune.add_argument("--trials", type=int, default=8, help="trials in the study (a resumed tune counts the done ones)")
    tune.add_argument("--out", help="tune directory (default: runs/tune_<config name>); rerun to resume")
    tune.add_argument("--space", help="search-space YAML (dotted.key: {low, high, log} or {choices: [...]}); "
                                      "default: the recipe's")
    tune.add_argument("--seed", type=int, default=0, help="sampler seed (same seed, same trials)")
    tune.add_argument("--pruner", choices=["median", "halving", "none"], default="median",
                      help="stop bad trials early on the round-by-round validation metric")
    tune.add_argument("--rounds", type=int, help="rounds per trial (default: the config's)")
    tune.add_argument("--prune-after", type=int,
                      help="first round at which the pruner may stop a trial (default: half the rounds)")
    tune.add_argument("--validation-fraction", type=float,
                      help="validation split carved from training (default: the config's, else 0.1)")
    tune.add_argument("--include-defaults", action=argparse.BooleanOptionalAction, default=True,
                      help="spend trial 0 on the config's own values, so the tune never picks one that scored "
                           "below them (default: on)")
    tune.add_argument("--grid", action="store_true",
                      help="try every combination of a --space of choices once (in a seeded order), as a paper's "
                           "'picked from these values'; --trials must cover the grid")
    tune.add_argument("--seeds", type=_seed_list,
                      help="comma-separated seeds: run every trial once per seed (its own partition and split) and "
                           "score the mean, so an lr that is unstable on some partitions is seen (default: the "
                           "config's seed alone)")
    tune.add_argument("--score-rounds", type=int, default=1,
                      help="score a trial by the mean of its last K rounds' validation values, not the last round "
                           "alone (default: 1)")
    _add_config_args(tune)
    tune.set_defaults(func=cmd_tune)

    sweep = sub.add_parser("sweep", help="run a grid or a benchmark (tune, seeds, ceiling, claims)",
                           description="Run methods x tasks x partitions x seeds from a sweep YAML (tuning each "
                                       "method on the same budget first when it has a tune: block), then compare, "
                                       "or, for a benchmark (results_dir:), write its results JSON/markdown/figures "
                                       "with a verdict per claim")
    sweep.add_argument("sweep", metavar="SWEEP.yaml")
    sweep.add_argument("--workers", type=int, default=1, help="tunes/runs at a time (subprocesses)")
    sweep.add_argument("--data-dir", help="folder of the benchmark data")
    sweep.add_argument("--device", help="engine.device of every tune and run started (e.g. cuda): a benchmark on a GPU "
                                        "without editing its file")
    what = sweep.add_mutually_exclusive_group()
    what.add_argument("--report-only", action="store_true",
                      help="run nothing: write the results of the runs that finished, here or in the committed "
                           "records (the rest listed as not run)")
    what.add_argument("--rejudge", action="store_true",
                      help="run nothing and read no runs: judge the committed results file's claims again under "
                           "the sweep file's claims (and take its notes again), from the results file alone")
    sweep.add_argument("--only", action="append", default=[], metavar="KEY=V1,V2",
                       help="run only these cells (KEY: task, method, partition or seed; repeatable): a large "
                            "benchmark one part at a time; the results cover every run finished so far")
    sweep.add_argument("--allow-fewer-runs", action="store_true",
                       help="write a benchmark's results even where the committed ones report runs that are not "
                            "finished here (no run folder, no record): they drop out of the results")
    _add_report_args(sweep)
    sweep.set_defaults(func=cmd_sweep)
    _add_deploy_parser(sub)
    _add_use_parsers(sub)
    return parser


DATA_ON_STDOUT = ("export", "predict")
"""Commands whose stdout may carry data (predictions): their messages and errors go to stderr."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in DATA_ON_STDOUT:
        console = Console(stderr=True, soft_wrap=True)  # an error stays one line
    else:
        console = Console(width=None if sys.stdout.isatty() else 180)  # logs and pipes get the whole table
    try:
        return args.func(args, console)
    except ConfigError as err:
        console.print(f"[red]config error[/] {escape(str(err))}")  # messages quote [lists] and extras[...]
        return 2
    except CheckpointError as err:
        console.print(f"[red]cannot resume[/] {escape(str(err))}")
        return 2
    except ExportError as err:
        console.print(f"[red]error[/] {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())

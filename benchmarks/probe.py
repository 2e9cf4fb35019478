"""What a frozen backbone's features carry, read four ways: a linear probe per pooling (no training
of the backbone, no federation).

``model.pooling`` decides what an encoder's classifier reads. This measures the starting point of
each choice: a logistic regression (L2, its C chosen by 5-fold cross-validation on the training
rows alone, then refit on them) on the frozen features of the task's training subset, scored on
its eval split, for

- ``first_token``: the last layer at position 0 (what RoBERTa/MPNet-style heads read);
- ``pooler``: BERT's pooler output on it (dense + tanh pretrained for next-sentence prediction;
  what ``pooling: head`` feeds BERT's classifier, frozen under PEFT);
- ``mean``: the mean of the last layer over real tokens (sentence encoders' training pooling);
- ``pooler_of_mean``: BERT's pooler on the mean (what ``pooling: mean`` feeds BERT's classifier).

The two pooler rows exist only for a model with a pooler (BERT, hence MiniLM).

Outputs: ``benchmarks/results/probe.{json,md,png}``, each starting with its command.
Run: ``.venv/bin/python benchmarks/probe.py`` (MiniLM on 2,000 SST-2 sentences: about a minute).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.linear_model import LogisticRegressionCV
from torch import nn

from fedpeft.config import ModelConfig, build_config
from fedpeft.data.tasks import load_task, resolve_data_dir
from fedpeft.data.types import Example
from fedpeft.metrics.stats import binomial_halfwidth
from fedpeft.models.backbone import load_backbone

RESULTS = Path(__file__).resolve().parent / "results"
FEATURES = ("first_token", "pooler", "mean", "pooler_of_mean")


def encoders(model_name: str, task: Any) -> tuple[Any, nn.Module, nn.Module]:
    """The tokenizer, and the frozen encoder as the default head reads it and with mean pooling."""
    plain = load_backbone(ModelConfig(name=model_name), task, seed=0).model.base_model.eval()
    meaned = load_backbone(ModelConfig(name=model_name, pooling="mean"), task, seed=0)
    return meaned.tokenizer, plain, meaned.model.base_model.eval()


def features(tokenizer: Any, plain: nn.Module, hooked: nn.Module, examples: list[Example],
             max_length: int) -> dict[str, np.ndarray]:
    """Each pooling's frozen features of ``examples`` (rows in order)."""
    out: dict[str, list[torch.Tensor]] = {name: [] for name in FEATURES}
    with torch.no_grad():
        for start in range(0, len(examples), 64):
            texts = [example.texts for example in examples[start:start + 64]]
            batch = dict(tokenizer(*zip(*texts), padding=True, truncation=True, max_length=max_length,
                                   return_tensors="pt"))
            first, pooled = plain(**batch), hooked(**batch)
            out["first_token"].append(first.last_hidden_state[:, 0])
            out["mean"].append(pooled.last_hidden_state[:, 0])  # the hook put the mean at position 0
            if getattr(first, "pooler_output", None) is not None:
                out["pooler"].append(first.pooler_output)
                out["pooler_of_mean"].append(pooled.pooler_output)
    return {name: torch.cat(rows).numpy() for name, rows in out.items() if rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--task", default="sst2")
    parser.add_argument("--max-train-examples", type=int, default=2000)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    cfg = build_config({"task": {"name": args.task, "max_train_examples": args.max_train_examples,
                                 "max_length": args.max_length}})
    task = load_task(cfg.task, resolve_data_dir(args.data_dir))
    train_y = np.array([example.label for example in task.train])
    eval_y = np.array([example.label for example in task.eval])
    models = encoders(args.model, task)
    train_x = features(*models, task.train, args.max_length)
    eval_x = features(*models, task.eval, args.max_length)
    rows = []
    for name, x in train_x.items():
        probe = LogisticRegressionCV(Cs=[0.01, 0.1, 1.0, 10.0, 100.0], cv=5, max_iter=5000).fit(x, train_y)
        accuracy = float(probe.score(eval_x[name], eval_y))
        rows.append({"features": name, "accuracy": accuracy, "halfwidth": binomial_halfwidth(accuracy, len(eval_y)),
                     "C": float(probe.C_[0])})
        print(f"{name}: {accuracy:.3f} (C {probe.C_[0]:g})", flush=True)
    result = {
        "command": " ".join(["python benchmarks/probe.py", *(argv if argv is not None else sys.argv[1:])]),
        "benchmark": "probe",
        "machine": f"{platform.machine()} {platform.system()}, Python {platform.python_version()}, "
                   f"torch {torch.__version__}",
        "setup": (f"{args.model} frozen; {args.task}: {len(train_y)} training rows, {len(eval_y)} eval rows, "
                  f"max_length {args.max_length}. Logistic regression (L2), C from 5-fold cross-validation on "
                  "the training rows; 95% binomial interval from the eval size."),
        "majority": float(max(np.mean(eval_y == label) for label in np.unique(eval_y))),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "probe.md").write_text(markdown(result))
    plot(result, out)
    print((out / "probe.md").read_text())
    return 0


def markdown(result: dict[str, Any]) -> str:
    lines = [f"`{result['command']}`", "", "# Linear probes of frozen features, per pooling", "", result["setup"], "",
             f"Majority class: {result['majority']:.3f}.", "", "| features | accuracy | 95% interval | C |",
             "|---|---|---|---|"]
    for row in result["rows"]:
        low, high = row["accuracy"] - row["halfwidth"], row["accuracy"] + row["halfwidth"]
        lines.append(f"| `{row['features']}` | {row['accuracy']:.3f} | [{low:.3f}, {high:.3f}] | {row['C']:g} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([row["features"] for row in rows], [row["accuracy"] for row in rows],
           yerr=[row["halfwidth"] for row in rows], capsize=4, color="#4c72b0")
    ax.axhline(result["majority"], color="grey", linestyle="--", label="majority class")
    ax.set_ylim(0.4, 1.0)
    ax.set_ylabel("eval accuracy")
    ax.set_title(result["command"], fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "probe.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

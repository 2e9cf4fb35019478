"""Summaries of a finished run: best/final metric, bytes, time; a table and a PNG plot."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from fedpeft.metrics.stats import binomial_halfwidth


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def summarize(records: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    evaluated = [r for r in records if metric in r.get("eval", {})]
    best = max(evaluated, key=lambda r: r["eval"][metric]) if evaluated else None
    last = records[-1] if records else {}
    trained = [r for r in records if r["round"] > 0]
    private = [r["privacy"] for r in trained if "privacy" in r]
    dp = {"dp_epsilon": private[-1]["max_epsilon"], "dp_delta": private[-1]["delta"],
          "dp_noise_seeded": private[-1].get("noise_seeded")} if private else {}
    served = [r["server_privacy"] for r in trained if "server_privacy" in r]  # client-level (DP-FedAdam)
    if served:
        dp.update(server_dp_epsilon=served[-1]["epsilon"], server_dp_delta=served[-1]["delta"],
                  server_dp_noise_seeded=served[-1].get("noise_seeded"))
    return {
        "metric": metric,
        "rounds": len(trained),
        "best_metric": best["eval"][metric] if best else None,
        "best_round": best["round"] if best else None,
        "final_metric": evaluated[-1]["eval"][metric] if evaluated else None,
        "total_bytes_down": last.get("cum_bytes_down", 0),
        "total_bytes_up": last.get("cum_bytes_up", 0),
        "wall_seconds": last.get("cum_wall_seconds", 0.0),
        "trainable_params": last.get("trainable_params"),
        "client_flops_per_step": last.get("client_flops_per_step"),
        **dp,
    }


CLASSIFIED = ("classification", "multiple_choice")
"""The problem types whose accuracy has a majority-class level (:func:`not_learned`)."""


def majority_rate(labels: Sequence[int | float]) -> float | None:
    """The accuracy of always answering the most frequent class of ``labels`` (None: no labels)."""
    return max(Counter(labels).values()) / len(labels) if labels else None


def majority_level(majority: float, examples: int) -> float:
    """The accuracy below which a model is no better than always answering the most frequent class (its
    share ``majority``) on ``examples`` examples: that share plus the half-width of its 95% binomial interval."""
    return majority + binomial_halfwidth(majority, examples)


def learned_level(metric: str, constant: float | None, examples: int, untrained: float = 0.0) -> tuple[float, str]:
    """The score a model must beat to have learned anything, and which level it is (runs and tunes share
    this rule): ``"majority"``, for accuracy with ``constant`` (the most frequent class's share) over
    ``examples`` > 0, that share plus its 95% binomial half-width; ``"one_class"``, for any other metric on
    a classification split, ``constant`` (``task_metrics.constant_score``) where it is above
    ``untrained``; else ``"untrained"``, the untrained model's score (never below 0)."""
    if metric == "accuracy" and constant is not None and examples > 0:
        return majority_level(constant, examples), "majority"
    if constant is not None and constant > untrained:
        return constant, "one_class"
    return untrained, "untrained"


def apart(value: float, level: float, least: int = 3, most: int = 6) -> int:
    """Decimals (``least`` to ``most``) at which ``value`` and ``level`` print differently, so a score just
    above a level (0.5221 over 0.5219) does not read as the level itself."""
    digits = least
    while digits < most and f"{value:.{digits}f}" == f"{level:.{digits}f}":
        digits += 1
    return digits


SKEWED = 0.9
"""A client's shard is label-skewed when one class holds this share of it or more (:func:`label_skew`)."""


def label_skew(clients: Sequence[dict[str, Any]]) -> str | None:
    """How label-skewed a partition is (``clients`` as ``describe_partition`` gives them), when the clients
    that hold :data:`SKEWED` or more of one class hold a quarter of the training examples or more; else
    None. Under such a split a round of a few clients pulls the model toward their classes, which a
    learning rate alone often does not undo (in ``first_run_tuned`` a tune over client learning rates
    from 1e-4 to 1.6e-2 left every MPQA trial at one class; in ``first_run`` more rounds and more clients
    per round lifted some seeds to the ceiling), so :func:`not_learned` then puts those two first."""
    sized = [client for client in clients if client["size"]]
    skewed = [client for client in sized if max(client["labels"].values()) >= SKEWED * client["size"]]
    total, held = sum(c["size"] for c in sized), sum(c["size"] for c in skewed)
    if not total or held < total / 4:
        return None
    return (f"{len(skewed)} of the {len(sized)} clients hold {SKEWED:.0%} or more of one class "
            f"({held / total:.0%} of the training examples)")


ADJUSTED_LOSS = "the logit-adjusted loss with SGD clients (client.logit_adjustment: 1, client.optimizer: sgd)"
"""The first remedy on label-skewed classifier clients: on MPQA, where LoRA, FeDeRA and FedTT at their
defaults answered one class on every seed, it lifted them to 0.81-0.84 on every seed (centralised 0.849)
at no extra compute, where more clients a round or more rounds lifted some seeds at 2-4x the compute
(benchmarks/results/first_run_adjusted.md)."""


def skew_remedy(per_round: tuple[int, int] | None) -> str:
    """What to try first on label-skewed clients (:func:`label_skew`): the logit-adjusted loss, more clients
    per round, unless every client already takes part (``per_round``: clients a round, clients; None: not
    known), and more rounds."""
    if per_round is None:
        return f"{ADJUSTED_LOSS}, more clients per round (strategy.clients_per_round) and more rounds"
    taken, clients = per_round
    if taken >= clients:
        return f"{ADJUSTED_LOSS} and more rounds"
    return (f"{ADJUSTED_LOSS}, more clients per round (strategy.clients_per_round, {taken} of {clients} now) and "
            "more rounds")


def not_learned(records: list[dict[str, Any]], metric: str, constant: float | None, eval_examples: int,
                skew: str | None = None, per_round: tuple[int, int] | None = None) -> str | None:
    """Why a run has not learned and what to try, or None (it learned, or there is nothing to judge: no
    evaluation after training, or no level to judge it against).

    A first run on new data often ends no better than a model that learned nothing, and the metric alone
    does not say so (accuracy 0.56 reads like learning on a split whose majority class holds 0.56; entity
    F1 0.000 after 9 rounds reads like a hard task). The level a run must beat:

    - accuracy on a classification or multiple-choice eval split (``constant`` given: the most frequent
      class's share): always answering that class, plus the half-width of that share's 95% binomial
      interval over ``eval_examples``;
    - any other metric, or accuracy without a class to count (all of ours are higher-is-better: F1, exact
      match, ROUGE, Matthews, Pearson): the higher of the untrained model's score where round 0 was
      evaluated (``evaluation.at_start``) and, on a classification split, ``constant``, the best score of
      answering one class for every example (``task_metrics.constant_score``: MRPC's F1 0.81, a 72/28
      split's macro-F1 0.42), and never below 0, the score of a model that finds nothing right or whose
      predictions do not follow the labels. Without a band: how much such a metric moves by chance depends
      on the task, so only "no higher at all" is said.

    Two cases, with different remedies: it never rose above that level (learning rates, rounds), or it did
    and the last rounds took it back (the clients of those rounds, under label skew). ``skew`` (from
    :func:`label_skew`) says why, and puts more clients per round and more rounds before a tune;
    ``per_round`` (clients a round, clients) says how many a round there are, and leaves "more clients per
    round" out when every client already takes part."""
    evaluated = [(r["round"], r["eval"][metric]) for r in records if r["round"] > 0 and metric in r.get("eval", {})]
    if not evaluated:
        return None
    best_round, best = max(evaluated, key=lambda e: e[1])
    final = evaluated[-1][1]
    start = next((r["eval"][metric] for r in records if r["round"] == 0 and metric in r.get("eval", {})), None)
    untrained = max(start, 0.0) if start is not None else 0.0
    level, kind = learned_level(metric, constant, eval_examples, untrained)
    if final > level:
        return None
    d = apart(best, level) if best > level else 3  # a best just above the level must not print as the level
    if kind == "majority":
        share = (f"always answering the eval split's most frequent class scores {constant:.3f}, {level:.{d}f} "
                 "with its noise")
    elif kind == "one_class":
        share = f"answering one class for every eval example scores {level:.{d}f}"
    else:
        share = (f"the untrained model (round 0) scores {start:.{d}f}" if start is not None and start >= 0 else
                 "0 is what a model that has learned nothing scores")
    tune = ("`fedpeft tune CONFIG --trials 8` (a recipe's learning rates come from one short SST-2 setting; "
            "README: Tune, then run)")
    if best <= level and skew is None:
        return (f"{metric} never rose above {best:.{d}f}: {share}, so the model has not learned. Try {tune}, more "
                "rounds or local epochs, and with label-skewed clients more clients per round")
    if best <= level:
        return (f"{metric} never rose above {best:.{d}f}: {share}, so the model has not learned. {skew}: each "
                f"round's clients pull the model toward their own classes. Try {skew_remedy(per_round)} first, "
                f"then {tune}")
    because, first = (f"{skew}: each round's", f"{ADJUSTED_LOSS}, ") if skew else ("each round's", "")
    return (f"{metric} reached {best:.{d}f} at round {best_round} but ended at {final:.{d}f}: {share}, so the last "
            f"rounds undid what the model learned ({because} clients pull it toward their own labels). Try {first}more "
            "clients per round, lower learning rates (`fedpeft tune CONFIG --trials 8` scores every round) or more "
            "rounds")


def rounds_table(records: list[dict[str, Any]], metric: str, title: str) -> Table:
    table = Table(title=title)
    for column in ("round", "clients", "train loss", metric, "down/client", "up/client", "round time"):
        table.add_column(column, justify="right")
    for r in records:
        value = r["eval"].get(metric)
        n = max(len(r["clients"]), 1)
        table.add_row(
            str(r["round"]), str(len(r["clients"])), "" if r["train_loss"] is None else f"{r['train_loss']:.4f}",
            "" if value is None else f"{value:.4f}",
            human_bytes(sum(r["bytes_down"]) / n), human_bytes(sum(r["bytes_up"]) / n),
            f"{r['time']['round']:.1f} s",
        )
    return table


def plot_metric(records: list[dict[str, Any]], metric: str, path: Path, title: str) -> Path:
    """PNG of the eval metric per round (and vs cumulative uplink bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluated = [r for r in records if metric in r.get("eval", {})]
    rounds = [r["round"] for r in evaluated]
    values = [r["eval"][metric] for r in evaluated]
    uplink = [r["cum_bytes_up"] / 1e6 for r in evaluated]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot(rounds, values, marker="o")
    axes[0].set_xlabel("round")
    axes[0].set_ylabel(metric)
    axes[0].set_title(f"{title}: {metric} per round")
    axes[1].plot(uplink, values, marker="o")
    axes[1].set_xlabel("cumulative uplink (MB)")
    axes[1].set_ylabel(metric)
    axes[1].set_title("vs bytes sent by clients")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""Intervals on hand-made numbers, seed aggregation and the 'within noise' marks."""

from __future__ import annotations

import math

import pytest

from fedpeft.metrics.compare import aggregate_seeds, mark_noise
from fedpeft.metrics.stats import binomial_halfwidth, estimate, t_halfwidth


def test_t_interval_over_seeds_by_hand() -> None:
    values = [0.80, 0.82, 0.84]  # mean 0.82, sample sd 0.02, t(0.975, 2) = 4.302653
    assert t_halfwidth(values) == pytest.approx(4.302653 * 0.02 / math.sqrt(3), rel=1e-6)
    est = estimate(values, eval_examples=872)
    assert est.kind == "t" and est.seeds == 3 and est.std == pytest.approx(0.02)
    assert (est.low, est.high) == pytest.approx((0.82 - 0.049683, 0.82 + 0.049683), abs=1e-6)


def test_binomial_interval_for_one_seed_by_hand() -> None:
    # p = 0.8 on 400 examples: se = sqrt(0.16 / 400) = 0.02, z = 1.959964
    assert binomial_halfwidth(0.8, 400) == pytest.approx(1.959964 * 0.02, rel=1e-6)
    est = estimate([0.8], eval_examples=400)
    assert est.kind == "binomial" and (est.low, est.high) == pytest.approx((0.760801, 0.839199), abs=1e-6)
    assert estimate([0.5], eval_examples=None).kind == "none"
    assert estimate([0.3], eval_examples=400, fraction=False).kind == "none"  # e.g. Matthews correlation
    with pytest.raises(ValueError):
        binomial_halfwidth(0.5, 0)


def _row(method: str, seed: int, final: float, partition: str = "iid") -> dict:
    return {"run": f"{method}_seed{seed}", "task": "sst2", "partition": partition, "method": method, "seed": seed,
            "metric": "accuracy", "eval_examples": 872, "best_metric": final, "final_metric": final,
            "rounds_to_target": 3 if final > 0.8 else None, "bytes_to_target": None, "seconds_to_target": None,
            "uplink_bytes_per_client_round": 100.0, "downlink_bytes_per_client_round": 100.0, "total_bytes": 10,
            "wall_seconds": 1.0, "trainable_params": 5, "client_flops_per_step": None, "target": 0.8}


def test_aggregate_and_mark_within_noise() -> None:
    rows = [_row("a", s, v) for s, v in enumerate([0.85, 0.86, 0.87])]
    rows += [_row("b", s, v) for s, v in enumerate([0.84, 0.86, 0.85])]  # overlaps a
    rows += [_row("c", s, v) for s, v in enumerate([0.70, 0.71, 0.70])]  # far below
    merged = aggregate_seeds(rows)
    by = {r["method"]: r for r in merged}
    assert by["a"]["final_metric"] == pytest.approx(0.86) and by["a"]["final_metric_std"] == pytest.approx(0.01)
    assert by["a"]["seeds"] == [0, 1, 2] and by["a"]["interval"] == "t"
    assert by["c"]["seeds_reaching_target"] == 0 and by["a"]["seeds_reaching_target"] == 3
    mark_noise(merged)
    assert by["a"]["vs_best"] == "best" and by["b"]["vs_best"] == "within noise"
    assert by["c"]["vs_best"] == "-15.7 pts"


def test_aggregate_averages_flops_over_seeds() -> None:
    rows = [_row("a", s, 0.8) | {"client_flops_per_step": f, "client_flops_per_round": 10 * f}
            for s, f in enumerate([1e9, 2e9, 3e9])]
    (merged,) = aggregate_seeds(rows)
    assert merged["client_flops_per_step"] == pytest.approx(2e9)  # not seed 0's 1e9
    assert merged["client_flops_per_round"] == pytest.approx(2e10)
    assert merged["client_flops_per_step_std"] == pytest.approx(1e9)


def test_single_seed_rows_use_binomial_intervals_for_noise() -> None:
    from fedpeft.metrics.stats import estimate as est

    a, b = _row("a", 0, 0.80), _row("b", 0, 0.78)
    for row in (a, b):
        e = est([row["final_metric"]], 872)
        row["final_metric_ci"] = [e.low, e.high]
    mark_noise([a, b])
    assert b["vs_best"] == "within noise"  # 2 points apart on 872 examples: half-width ~2.7 points

"""A paper's claim as a check over benchmark results, judged with intervals.

A claim's ``check`` is an expression over the methods of one task/partition cell, e.g.
``fedtt.uplink <= 0.2 * lora_r8.uplink and fedtt.final >= lora_r8.final - 0.01``. A reference is
``METHOD.QUANTITY`` (``METHOD`` a method name of the benchmark), or ``METHOD["PARTITION"].QUANTITY``
/ ``METHOD["TASK", "PARTITION"].QUANTITY`` to reach another cell (``federa["iid"].final -
federa["dirichlet0.1"].final``), or ``ceiling.QUANTITY``: the task's centralised ceiling (its run over
every seed, e.g. ``lora.final >= 0.9 * ceiling.best``; in the same-seed verdict it counts at its mean,
exact, as it shares no seed's partition). Quantities: ``final``, ``best`` (the metric), ``uplink``,
``downlink`` (bytes per client and round, mean over rounds), ``last_uplink`` (a client's upload in
the last round), ``total_bytes``, ``params``, ``flops`` (client FLOPs per
step), ``round_flops`` (per client round, where the method counts one: head pruning's importance pass),
``rounds_to_target``, ``bytes_to_target``, ``time_to_target`` (simulated seconds: each round's
slowest client's download + measured compute + upload), ``comm_time_to_target`` (the same without
compute: what FLASC's Fig. 3 measures, and comparable across runs that computed on different
devices), ``wall``, or any other numeric field of a result row.

Every quantity is an interval (the 95% interval over seeds for the metric, see
:mod:`fedpeft.metrics.stats`; over seeds likewise for the others, which are often exact). The
expression is evaluated with interval arithmetic; a comparison ``L >= R`` is **confirmed** when
it holds at the pessimistic end (lower(L - R) >= 0), **refuted** when it fails even at the
optimistic end (upper(L - R) < 0), else **within noise**; ``and`` is confirmed when every part is,
refuted when any part is. A comparison that reads a missing quantity (e.g. a target never reached)
is **not reached**, and so is an ``and`` holding one, unless another of its parts is refuted (one
false part settles it); an ``or`` is confirmed by any confirmed part. A claim is also **not
reached** when its ``baseline`` ends below 90% of its centralised ceiling in the cell judged or in
any other cell the check reads (no conclusion at a budget where the baseline has not learned: two
methods both at the majority class "lose the same").

:func:`judge_paired` judges the same check seed by seed: runs with one seed share their
partition and the clients drawn each round, so each comparison's gap is taken within a seed and
judged by the 95% t interval of those gaps. Under label skew most of the spread over seeds is the
draw that every method shares, which the seeds' intervals cannot separate from the methods'
difference; a benchmark reports both verdicts.
"""

from __future__ import annotations

import ast
import operator
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedpeft.config import ConfigError
from fedpeft.metrics.stats import t_halfwidth

CONFIRMED, REFUTED, WITHIN_NOISE, NOT_REACHED = "confirmed", "refuted", "within noise", "not reached"
CEILING_FRACTION = 0.9
CEILING = "ceiling"
"""The name a check reads the centralised ceiling by; no method may take it."""

QUANTITIES = {
    "final": "final_metric", "best": "best_metric", "uplink": "uplink_bytes_per_client_round",
    "downlink": "downlink_bytes_per_client_round", "last_uplink": "last_uplink_bytes_per_client",
    "params": "trainable_params", "flops": "client_flops_per_step",
    "round_flops": "client_flops_per_round",
    "time_to_target": "seconds_to_target", "comm_time_to_target": "communication_seconds_to_target",
    "wall": "wall_seconds",
}


@dataclass(frozen=True)
class Interval:
    low: float
    mid: float
    high: float

    @classmethod
    def exact(cls, value: float) -> Interval:
        return cls(value, value, value)

    def __add__(self, other: Interval) -> Interval:
        return Interval(self.low + other.low, self.mid + other.mid, self.high + other.high)

    def __sub__(self, other: Interval) -> Interval:
        return Interval(self.low - other.high, self.mid - other.mid, self.high - other.low)

    def __mul__(self, other: Interval) -> Interval:
        ends = [a * b for a in (self.low, self.high) for b in (other.low, other.high)]
        return Interval(min(ends), self.mid * other.mid, max(ends))

    def __truediv__(self, other: Interval) -> Interval:
        if other.low <= 0 <= other.high:
            raise ZeroDivisionError("division by an interval that holds 0")
        ends = [a / b for a in (self.low, self.high) for b in (other.low, other.high)]
        return Interval(min(ends), self.mid / other.mid, max(ends))

    def __neg__(self) -> Interval:
        return Interval(-self.high, -self.mid, -self.low)


class Missing(Exception):
    """A quantity the check needs has no value (a method not run, a target never reached)."""


Lookup = Callable[[str, tuple[str, ...], str], Interval]
"""(method, (task, partition) or (partition,) or (), quantity) -> its interval."""


@dataclass
class Judgement:
    verdict: str
    values: dict[str, float]  # each reference's mean, for the report
    why: str = ""


def references(check: str) -> list[tuple[str, tuple[str, ...], str]]:
    """The (method, cell selector, quantity) triples a check reads; raises ConfigError on bad syntax."""
    tree = _parse(check)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            out.append(_reference(node, check))
    return out


def reference_cell(selector: tuple[str, ...], task: str, partition: str) -> tuple[str, str]:
    """The (task, partition) a reference with cell ``selector`` reads when its claim is judged in cell
    (``task``, ``partition``): none names the judged cell, ["P"] that task's partition P, ["T", "P"] both."""
    if len(selector) == 1:
        return task, selector[0]
    return (selector[0], selector[1]) if selector else (task, partition)


def _parse(check: str) -> ast.Expression:
    try:
        tree = ast.parse(check, mode="eval")
    except SyntaxError as err:
        raise ConfigError("claims.check", f"cannot parse {check!r}: {err.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.Compare, ast.BinOp, ast.UnaryOp,
                                 ast.USub, ast.UAdd, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Constant, ast.Name,
                                 ast.Attribute, ast.Subscript, ast.Tuple, ast.Load, ast.Gt, ast.GtE, ast.Lt,
                                 ast.LtE)):
            raise ConfigError("claims.check", f"{type(node).__name__} is not allowed in {check!r} (use METHOD."
                                              "QUANTITY, numbers, + - * /, comparisons, and/or)")
    return tree


def _reference(node: ast.Attribute, check: str) -> tuple[str, tuple[str, ...], str]:
    target = node.value
    selector: tuple[str, ...] = ()
    if isinstance(target, ast.Subscript):
        keys = target.slice.elts if isinstance(target.slice, ast.Tuple) else [target.slice]
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in keys) or len(keys) > 2:
            raise ConfigError("claims.check", f"in {check!r} a cell is [\"PARTITION\"] or [\"TASK\", \"PARTITION\"]")
        selector = tuple(k.value for k in keys)
        target = target.value
    if not isinstance(target, ast.Name):
        raise ConfigError("claims.check", f"in {check!r} a reference is METHOD.QUANTITY")
    return target.id, selector, node.attr


def _value(node: ast.AST, check: str, lookup: Lookup, values: dict[str, float]) -> Interval:
    """The interval of an arithmetic expression over references and numbers."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return Interval.exact(float(node.value))
    if isinstance(node, ast.Attribute):
        method, selector, quantity = _reference(node, check)
        interval = lookup(method, selector, quantity)
        values[ast.unparse(node)] = interval.mid
        return interval
    if isinstance(node, ast.UnaryOp):
        inner = _value(node.operand, check, lookup, values)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp):
        ops: dict[type, Callable[[Interval, Interval], Interval]] = {
            ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
        return ops[type(node.op)](_value(node.left, check, lookup, values),
                                  _value(node.right, check, lookup, values))
    raise ConfigError("claims.check", f"{ast.unparse(node)!r} is not a number or METHOD.QUANTITY in {check!r}")


def _gaps(node: ast.Compare, check: str, lookup: Lookup, values: dict[str, float]) -> list[Interval]:
    """Each comparison's gap, oriented so that it holds when the gap is positive (or zero if not strict)."""
    left, out = _value(node.left, check, lookup, values), []
    for op, right_node in zip(node.ops, node.comparators):
        right = _value(right_node, check, lookup, values)
        out.append(left - right if isinstance(op, ast.Gt | ast.GtE) else right - left)
        left = right
    return out


def _verdict(node: ast.AST, check: str, gaps: Callable[[ast.Compare], list[Interval]], missing: list[str]) -> str:
    """``missing`` collects why a comparison had no value (:class:`Missing` from ``gaps``)."""
    if isinstance(node, ast.BoolOp):
        parts = [_verdict(v, check, gaps, missing) for v in node.values]
        return _all_of(parts) if isinstance(node.op, ast.And) else _any_of(parts)
    if isinstance(node, ast.Compare):
        try:
            node_gaps = gaps(node)
        except Missing as err:
            missing.append(str(err))
            return NOT_REACHED
        out = []
        for op, gap in zip(node.ops, node_gaps):
            strict = isinstance(op, ast.Gt | ast.Lt)
            holds_low = gap.low > 0 if strict else gap.low >= 0
            fails_high = gap.high <= 0 if strict else gap.high < 0
            out.append(CONFIRMED if holds_low else REFUTED if fails_high else WITHIN_NOISE)
        return _all_of(out)
    raise ConfigError("claims.check", f"{check!r} must be a comparison (or comparisons joined by and/or)")


def judge(check: str, lookup: Lookup) -> Judgement:
    """Evaluate ``check`` with intervals; ``lookup`` raises :class:`Missing` for absent values."""
    tree = _parse(check)
    values: dict[str, float] = {}
    missing: list[str] = []
    try:
        result = _verdict(tree.body, check, lambda node: _gaps(node, check, lookup, values), missing)
    except ZeroDivisionError as err:
        return Judgement(WITHIN_NOISE, values, str(err))
    return Judgement(result, values, _missing_why(result, missing))


def _missing_why(result: str, missing: list[str]) -> str:
    if not missing:
        return ""
    said = "; ".join(missing)
    return said if result == NOT_REACHED else f"settled by the other parts, though {said}"


def judge_paired(check: str, lookups: Sequence[Lookup]) -> Judgement | None:
    """Evaluate ``check`` on same-seed differences: ``lookups`` holds one exact lookup per seed.

    Runs with the same seed share their partition and the clients drawn each round, so under
    label skew much of the spread over seeds is common to every method (the last round's
    cohort). Each comparison's gap is computed seed by seed and judged by the 95% t interval of
    those gaps, as :func:`judge` judges an interval gap. None with fewer than two seeds."""
    if len(lookups) < 2:
        return None
    tree = _parse(check)
    compares = [node for node in ast.walk(tree.body) if isinstance(node, ast.Compare)]
    values: dict[str, list[float]] = {}
    intervals: dict[ast.Compare, list[Interval]] = {}
    absent: dict[ast.Compare, Missing] = {}
    for node in compares:
        per_op: list[list[float]] = [[] for _ in node.ops]
        seed_values: dict[str, list[float]] = {}
        try:
            for lookup in lookups:
                read: dict[str, float] = {}
                for gaps, gap in zip(per_op, _gaps(node, check, lookup, read)):
                    gaps.append(gap.mid)
                for key, value in read.items():
                    seed_values.setdefault(key, []).append(value)
        except Missing as err:
            absent[node] = err
            continue
        except ZeroDivisionError as err:
            return Judgement(WITHIN_NOISE, {}, str(err))
        intervals[node] = [_t_interval(gaps) for gaps in per_op]
        values.update(seed_values)

    def gaps_of(node: ast.Compare) -> list[Interval]:
        if node in absent:
            raise absent[node]
        return intervals[node]

    missing: list[str] = []
    result = _verdict(tree.body, check, gaps_of, missing)
    described = [f"{g.mid:+.4g} [{g.low:+.4g}, {g.high:+.4g}]" for node in compares for g in intervals.get(node, [])]
    why = [f"same-seed gap {', '.join(described)} over {len(lookups)} seeds"] if described else []
    if said := _missing_why(result, missing):
        why.append(said)
    return Judgement(result, {key: statistics.fmean(v) for key, v in values.items()}, "; ".join(why))


def _t_interval(values: list[float]) -> Interval:
    mean, half = statistics.fmean(values), t_halfwidth(values)
    return Interval(mean - half, mean, mean + half)


def _all_of(parts: list[str]) -> str:
    """Verdict of parts that must all hold: refuted if any is, else not reached if a part has no value,
    confirmed if all are."""
    if REFUTED in parts:
        return REFUTED
    if NOT_REACHED in parts:
        return NOT_REACHED
    return CONFIRMED if all(p == CONFIRMED for p in parts) else WITHIN_NOISE


def _any_of(parts: list[str]) -> str:
    """Verdict of parts of which one must hold: confirmed if any is, else not reached if a part has no
    value, refuted if all are."""
    if CONFIRMED in parts:
        return CONFIRMED
    if NOT_REACHED in parts:
        return NOT_REACHED
    return REFUTED if all(p == REFUTED for p in parts) else WITHIN_NOISE


def gate(judgement: Judgement, baseline: str | None, baseline_final: float | None,
         ceiling: float | None, cell: str = "") -> Judgement:
    """No verdict where the claim's baseline ended below 90% of its centralised ceiling (``cell``: the
    cell it ended there, when that is another cell the check reads). A baseline with no result yet (a
    partial benchmark) gives no verdict either: nothing says the budget is one at which it learns."""
    where = f" in {cell}" if cell else ""

    def no_verdict(reason: str) -> Judgement:
        return Judgement(NOT_REACHED, judgement.values, f"{reason} (the check alone says: {judgement.verdict}"
                                                        f"{'; ' + judgement.why if judgement.why else ''})")

    if baseline is not None and baseline_final is None and judgement.verdict != NOT_REACHED:
        return no_verdict(f"baseline {baseline} has no results{where} yet")
    if baseline is None or baseline_final is None or ceiling is None:
        return judgement
    if baseline_final < CEILING_FRACTION * ceiling:
        return no_verdict(f"baseline {baseline} ended at {baseline_final:.3f}{where}, below 90% of its centralised "
                          f"ceiling {ceiling:.3f}")
    return judgement


def row_interval(row: Mapping[str, Any], quantity: str) -> Interval:
    """A result row's quantity as an interval (its ``*_ci`` when it has one)."""
    key = QUANTITIES.get(quantity, quantity)
    value = row.get(key)
    if value is None:
        why = ""
        if key == "communication_seconds_to_target" and row.get("rounds_to_target") is not None:
            why = " (no bandwidth or simulated network to time its messages by)"
        elif "target" in key:
            why = " (target never reached)"
        raise Missing(f"{row.get('variant', row.get('method'))} has no {quantity}{why}")
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError("claims.check", f"{quantity} is not a number in the results")
    ci = row.get(f"{key}_ci")
    return Interval(float(ci[0]), float(value), float(ci[1])) if ci else Interval.exact(float(value))

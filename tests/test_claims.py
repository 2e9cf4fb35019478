"""Claims: each verdict on hand-made results (over intervals and over same-seed gaps); the grammar and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedpeft.claims import (
    CONFIRMED,
    NOT_REACHED,
    REFUTED,
    WITHIN_NOISE,
    Interval,
    Missing,
    gate,
    judge,
    judge_paired,
    references,
    row_interval,
)
from fedpeft.config import ConfigError
from fedpeft.metrics.stats import t_halfwidth

ROWS = {
    ("iid", "lora"): {"method": "lora", "final_metric": 0.85, "final_metric_ci": [0.83, 0.87],
                      "uplink_bytes_per_client_round": 300_000.0, "seconds_to_target": 100.0,
                      "communication_seconds_to_target": 80.0},
    ("iid", "tt"): {"method": "tt", "final_metric": 0.845, "final_metric_ci": [0.835, 0.855],
                    "uplink_bytes_per_client_round": 50_000.0, "last_uplink_bytes_per_client": 20_000.0,
                    "seconds_to_target": None},
    ("iid", "weak"): {"method": "weak", "final_metric": 0.70, "final_metric_ci": [0.69, 0.71],
                      "uplink_bytes_per_client_round": 1_000.0, "seconds_to_target": 95.0,
                      "communication_seconds_to_target": 20.0},
    ("skew", "lora"): {"method": "lora", "final_metric": 0.75, "final_metric_ci": [0.74, 0.76]},
    ("skew", "tt"): {"method": "tt", "final_metric": 0.80, "final_metric_ci": [0.79, 0.81]},
}


def lookup(method: str, selector: tuple[str, ...], quantity: str) -> Interval:
    partition = selector[-1] if selector else "iid"
    row = ROWS.get((partition, method))
    if row is None:
        raise Missing(f"no {method}")
    return row_interval(row, quantity)


@pytest.mark.parametrize("check,verdict", [
    ("tt.uplink <= 0.2 * lora.uplink", CONFIRMED),                        # 50k <= 60k exactly
    ("tt.uplink <= 0.1 * lora.uplink", REFUTED),                          # 50k > 30k exactly
    ("tt.last_uplink <= 0.1 * lora.uplink", CONFIRMED),                   # the last round's 20k <= 30k
    ("tt.final >= lora.final - 0.01", WITHIN_NOISE),                      # [-0.025, +0.035] straddles 0
    ("weak.final >= lora.final - 0.01", REFUTED),                         # even optimistically 0.71 < 0.82
    ("lora.final > weak.final", CONFIRMED),                               # 0.83 > 0.71 at the pessimistic end
    ("tt.uplink <= 0.2 * lora.uplink and weak.final >= lora.final", REFUTED),
    ("tt.uplink <= 0.2 * lora.uplink and tt.final >= lora.final - 0.01", WITHIN_NOISE),
    ("tt.uplink <= 0.1 * lora.uplink or lora.final > weak.final", CONFIRMED),
    # the drop from iid to skew: tt loses 0.045 [0.025, 0.065], lora 0.10 [0.07, 0.13]
    ('tt["iid"].final - tt["skew"].final < lora["iid"].final - lora["skew"].final', CONFIRMED),
    ("tt.time_to_target <= lora.time_to_target", NOT_REACHED),            # tt never reached the target
    ("4 * weak.comm_time_to_target <= lora.comm_time_to_target", CONFIRMED),  # communication alone: 80 <= 80
    ("5 * weak.comm_time_to_target <= lora.comm_time_to_target", REFUTED),
    ("4 * weak.time_to_target <= lora.time_to_target", REFUTED),          # with compute: 380 > 100
    ("ghost.final >= lora.final", NOT_REACHED),
    # a part without a value: one refuted part still settles an `and`, one confirmed part an `or`
    ("tt.time_to_target <= lora.time_to_target and weak.final >= lora.final", REFUTED),
    ("tt.time_to_target <= lora.time_to_target and tt.uplink <= 0.2 * lora.uplink", NOT_REACHED),
    ("tt.time_to_target <= lora.time_to_target or lora.final > weak.final", CONFIRMED),
    ("tt.time_to_target <= lora.time_to_target or weak.final >= lora.final", NOT_REACHED),
])
def test_verdicts_on_hand_made_results(check: str, verdict: str) -> None:
    assert judge(check, lookup).verdict == verdict


def test_a_missing_part_is_named_whatever_settles_the_claim() -> None:
    alone = judge("tt.time_to_target <= lora.time_to_target", lookup)
    assert alone.why == "tt has no time_to_target (target never reached)"
    # reached, but no bandwidth to time its messages by: the reason is the network, not the target
    untimed = {"method": "lora", "rounds_to_target": 4.0, "communication_seconds_to_target": None}
    with pytest.raises(Missing, match="no bandwidth or simulated network"):
        row_interval(untimed, "comm_time_to_target")
    with pytest.raises(Missing, match="target never reached"):
        row_interval({**untimed, "rounds_to_target": None}, "comm_time_to_target")
    settled = judge("tt.time_to_target <= lora.time_to_target and weak.final >= lora.final", lookup)
    assert settled.why == "settled by the other parts, though tt has no time_to_target (target never reached)"
    assert settled.values == {"weak.final": 0.70, "lora.final": 0.85}


def test_values_are_reported_and_gate_needs_the_ceiling() -> None:
    judgement = judge("tt.final >= lora.final - 0.01", lookup)
    assert judgement.values == {"tt.final": 0.845, "lora.final": 0.85}
    gated = gate(judgement, "lora", 0.85, ceiling=0.96)  # 0.85 < 0.9 * 0.96 = 0.864
    assert gated.verdict == NOT_REACHED and "below 90% of its centralised ceiling" in gated.why
    assert gate(judgement, "lora", 0.85, ceiling=0.93).verdict == WITHIN_NOISE  # 0.85 >= 0.837
    assert gate(judgement, "lora", 0.85, ceiling=None).verdict == WITHIN_NOISE
    unrun = gate(judgement, "lora", None, ceiling=0.93)  # a partial benchmark: the baseline has not run yet
    assert unrun.verdict == NOT_REACHED and unrun.why.startswith("baseline lora has no results yet")
    assert "within noise" in unrun.why
    unreached = judge("tt.time_to_target <= lora.time_to_target", lookup)  # already not reached: kept as it is
    assert gate(unreached, "lora", None, ceiling=0.93) is unreached


# three seeds where the seed moves every method together: a leads b on every seed by 0.09-0.11
SEEDS = [{"a": 0.60, "b": 0.50, "c": 0.55}, {"a": 0.80, "b": 0.71, "c": 0.85}, {"a": 0.70, "b": 0.59, "c": 0.66}]


def seed_lookup(seed: int):
    def lookup(method: str, selector: tuple[str, ...], quantity: str) -> Interval:
        if method not in SEEDS[seed]:
            raise Missing(f"no {method}")
        return Interval.exact(SEEDS[seed][method])
    return lookup


def test_same_seed_gaps_separate_what_seed_intervals_cannot() -> None:
    """Over seeds a (0.70, sd 0.10) and b (0.60, sd 0.105) overlap; seed by seed a leads by 0.10, 0.09
    and 0.11: mean 0.10, t(2) interval 0.10 +- 4.303 * 0.01 / sqrt(3) = [0.0752, 0.1248]."""
    def over_seeds(method: str, selector: tuple[str, ...], quantity: str) -> Interval:
        values = [seed[method] for seed in SEEDS]
        mean, half = sum(values) / 3, t_halfwidth(values)
        return Interval(mean - half, mean, mean + half)

    assert judge("a.final > b.final", over_seeds).verdict == WITHIN_NOISE
    lookups = [seed_lookup(seed) for seed in range(3)]
    paired = judge_paired("a.final > b.final", lookups)
    assert paired is not None and paired.verdict == CONFIRMED
    assert paired.values == pytest.approx({"a.final": 0.70, "b.final": 0.60})
    assert "same-seed gap +0.1 [+0.07516, +0.1248] over 3 seeds" in paired.why
    assert judge_paired("b.final > a.final", lookups).verdict == REFUTED
    # c - b: +0.05, +0.14, +0.07: mean 0.0867, interval [-0.031, +0.204]
    assert judge_paired("c.final > b.final", lookups).verdict == WITHIN_NOISE
    assert judge_paired("a.final > b.final and c.final > b.final", lookups).verdict == WITHIN_NOISE
    assert judge_paired("a.final >= b.final + 0.2", lookups).verdict == REFUTED  # 0.2 beyond every gap
    assert judge_paired("ghost.final > a.final", lookups).verdict == NOT_REACHED
    refuted = judge_paired("ghost.final > a.final and b.final > a.final", lookups)
    assert refuted is not None and refuted.verdict == REFUTED  # b trails a on every seed: no need of ghost
    assert "settled by the other parts, though no ghost" in refuted.why and "-0.1 [" in refuted.why
    assert judge_paired("ghost.final > a.final and a.final > b.final", lookups).verdict == NOT_REACHED
    assert judge_paired("a.final > b.final", lookups[:1]) is None  # one seed: no interval of gaps


def test_interval_arithmetic() -> None:
    a, b = Interval(1.0, 2.0, 3.0), Interval(-1.0, 1.0, 2.0)
    assert a - b == Interval(-1.0, 1.0, 4.0)
    assert a * b == Interval(-3.0, 2.0, 6.0)
    assert (a / Interval(1.0, 2.0, 4.0)) == Interval(0.25, 1.0, 3.0)
    with pytest.raises(ZeroDivisionError):
        a / b


def test_grammar_errors_name_the_field() -> None:
    assert references('x["a"].final > y.uplink') == [("x", ("a",), "final"), ("y", (), "uplink")]
    for bad in ("import os", "lora.final >= max(1, 2)", "lora.final >=", "lora[0].final > 1", "__import__('os')"):
        with pytest.raises(ConfigError, match=r"claims\.check"):
            references(bad)


def test_a_claim_reading_a_cell_where_the_baseline_did_not_learn_is_not_reached() -> None:
    """The drop from iid to Dirichlet(0.1) is judged in the iid cell, but it reads the 0.1 cell too: where the
    baseline ended there at the majority class, both methods 'lose the same' and the claim is not reached,
    naming that cell; where the baseline learned in both, the check decides."""
    from types import SimpleNamespace

    from fedpeft.metrics.results import judge_claims
    from fedpeft.sweep import ClaimSpec

    def row(partition: str, method: str, final: float) -> dict:
        return {"task": "sst2", "partition": partition, "method": method, "final_metric": final,
                "final_metric_ci": [final - 0.01, final + 0.01]}

    claim = ClaimSpec(id="drop", claim="x", baseline="lora", where={"partition": "iid"},
                      check='federa["iid"].final - federa["a0.1"].final < lora["iid"].final - lora["a0.1"].final')
    sweep = SimpleNamespace(spec=SimpleNamespace(exclude=[], seeds=[], claims=[claim]))
    ceilings = [{"task": "sst2", "best_metric": 0.82}]  # 90%: 0.738
    collapsed = [row("iid", "lora", 0.82), row("iid", "federa", 0.83), row("a0.1", "lora", 0.51),
                 row("a0.1", "federa", 0.60)]
    cell = judge_claims(sweep, collapsed, ceilings)[0]["cells"]
    assert [c["partition"] for c in cell] == ["iid"] and cell[0]["verdict"] == NOT_REACHED
    assert "baseline lora ended at 0.510 in sst2/a0.1, below 90% of its centralised ceiling" in cell[0]["why"]
    assert "the check alone says: confirmed" in cell[0]["why"]  # 0.23 < 0.31 would have passed
    learned = [*collapsed[:2], row("a0.1", "lora", 0.74), row("a0.1", "federa", 0.82)]
    assert judge_claims(sweep, learned, ceilings)[0]["cells"][0]["verdict"] == "confirmed"  # 0.01 < 0.08


def test_a_claims_gate_cell_replaces_the_cells_it_reads() -> None:
    """`gate: {partition: iid}`: a severe-heterogeneity claim is judged although the baseline ends below 90%
    of its ceiling in the severe cell (the heterogeneity the claim is about), as long as it reaches it in the
    iid cell at the same budget; the verdict (and the same-seed one) names the gate cell, the baseline's value
    there and where the check reads it below 90%. Where the baseline falls short in the gate cell too, or has
    no run there, the claim is not reached. A gate names a real partition, needs a baseline, and may not be a
    cell `exclude` leaves the baseline out of (errors naming the field)."""
    from types import SimpleNamespace

    from fedpeft.metrics.results import judge_claims
    from fedpeft.sweep import ClaimSpec, expand

    def row(partition: str, method: str, final: float, seed: int | None = None) -> dict:
        return {"task": "qqp", "partition": partition, "method": method, "final_metric": final,
                "final_metric_ci": [final - 0.01, final + 0.01], **({} if seed is None else {"seed": seed})}

    def judged(claim: ClaimSpec, summary: list[dict], rows: list[dict] = ()) -> list[dict]:
        sweep = SimpleNamespace(spec=SimpleNamespace(exclude=[], seeds=[], claims=[claim]))
        return judge_claims(sweep, summary, [{"task": "qqp", "best_metric": 0.80}], rows)[0]["cells"]  # 90%: 0.72

    check = "fedtt_plus.final >= lora.final"
    severe = [row("severe", "lora", 0.68), row("severe", "fedtt_plus", 0.71)]
    strict = ClaimSpec(id="c", claim="x", baseline="lora", where={"partition": "severe"}, check=check)
    assert judged(strict, [row("iid", "lora", 0.78), *severe])[0]["verdict"] == NOT_REACHED
    gated = ClaimSpec(id="c", claim="x", baseline="lora", where={"partition": "severe"}, gate={"partition": "iid"},
                      check=check)
    rows = [row(p, m, f + 0.01 * seed, seed) for seed in (0, 1, 2)
            for p, m, f in (("iid", "lora", 0.77), ("severe", "lora", 0.67), ("severe", "fedtt_plus", 0.70))]
    cell = judged(gated, [row("iid", "lora", 0.78), *severe], rows)[0]
    assert cell["verdict"] == CONFIRMED
    note = ("gated in qqp/iid: lora ended at 0.780 there, at least 90% of its centralised ceiling 0.800; below it "
            "where the check reads: 0.680 in qqp/severe")
    assert cell["why"] == note
    assert cell["paired"]["verdict"] == CONFIRMED and cell["paired"]["why"].endswith(note)
    cell = judged(gated, [row("iid", "lora", 0.70), *severe], rows)[0]
    assert cell["verdict"] == NOT_REACHED and cell["paired"]["verdict"] == NOT_REACHED
    assert "baseline lora ended at 0.700 in qqp/iid, below 90% of its centralised ceiling 0.800" in cell["why"]
    assert judged(gated, severe)[0]["verdict"] == NOT_REACHED  # no iid run of the baseline yet
    # where the results know the eval split's majority class (0.623 over 1,000 pairs: 0.653 with its noise),
    # the baseline must still beat it where the check reads: a gate does not judge two collapsed models
    def knows(r: dict) -> dict:
        return {**r, "majority_rate": 0.623, "eval_examples": 1000}

    collapsed = [row("iid", "lora", 0.78), knows(row("severe", "lora", 0.65)), row("severe", "fedtt_plus", 0.71)]
    cell = judged(gated, collapsed)[0]
    assert cell["verdict"] == NOT_REACHED
    assert ("baseline lora ended at 0.650 in qqp/severe, no higher than always answering the majority class "
            "(0.653 with its noise) (the check alone says: confirmed") in cell["why"]
    assert judged(gated, [row("iid", "lora", 0.78), knows(severe[0]), severe[1]])[0]["verdict"] == CONFIRMED
    from fedpeft.metrics.compare import aggregate_seeds

    seeds = [{**knows(row("severe", "lora", f, seed)), "metric": "accuracy", "run": f"lora_seed{seed}"}
             for seed, f in enumerate((0.66, 0.70))]
    assert aggregate_seeds(seeds)[0]["majority_rate"] == 0.623  # one eval split: carried, not averaged
    # judged in the gate cell itself, reading the severe cell too (a drop from iid to severe)
    drop = ClaimSpec(id="d", claim="x", baseline="lora", where={"partition": "iid"}, gate={"partition": "iid"},
                     check='fedtt_plus["iid"].final - fedtt_plus["severe"].final'
                           ' < lora["iid"].final - lora["severe"].final')
    summary = [row("iid", "lora", 0.78), row("iid", "fedtt_plus", 0.76), *severe]
    assert judged(ClaimSpec(**{**drop.model_dump(), "gate": {}}), summary)[0]["verdict"] == NOT_REACHED
    cell = judged(drop, summary)[0]
    assert cell["verdict"] == CONFIRMED  # 0.05 < 0.10
    assert cell["why"] == ("gated in qqp/iid: lora ended at 0.780 there, at least 90% of its centralised ceiling "
                           "0.800; below it where the check reads: 0.680 in qqp/severe")

    body = {"base": {"model": {"name": "tiny-bert"}, "task": {"name": "sst2"}},
            "methods": {"lora": {"method": "lora"}, "bitfit": {"method": "bitfit"}},
            "partitions": {"iid": {"partition": {"kind": "iid"}}, "d0.1": {"partition": {"kind": "dirichlet"}}},
            "claims": [{"id": "c", "claim": "x", "baseline": "lora", "check": "bitfit.final >= lora.final",
                        "gate": {"partition": "severe"}}]}
    with pytest.raises(ConfigError, match=r"sweep\.claims\.0\.gate\.partition.*'severe' is not one of"):
        expand(body)
    body["claims"][0].update(gate={"task": "sst2"})
    with pytest.raises(ConfigError, match=r"sweep\.claims\.0\.gate"):  # only a partition: the judged task's
        expand(body)
    body["claims"][0].update(gate={"partition": "iid"}, baseline=None)
    with pytest.raises(ConfigError, match=r"sweep\.claims\.0\.gate.*needs the claim's baseline"):
        expand(body)
    body["claims"][0].update(baseline="lora")
    body["exclude"] = [{"method": "lora", "partition": "iid"}]
    with pytest.raises(ConfigError, match=r"sweep\.claims\.0\.gate\.partition.*exclude leaves the baseline"):
        expand(body)


def test_a_check_reads_the_centralised_ceiling() -> None:
    """``ceiling.best`` is the task's centralised run with its interval; seed by seed it counts at its mean.
    lora: 0.80, 0.82, 0.84 (mean 0.82, t(2) half-width 4.303 * 0.02 / sqrt(3) = 0.0497); the ceiling 0.88
    [0.86, 0.90], 90% of it 0.792 [0.774, 0.810]: lora's [0.770, 0.870] straddles it, seed by seed the gaps
    0.008, 0.028, 0.048 (mean 0.028, half-width 0.0497) too; at 80% (0.704) every end clears it."""
    from types import SimpleNamespace

    from fedpeft.metrics.results import judge_claims
    from fedpeft.sweep import ClaimSpec

    finals = [0.80, 0.82, 0.84]
    half = t_halfwidth(finals)
    rows = [{"task": "mpqa", "partition": "d0.5", "method": "lora", "seed": seed, "final_metric": final}
            for seed, final in enumerate(finals)]
    summary = [{"task": "mpqa", "partition": "d0.5", "method": "lora", "final_metric": 0.82,
                "final_metric_ci": [0.82 - half, 0.82 + half]}]
    ceilings = [{"task": "mpqa", "best_metric": 0.88, "best_metric_ci": [0.86, 0.90]}]

    def verdicts(check: str) -> tuple[str, str, dict]:
        claims = [ClaimSpec(id="c", claim="x", check=check)]
        sweep = SimpleNamespace(spec=SimpleNamespace(exclude=[], seeds=[], claims=claims))
        cell = judge_claims(sweep, summary, ceilings, rows)[0]["cells"][0]
        return cell["verdict"], cell["paired"]["verdict"], cell["values"]

    verdict, paired, values = verdicts("lora.final >= 0.9 * ceiling.best")
    assert (verdict, paired) == (WITHIN_NOISE, WITHIN_NOISE)
    assert values == pytest.approx({"lora.final": 0.82, "ceiling.best": 0.88})
    assert verdicts("lora.final >= 0.8 * ceiling.best")[:2] == (CONFIRMED, CONFIRMED)
    assert verdicts("lora.final >= ceiling.best + 0.1")[:2] == (REFUTED, REFUTED)
    no_ceiling = SimpleNamespace(spec=SimpleNamespace(exclude=[], seeds=[], claims=[
        ClaimSpec(id="c", claim="x", check="lora.final >= ceiling.best")]))
    cell = judge_claims(no_ceiling, summary, [], rows)[0]["cells"][0]
    assert cell["verdict"] == NOT_REACHED and "mpqa has no centralised ceiling" in cell["why"]


def test_ceiling_is_a_reserved_name_and_needs_a_ceiling_block(tmp_path: Path) -> None:
    from fedpeft.sweep import load_sweep

    body = {"base": {"model": {"name": "tiny-bert"}, "task": {"name": "sst2"}}, "methods": {"lora": {"method": "lora"}},
            "claims": [{"id": "c", "claim": "x", "check": "lora.final >= 0.9 * ceiling.best"}]}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match=r"sweep\.claims\.0\.check.*no ceiling: block"):
        load_sweep(path)
    path.write_text(yaml.safe_dump({**body, "ceiling": {"method": "lora", "rounds": 1}}))
    assert load_sweep(path).spec.claims[0].check == "lora.final >= 0.9 * ceiling.best"
    path.write_text(yaml.safe_dump({**body, "methods": {"ceiling": {"method": "lora"}}, "claims": []}))
    with pytest.raises(ConfigError, match="name the method otherwise"):
        load_sweep(path)

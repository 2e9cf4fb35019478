"""compare/report/sweep on tiny runs, and the page checked in a real headless browser."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from fedpeft.cli import main
from fedpeft.config import build_config
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.metrics.compare import Bandwidth, load_run, run_row
from fedpeft.metrics.report import log_ticks
from tests.conftest import tiny_raw_config


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from tests.conftest import write_toy_sentiment

    root = tmp_path_factory.mktemp("runs")
    train = write_toy_sentiment(root / "train.csv", 160, 0)
    eval_ = write_toy_sentiment(root / "eval.csv", 64, 1)
    dirs = []
    for name, sections in [("lora_r4", {}), ("lora_fp16", {"codec": {"up": {"dtype": "fp16"}}})]:
        raw = tiny_raw_config(train, eval_, root / name, rounds=3, evaluation={"at_start": True}, **sections)
        LocalEngine(prepare(build_config(raw)), root / name).run()
        dirs.append(root / name)
    return dirs


def test_run_row_fields_and_targets(two_runs: list[Path]) -> None:
    run = load_run(two_runs[0])
    row = run_row(run, target=0.0)
    # a target the untrained model already meets credits no round (it says nothing about learning)
    assert row["rounds"] == 3 and row["method"] == "lora" and row["rounds_to_target"] is None
    assert row["target_below_start"] and row["eval_examples"] == 64
    start, best = row["start_metric"], row["best_metric"]
    assert best > start
    reached = run_row(run, target=best)
    assert reached["rounds_to_target"] >= 1 and not reached["target_below_start"]
    low, high = reached["final_metric_ci"]
    assert low < reached["final_metric"] < high and reached["interval"] == "binomial"
    unreachable = run_row(run, target=1.01)
    assert unreachable["rounds_to_target"] is None and unreachable["bytes_to_target"] is None
    records = run.records
    assert row["total_bytes"] == records[-1]["cum_bytes_up"] + records[-1]["cum_bytes_down"]
    assert row["uplink_bytes_per_client_round"] == records[1]["bytes_up"][0]
    assert row["last_uplink_bytes_per_client"] == records[-1]["bytes_up"][0]
    # a message that shrinks mid-run (FedPepTAO after layer selection): the last round's, not the mean
    shrunk = [*records[:-1], {**records[-1], "bytes_up": [b // 2 for b in records[-1]["bytes_up"]]}]
    row = run_row(dataclasses.replace(run, records=shrunk), target=None)
    assert row["last_uplink_bytes_per_client"] == records[-1]["bytes_up"][0] // 2
    assert row["uplink_bytes_per_client_round"] > row["last_uplink_bytes_per_client"]


def test_bandwidth_time_is_slowest_client() -> None:
    link = Bandwidth.parse("8/1")
    record = {"bytes_down": [1_000_000, 0], "bytes_up": [125_000, 250_000], "client_seconds": [1.0, 0.5]}
    # client 0: 1 s down + 1 s compute + 1 s up = 3 s; client 1: 0.5 s + 2 s up = 2.5 s
    assert link.round_seconds(record) == pytest.approx(3.0)
    # communication alone (FLASC's Fig. 3): client 0 2 s, client 1 2 s up
    assert link.round_seconds(record, compute=False) == pytest.approx(2.0)
    with pytest.raises(Exception, match="bandwidth"):
        Bandwidth.parse("fast")


def test_communication_time_to_target_leaves_compute_out(two_runs: list[Path]) -> None:
    """Time to target with and without compute: the same rounds' bytes over the same links, so the two
    differ by exactly the slowest clients' compute, and only the communication time is the same for a
    run whose clients computed ten times faster (a GPU run beside a CPU one)."""
    run = load_run(two_runs[0])
    best = run_row(run, target=None)["best_metric"]
    link = Bandwidth.parse("8/1")
    row = run_row(run, target=best, bandwidth=link)
    reached = row["rounds_to_target"]
    trained = [r for r in run.records if 0 < r["round"] <= reached]
    comm = sum(max(8 * d / 8e6 + 8 * u / 1e6 for d, u in zip(r["bytes_down"], r["bytes_up"])) for r in trained)
    assert row["communication_seconds_to_target"] == pytest.approx(comm)
    assert row["seconds_to_target"] > row["communication_seconds_to_target"] > 0
    faster = [{**r, "client_seconds": [s / 10 for s in r["client_seconds"]]} if r["round"] > 0 else r
              for r in run.records]
    again = run_row(dataclasses.replace(run, records=faster), target=best, bandwidth=link)
    assert again["communication_seconds_to_target"] == pytest.approx(comm)
    assert again["seconds_to_target"] < row["seconds_to_target"]
    # without a bandwidth: the run's own simulated network, else no communication time
    own = sum(r["time"]["simulated_communication"] for r in trained)
    assert run_row(run, target=best)["communication_seconds_to_target"] == pytest.approx(own)
    unsimulated = [{**r, "time": {k: v for k, v in r["time"].items() if not k.startswith("simulated")}}
                   for r in run.records]
    assert run_row(dataclasses.replace(run, records=unsimulated), target=best)[
        "communication_seconds_to_target"] is None


def test_compare_writes_table_report_and_figures(two_runs: list[Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    assert main(["compare", *map(str, two_runs), "--bandwidth", "10/1", "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 4  # three curves + partition
    assert "http://" not in page and "https://" not in page  # nothing to fetch at view time
    for name in ("metric_vs_round", "metric_vs_uplink", "metric_vs_time", "partition"):
        assert (out / f"{name}.png").stat().st_size > 0 and (out / f"{name}.svg").stat().st_size > 0
    rows = json.loads((out / "compare.json").read_text())
    assert [r["run"] for r in rows] == ["lora_r4", "lora_fp16"]
    assert rows[1]["uplink_bytes_per_client_round"] < rows[0]["uplink_bytes_per_client_round"]
    assert "lora_fp16" in capsys.readouterr().out


def test_report_single_run(two_runs: list[Path], tmp_path: Path) -> None:
    assert main(["report", str(two_runs[0]), "--out", str(tmp_path / "one")]) == 0
    assert (tmp_path / "one" / "report.html").exists()


def test_sweep_runs_grid_and_aggregates_seeds(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    base = tiny_raw_config(train, eval_, tmp_path / "unused", rounds=1)
    sweep = {"base": base, "out_dir": str(tmp_path / "sweep"),
             "grid": {"adapter.r": [2, 4], "seed": [0, 1]}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    assert main(["sweep", str(path), "--workers", "2"]) == 0
    rows = json.loads((tmp_path / "sweep" / "compare.json").read_text())
    assert sorted(r["run"] for r in rows) == ["2", "4"]
    assert all(r["seeds"] == [0, 1] for r in rows)
    assert (tmp_path / "sweep" / "2_seed1" / "summary.json").exists()
    # a second call skips finished runs
    assert main(["sweep", str(path)]) == 0


def _chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, capture_output=True,
                       timeout=900, env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    except (OSError, subprocess.SubprocessError):
        return None
    return shutil.which("chromium")


def test_report_renders_in_headless_chromium(two_runs: list[Path], tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency")
    browser_path = _chromium()
    if browser_path is None:
        pytest.skip("Debian's chromium is not installed and could not be installed (apt-get failed)")
    out = tmp_path / "cmp"
    assert main(["compare", *map(str, two_runs), "--out", str(out)]) == 0
    errors: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--no-first-run", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1366, "height": 900})
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto((out / "report.html").as_uri())
        page.wait_for_load_state("load")
        images = page.eval_on_selector_all("img", "els => els.map(e => [e.complete, e.naturalWidth])")
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        browser.close()
    assert len(images) >= 4
    assert all(complete and width > 0 for complete, width in images), images
    assert errors == []
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_method_values_split_scalars_families_and_matrices(tmp_path: Path) -> None:
    from fedpeft.metrics.compare import Run
    from fedpeft.metrics.report import MAX_LINES, method_values

    many = {f"layer{i}.lora_B": 0.1 * i for i in range(MAX_LINES + 1)}
    few = {"A": 1.0, "B": 2.0}
    records = [{"round": r, "method": {"variation_B": float(r), "per_matrix": many, "densities": few,
                                       "active": True, "scores": [[1.0, 2.0], [3.0, 4.0]]}} for r in (1, 2)]
    values = method_values(Run(tmp_path, "run", {}, [{"round": 0, "method": {}}, *records], None))
    assert values.scalars == {"variation_B": [(1, 1.0), (2, 2.0)], "densities.A": [(1, 1.0), (2, 1.0)],
                              "densities.B": [(1, 2.0), (2, 2.0)]}  # booleans are not series
    assert set(values.families) == {"per_matrix"} and len(values.families["per_matrix"]) == MAX_LINES + 1
    assert values.families["per_matrix"]["layer2.lora_B"] == [(1, 0.2), (2, 0.2)]
    assert values.matrices == {"scores": (2, [[1.0, 2.0], [3.0, 4.0]])}  # the last round's


def test_log_ticks_are_round_and_spread() -> None:
    assert log_ticks(55e3, 700e3) == [1e5, 2e5, 5e5]  # 1-2-5 within a decade and a bit
    assert log_ticks(370e3, 930e3) == [5e5, 7e5]  # under a decade: 800 and 900 KB would touch
    assert log_ticks(1e3, 1e6) == [1e3, 1e4, 1e5, 1e6]  # several decades: powers of ten only
    assert log_ticks(370e3, 380e3) == []  # no round value in range: matplotlib's ticks stay


def test_label_skew_counts_the_clients_that_hold_one_class() -> None:
    """Clients 0 (95 of 100) and 2 (40 of 40) hold 90% or more of one class: 140 of 300 examples (47%);
    client 3 is empty and not counted. Below a quarter of the examples it says nothing."""
    from fedpeft.metrics.summary import label_skew

    clients = [{"size": 100, "labels": {"neg": 95, "pos": 5}}, {"size": 160, "labels": {"neg": 80, "pos": 80}},
               {"size": 40, "labels": {"neg": 0, "pos": 40}}, {"size": 0, "labels": {"neg": 0, "pos": 0}}]
    assert label_skew(clients) == "2 of the 3 clients hold 90% or more of one class (47% of the training examples)"
    clients[0]["labels"] = {"neg": 89, "pos": 11}  # 89%: not skewed; 40 of 300 left (13%)
    assert label_skew(clients) is None
    assert label_skew([]) is None


def test_not_learned_tells_never_learned_from_learned_then_lost() -> None:
    """On 400 eval examples whose majority class holds 0.6 the level is 0.6 + 1.96 * sqrt(0.24 / 400) = 0.6480.
    Other metrics are judged against the untrained model (round 0), and never below 0."""
    from fedpeft.metrics.summary import majority_rate, not_learned

    def records(*accuracies: float | None, metric: str = "accuracy") -> list[dict]:
        return [{"round": r, "eval": {} if a is None else {metric: a}} for r, a in enumerate(accuracies)]

    assert majority_rate([1, 0, 1, 1, 2]) == 0.6 and majority_rate([]) is None
    never = not_learned(records(0.6, 0.62, None, 0.648), "accuracy", 0.6, 400)
    assert never is not None and never.startswith("accuracy never rose above 0.648: always answering the eval "
                                                  "split's most frequent class scores 0.600, 0.648 with its noise")
    lost = not_learned(records(0.6, 0.80, 0.75, 0.61), "accuracy", 0.6, 400)
    assert lost is not None and lost.startswith("accuracy reached 0.800 at round 1 but ended at 0.610")
    assert "more clients per round" in lost
    assert not_learned(records(0.6, 0.55, 0.66), "accuracy", 0.6, 400) is None  # ended above the level
    # on label-skewed clients the message says so and puts clients per round and rounds before a tune
    skew = "2 of the 3 clients hold 90% or more of one class (47% of the training examples)"
    skewed = not_learned(records(0.6, 0.62, None, 0.648), "accuracy", 0.6, 400, skew)
    assert skewed is not None and f"so the model has not learned. {skew}: each round's clients" in skewed
    adjusted = "Try the logit-adjusted loss with SGD clients (client.logit_adjustment: 1, client.optimizer: sgd), "
    assert adjusted + "more clients per round (strategy.clients_per_round) and more rounds first, then `fedpeft tune" \
        in skewed
    told = not_learned(records(0.6, 0.62), "accuracy", 0.6, 400, skew, (5, 20))
    assert told is not None and adjusted + "more clients per round (strategy.clients_per_round, 5 of 20 now)" in told
    every = not_learned(records(0.6, 0.62), "accuracy", 0.6, 400, skew, (20, 20))  # every client takes part
    assert every is not None and "client.optimizer: sgd) and more rounds first, then `fedpeft tune" in every
    lost_skewed = not_learned(records(0.6, 0.80, 0.75, 0.61), "accuracy", 0.6, 400, skew)
    assert lost_skewed is not None and f"({skew}: each round's clients pull it toward their own labels)" in lost_skewed
    assert adjusted + "more clients per round, lower learning rates" in lost_skewed
    assert "logit_adjustment" not in lost  # without a measured skew the loss is not the first suspect
    assert not_learned(records(0.9, None), "accuracy", 0.6, 400) is None  # round 0 alone: nothing trained
    # a best just above the level prints with the digits that tell them apart (level 0.5 + 0.049 = 0.549)
    edge = not_learned(records(0.5, 0.5492, 0.5), "accuracy", 0.5, 400)
    assert edge is not None and edge.startswith("accuracy reached 0.5492 at round 1 but ended at 0.5000")
    assert "0.5490 with its noise" in edge
    assert not_learned(records(0.6, 0.66), "accuracy", 0.6, 400) is None  # 0.66 > 0.648
    # entity F1 0.000 after training, round 0 not evaluated: 0 is the level
    zero = not_learned(records(None, 0.0, 0.0, metric="entity_f1"), "entity_f1", None, 400)
    assert zero == ("entity_f1 never rose above 0.000: 0 is what a model that has learned nothing scores, so the "
                    "model has not learned. Try `fedpeft tune CONFIG --trials 8` (a recipe's learning rates come "
                    "from one short SST-2 setting; README: Tune, then run), more rounds or local epochs, and with "
                    "label-skewed clients more clients per round")
    # a trained SQuAD F1 below the untrained model's (round 0)
    below = not_learned(records(0.074, 0.05, 0.06, metric="f1"), "f1", None, 400)
    assert below is not None and below.startswith("f1 never rose above 0.060: the untrained model (round 0) "
                                                  "scores 0.074")
    lost = not_learned(records(0.074, 0.30, 0.07, metric="f1"), "f1", None, 400)
    assert lost is not None and lost.startswith("f1 reached 0.300 at round 1 but ended at 0.070: the untrained")
    assert not_learned(records(0.074, 0.08, metric="f1"), "f1", None, 400) is None  # above the untrained model
    assert not_learned(records(None, 0.01, metric="f1"), "f1", None, 400) is None  # above 0, no round 0 to beat
    # a Matthews correlation whose untrained value is below 0 still has to rise above 0
    assert not_learned(records(-0.05, 0.0, metric="matthews"), "matthews", None, 400) is not None
    # macro-F1 of a one-class model on a 72/28 split is 0.4186, above the untrained model's 0.30: that is the level
    one_class = not_learned(records(0.30, 0.4186, metric="macro_f1"), "macro_f1", 0.4186, 400)
    assert one_class is not None and one_class.startswith("macro_f1 never rose above 0.419: answering one class "
                                                          "for every eval example scores 0.419")
    assert not_learned(records(0.30, 0.45, metric="macro_f1"), "macro_f1", 0.4186, 400) is None
    # an untrained model above the one-class score stays the level
    assert not_learned(records(0.50, 0.45, metric="macro_f1"), "macro_f1", 0.4186, 400) is not None
    # accuracy without a class to count (not a classification): the untrained model is the level
    assert not_learned(records(0.6, 0.6), "accuracy", None, 400) is not None
    assert not_learned(records(0.6, 0.7), "accuracy", None, 400) is None

"""The results pages, generated from the benchmarks' own results files.

Every benchmark is a sweep file (``benchmarks/<name>.yaml``) whose ``fedpeft sweep`` writes
``benchmarks/results/<name>.json``; this script reads those JSON files (no run happens here),
renders each ``<name>.md`` again from its JSON (so a change in how results print reaches every
benchmark, including those whose runs are not kept) and rewrites two generated blocks between
``suite:begin`` / ``suite:end`` markers:

- in ``README.md``, the front door, one table of claims per benchmark: each claim, the cell it was
  judged in, its verdict over seeds and seed by seed, and the values it read;
- in ``benchmarks/results/README.md``, the whole record: for each benchmark its command, the
  centralised ceiling, a table of every method (final metric with its 95% interval over seeds,
  uplink bytes per client and round, within noise or not of the best method) and the verdict of
  each claim with its same-seed gap, exactly as the results file states it.

Run: ``.venv/bin/python benchmarks/suite.py`` (``--check`` fails when any page is out of date).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fedpeft.metrics.report import metric_cell
from fedpeft.metrics.results import ceiling_label, format_values, markdown_from_file
from fedpeft.metrics.summary import human_bytes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
RESULTS_README = RESULTS / "README.md"
BEGIN, END = "<!-- suite:begin -->", "<!-- suite:end -->"
ORDER = ("defaults", "defaults_tuned", "no_pooler", "no_pooler_tuned", "no_pooler_tuned_baselines", "federa",
         "federa_participation", "federa_adjusted", "federa_20ng", "federa_qqp", "federa_wnut_iid", "federa_ner_qa",
         "flasc", "fedtt", "headprune", "fedpeptao")
# the README lists the papers' claims first, then the project's own (defaults that learn, ablations)
PAPERS = ("federa", "federa_participation", "federa_adjusted", "federa_20ng", "federa_qqp", "federa_wnut_iid",
          "federa_ner_qa", "flasc", "fedtt", "fedtt_minilm", "fedtt_minilm_qqp", "fedtt_minilm_qqp_severe",
          "headprune", "headprune_20ng", "headprune_mnli", "fedpeptao")


def benchmarks() -> list[dict[str, Any]]:
    found = {path.stem: json.loads(path.read_text()) for path in RESULTS.glob("*.json")}
    chosen = [found[name] for name in ORDER if name in found and "summary" in found[name]]
    chosen += [data for name, data in sorted(found.items()) if name not in ORDER and "summary" in data]
    return chosen


def section(data: dict[str, Any]) -> list[str]:
    name = data["benchmark"]
    lines = [f"#### `{name}`", "", f"`{data['command']}` — [{name}.md]({name}.md)", ""]
    if data.get("missing_runs"):
        lines += [f"**Partial**: {len(data['rows'])} federated runs finished, {len(data['missing_runs'])} not yet "
                  f"({'; '.join(data.get('missing_cells') or data['missing_runs'])}); "  # older files: run names
                  f"`fedpeft sweep benchmarks/{name}.yaml` finishes them.", ""]
    ceilings = {row["task"]: row for row in data["ceilings"]}
    for task, row in ceilings.items():
        lines.append(f"Centralised ceiling on {task} ({ceiling_label(row, data.get('ceiling_config'))}): "
                     f"best {row['metric']} {metric_cell(row, 'best_metric')}.")
    if ceilings:
        lines.append("")
    lines += ["| task / partition | method | eval n | seeds | final | vs best | uplink / client / round |",
              "|---|---|---|---|---|---|---|"]
    for row in data["summary"]:
        cell = f"{row['task']} / {row['partition']}" if row["partition"] else row["task"]
        lines.append(f"| {cell} | `{row['method']}` | {row.get('eval_examples') or '-'} | {len(row['seeds'])} | "
                     f"{metric_cell(row, 'final_metric')} | {row.get('vs_best', '-')} | "
                     f"{human_bytes(row['uplink_bytes_per_client_round'] or 0)} |")
    lines.append("")
    for claim in data["claims"]:
        for cell in claim["cells"]:
            where = f"{cell['task']} / {cell['partition']}"
            values = format_values(cell["values"])
            why = f" ({cell['why']})" if cell["why"] else ""
            paired = cell.get("paired")
            same_seeds = f"; same seeds: **{paired['verdict']}**, {paired['gap']}" if paired else ""
            lines.append(f"- **{cell['verdict']}**: {claim['claim']} ({claim['source']}; {where}: `{claim['check']}`; "
                         f"{values}){why}{same_seeds}")
    if data["claims"]:
        lines.append("")
    return lines


LEGEND = ("Values are mean ± std over seeds with a 95% interval (t over seeds; one seed: binomial from the eval "
          "size); 'within noise' means the interval overlaps the best method's in the same cell. Verdicts: "
          "confirmed / refuted / within noise (the check holds or fails only inside the intervals) / not reached "
          "(the claim's baseline ended below 90% of its centralised ceiling, or a value is missing). 'Same seeds': "
          "the same rule on the gap seed by seed (runs with one seed share their partition and each round's "
          "clients), with the gaps' 95% t interval.")


def render(found: list[dict[str, Any]]) -> str:
    """The whole record of the benchmarks ``found``, for ``benchmarks/results/README.md``."""
    lines = [BEGIN, f"Generated by `python benchmarks/suite.py` from `benchmarks/results/*.json`. {LEGEND}", ""]
    for data in found:
        lines += section(data)
    lines.append(END)
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|")


def claims_table(data: dict[str, Any]) -> list[str]:
    """One benchmark's claims, a row per cell judged, for the README."""
    name = data["benchmark"]
    lines = [f"#### `{name}`", "", f"`{data['command']}` — [{name}.md](benchmarks/results/{name}.md)", "",
             "| claim | source | cell | verdict | same seeds | values |", "|---|---|---|---|---|---|"]
    for claim in data["claims"]:
        for cell in claim["cells"]:
            values = format_values(cell["values"]) or "-"
            why = f"; {cell['why']}" if cell["why"] else ""
            paired = cell.get("paired")
            same_seeds = f"**{paired['verdict']}** ({paired['gap']})" if paired else "-"
            lines.append(f"| {_cell(claim['claim'])} | {_cell(claim['source'])} | {cell['task']} / "
                         f"{cell['partition']} | **{cell['verdict']}** | {same_seeds} | {_cell(values + why)} |")
    return [*lines, ""]


def render_claims(found: list[dict[str, Any]]) -> str:
    """The claims of every benchmark ``found`` that states some, for ``README.md``."""
    def paper_first(data: dict[str, Any]) -> int:
        return PAPERS.index(data["benchmark"]) if data["benchmark"] in PAPERS else len(PAPERS)

    judged = sorted((data for data in found if data["claims"]), key=paper_first)
    without = [f"`{data['benchmark']}`" for data in found if not data["claims"]]
    lines = [BEGIN, "Generated by `python benchmarks/suite.py` from `benchmarks/results/*.json`; every method's row, "
             "ceiling and interval is in [benchmarks/results/README.md](benchmarks/results/README.md). "
             f"{LEGEND}", ""]
    if without:
        lines += [f"Measured without claims (tables only): {', '.join(without)}.", ""]
    for data in judged:
        lines += claims_table(data)
    lines.append(END)
    return "\n".join(lines)


def _replace_block(text: str, block: str) -> str:
    """``text`` with its generated block (from BEGIN to END, markers included) replaced by ``block``."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when a generated page is out of date")
    args = parser.parse_args()
    found, stale = benchmarks(), []
    pages = {README: _replace_block(README.read_text(), render_claims(found)),
             RESULTS_README: _replace_block(RESULTS_README.read_text(), render(found))}
    for data in found:
        json_path = RESULTS / f"{data['benchmark']}.json"
        pages[json_path.with_suffix(".md")] = markdown_from_file(json_path, data)
    for page, updated in pages.items():
        if page.exists() and page.read_text() == updated:
            continue
        stale.append(page.relative_to(ROOT))
        if not args.check:
            page.write_text(updated)
    if args.check:
        for page in stale:
            print(f"{page} is out of date: run python benchmarks/suite.py")
        return 1 if stale else 0
    print(f"README.md, benchmarks/results/README.md and {len(found)} benchmarks' markdown: "
          f"{len(stale)} page{'s' * (len(stale) != 1)} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())

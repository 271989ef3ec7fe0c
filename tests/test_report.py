"""benchmarks/report.py over the committed H200 results: the table and the README's summary chart."""

import importlib.util
import json
import pathlib
import re

import pytest

from test_docs import requires_results

pytestmark = requires_results
ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "2026-12-01-h200.json"


def _report():
    spec = importlib.util.spec_from_file_location("kvcanary_bench_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_table_counts_the_targets_of_the_committed_run():
    report = _report()
    ceilings, rows, data = report.load(str(RESULTS))
    text = report.markdown(ceilings, rows, data)
    assert "**Targets:** 157 of 165 met" in text
    assert "| verify_16m plan | x faster than peer plan | 1.74 | >= 2 | **no** |" in text


def test_summary_panels_hold_every_step_and_each_missed_target():
    report = _report()
    ceilings, rows, _ = report.load(str(RESULTS))
    steps, large, decode = report.summary_panels(ceilings, rows)
    assert len(steps["bars"]) == 16  # every named case of the suite has a step
    missed_steps = [b["label"] for b in steps["bars"] if b["met"] is False]
    assert missed_steps == ["e2e_decode_steady_hash"]
    missed_decode = sorted(b["label"] for b in decode["bars"] if b["met"] is False)
    assert missed_decode == ["e2e_decode_steady_hash · write", "swa_decode_long_prefix · plan",
                             "swa_decode_long_prefix · verify", "swa_decode_short_prefix · plan",
                             "swa_decode_short_prefix · verify"]
    assert all(0 < b["value"] <= 100 for b in large["bars"])
    assert any(b["label"] == "plan_bs1024_prefix4096 · plan (of copy)" for b in large["bars"])


def test_summary_chart_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    report = _report()
    out = tmp_path / "summary.png"
    assert report.main([str(RESULTS), "--summary-png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _runs_with_tables():
    """Each committed run's JSON (older ones gzipped) whose table beside it states its targets."""
    runs = []
    for path in sorted((ROOT / "benchmarks" / "results").glob("*-h200*.json*")):
        table = path.with_name(path.name.split(".json")[0] + ".md")
        if table.exists() and "**Targets:**" in table.read_text():
            runs.append(path)
    return runs


@pytest.mark.parametrize("path", _runs_with_tables(), ids=lambda path: path.name)
def test_each_committed_table_is_what_its_json_gives(path):
    """report.py reads every committed run, gzipped or not, and finds the targets met that the run's
    committed table states."""
    report = _report()
    ceilings, rows, data = report.load(str(path))
    made = re.search(r"\*\*Targets:\*\* \d+ of \d+ met", report.markdown(ceilings, rows, data))
    table = path.with_name(path.name.split(".json")[0] + ".md").read_text()
    assert made and made.group(0) in table


def test_the_committed_runs_are_found():
    assert len(_runs_with_tables()) >= 20  # the glob above still matches the results' names


def test_the_committed_index_lists_every_run():
    """benchmarks/results/INDEX.md is what report.py makes of the committed runs: regenerate it
    (`python benchmarks/report.py --index benchmarks/results --markdown benchmarks/results/INDEX.md`)
    when a run is added."""
    report = _report()
    folder = ROOT / "benchmarks" / "results"
    made = report.index(sorted(folder.glob("*.json*")))
    assert (folder / "INDEX.md").read_text() == made
    assert made.count("\n| `") >= 20  # every run with the suite's ceilings, a line each


def test_a_row_whose_baseline_disagreed_shows_no_ratio_to_it(tmp_path):
    """A benchmark that failed its baseline check still lands in the JSON; its × naive is of other
    work, so the table names the disagreement instead and its naive target counts as missed."""
    report = _report()
    data = json.loads(RESULTS.read_text())
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        if info.get("case") == "e2e_decode_steady" and info.get("op") == "verify":
            info["naive_agrees"] = False
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    text = report.markdown(*report.load(str(path)))
    row = next(line for line in text.splitlines() if line.startswith("| e2e_decode_steady | ") and "| verify |" in line)
    assert row.split(" | ")[8] == "baseline disagreed"  # the × naive column
    assert "**Targets:** 156 of 165 met" in text
    assert "| e2e_decode_steady verify | x faster than naive | 39.8 | >= 5 | **no** |" in text


def test_an_index_of_a_missing_folder_is_refused(tmp_path, capsys):
    """A mistyped folder is an error, not an index of no runs written over the committed one."""
    report = _report()
    out = tmp_path / "INDEX.md"
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--index", str(tmp_path / "no-such-folder"), "--markdown", str(out)])
    assert exit_info.value.code == 2 and not out.exists()
    assert "no such folder" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, b"{not json", b"\x1f\x8b not gzip"])
def test_a_file_that_is_missing_or_not_json_is_a_usage_error(tmp_path, capsys, content):
    report = _report()
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(path)])
    assert exit_info.value.code == 2 and str(path) in capsys.readouterr().err

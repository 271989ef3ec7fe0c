"""benchmarks/report.py over the committed H200 results: the table and the README's summary chart;
and the targets the suite's harness (benchmarks/conftest.py) sets on each row, against a committed run."""

import importlib.util
import json
import pathlib
import re
import types

import pytest

from test_docs import requires_results

pytestmark = requires_results
ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "2026-12-01-h200.json"


def _load(name: str, path: pathlib.Path):
    """A benchmarks module loaded from its file (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report():
    return _load("kvcanary_bench_report", ROOT / "benchmarks" / "report.py")


def test_table_counts_the_targets_of_the_committed_run():
    report = _report()
    ceilings, rows, data = report.load(str(RESULTS))
    text = report.markdown(ceilings, rows, data)
    assert "**Targets:** 157 of 165 met" in text
    assert "| verify_16m plan | x faster than peer plan | 1.74 | >= 2 | **no** |" in text
    assert "| e2e_decode_steady | step | 1 | 24.87 | 61 | 86 |" in text.split("**Random reads.**")[1]


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
    """report.py reads every committed run, gzipped or not, and makes the lines of its committed
    table, in their order, none left out: the device and commit, the ceilings, every column of every
    row (a ratio, a mark, a target's verdict), the targets met and every target listed. (The prose
    between the tables was reworded since some runs: only the tables' lines are compared.)"""
    report = _report()
    ceilings, rows, data = report.load(str(path))
    text = report.markdown(ceilings, rows, data)
    table = path.with_name(path.name.split(".json")[0] + ".md").read_text()
    kinds = ("| ", "**Device:**", "**Ceilings:**", "**Targets:**")
    made = [line for line in text.splitlines() if line.startswith(kinds)]
    committed = [line for line in table.splitlines() if line.startswith(kinds)]
    assert re.search(r"\*\*Targets:\*\* \d+ of \d+ met", text) and committed[:len(made)] == made


def test_the_latest_committed_table_is_what_the_readme_command_writes(tmp_path):
    """benchmarks/README.md's command, given the latest run's JSON, writes the committed table
    (benchmarks/results/2026-12-02-h200-32ed251.md) to the letter, up to the first heading of the
    prose added below it."""
    report = _report()
    run = ROOT / "benchmarks" / "results" / "2026-12-02-h200-32ed251.json.gz"
    out = tmp_path / "table.md"
    assert report.main([str(run), "--markdown", str(out)]) == 0
    made = out.read_text()
    assert "**Random reads.**" in made and "**Targets:**" in made
    assert run.with_name("2026-12-02-h200-32ed251.md").read_text().split("\n## ", 1)[0] == made


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


def test_a_run_whose_rows_do_not_carry_the_all_hash_write_check_gets_it_across_rows():
    """Runs whose ALL-hash write rows did not carry their check against the same shape without
    hashing get it from report.py: the same ratio and verdict, and a ratio past 1.2 missed."""
    report = _report()
    _, rows, _ = report.load(str(RESULTS))
    writes = {r["case"]: r for r in rows if r["op"] == "write" and r.get("mode") == "eager"}
    carried = {case: next(t for t in writes[case]["targets"] if t["name"].startswith("ALL-hash write"))
               for case in report.ALL_HASH_TWINS}
    for row in rows:
        row["targets"] = [t for t in row.get("targets") or [] if not t["name"].startswith("ALL-hash write")]
    across = {t["name"].split()[1]: t for t in report.all_targets(rows) if t["row"] == "cross-case"}
    assert sorted(across) == sorted(carried)
    for case, target in carried.items():
        assert across[case]["achieved"] == pytest.approx(target["achieved"], rel=1e-12)
        assert (across[case]["target"], across[case]["met"]) == ("<= 1.2", True) == (target["target"], target["met"])
    slow = writes["e2e_decode_steady_hash"]
    slow["time_us"] = 1.3 * writes[report.ALL_HASH_TWINS["e2e_decode_steady_hash"]]["time_us"]
    (missed,) = [t for t in report.cross_targets(rows) if t["name"].startswith("write e2e_decode_steady_hash")]
    assert missed["achieved"] == pytest.approx(1.3) and not missed["met"]


@pytest.mark.parametrize(("field", "value"), [("scale", 0.5), ("device", "cpu")])
def test_the_targets_of_a_scaled_down_or_cpu_run_are_not_binding(tmp_path, field, value):
    report = _report()
    assert "not binding" not in report.markdown(*report.load(str(RESULTS)))
    data = json.loads(RESULTS.read_text())
    for bench in data["benchmarks"]:
        if "case" in bench["extra_info"]:
            bench["extra_info"][field] = value
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    text = report.markdown(*report.load(str(path)))
    assert "**Targets:** 157 of 165 met (not binding: a scaled-down or CPU run)" in text


def test_summary_steps_are_the_best_of_eager_and_graph_judged_by_the_peer_target_alone():
    """Each case's step bar is the better of its eager and graph ratios to the peer, green or red
    by its target against the peer's step, whatever the row's other targets say."""
    report = _report()
    ceilings, rows, _ = report.load(str(RESULTS))
    steps = {r["case"]: r for r in rows if r["op"] == "step" and r.get("mode") != "graph"}
    graphs = {r["case"]: r for r in rows if r["op"] == "step" and r.get("mode") == "graph"}
    assert any(graphs[case]["x_peer"] > steps[case]["x_peer"] for case in graphs)
    for row in steps.values():
        for target in row["targets"]:
            target["met"] = "peer" in target["name"] and target["met"]  # every other target of the row missed
    bars = report.summary_panels(ceilings, rows)[0]["bars"]
    assert len(bars) == len(steps) == 16
    for bar in bars:
        eager = steps[bar["label"]]
        assert bar["value"] == max(eager["x_peer"], graphs.get(bar["label"], {}).get("x_peer", 0.0))
        assert bar["met"] == next(t["met"] for t in eager["targets"] if "peer" in t["name"])
    assert sum(bar["met"] is False for bar in bars) == 1


def _row(case, op, shape, time_us, entries, entries_per_s, gbps, pct_copy, targets=(), mode="eager", **extra):
    """A row's extra_info as the harness records it, with only the fields the report reads."""
    return dict(case=case, op=op, mode=mode, device="cuda", scale=1.0, shape=shape, time_us=time_us,
                entries=entries, entries_per_s=entries_per_s, gbps=gbps, pct_copy_ceiling=pct_copy,
                targets=[dict(name=n, achieved=a, target=t, met=m) for n, a, t, m in targets], **extra)


def _small_run() -> dict:
    """A run of a few rows, out of the report's order, whose every figure is worked out by hand in
    the tests below: a step slower than the peer's with no graph replay, a verify of exactly the
    rows the summary reads against a ceiling (500,000 entries) and a plan one short of it, and
    an ALL-hash write exactly 1.2× its twin without hashing, whose row does not carry that check."""
    decode = "bs256 prefix4096 decode"
    empty, peer, naive = "x empty kernel (decode-shaped)", "x faster than peer step", "x faster than naive"
    infos = [
        dict(case="ceilings", op="ceilings", device="cuda", scale=1.0, device_name="NVIDIA H200", copy_gbps=4000.0,
             gather32_entries_per_s=3.0e10, gather32_gbps=960.0, read32_entries_per_s=4.0e10, empty_kernel_us=2.5,
             empty_graph_us=2.25, empty_launch_host_us=5.0),
        _row("plan_bs1024_prefix4096", "plan", "bs1024 prefix4096", 100.0, 4_194_304, 4.194304e10, 2200.0, 55.0,
             [("plan % copy ceiling", 55.0, ">= 50", True)], wall_us_per_call=120.0, x_naive=30.0,
             pct_plan_stream=51.0),
        _row("e2e_decode_steady_hash", "write", decode, 6.0, 256, 256 / 6e-6, 1.5, 0.0375,
             [(empty, 2.4, "<= 2", False)], wall_us_per_call=90.0, x_naive=250.0, x_naive_wall=12.5,
             x_empty_kernel=2.4),
        _row("e2e_decode_tail", "step", "bs128 prefix8192 decode", 50.0, 4096, 8.192e7, 3.2, 0.08,
             [(peer, 0.8, ">= 2", False)], wall_us_per_call=40.0, x_peer=0.8, x_empty_kernel=20.0),
        _row("e2e_decode_steady", "write", decode, 5.0, 256, 5.12e7, 1.8, 0.045, [(empty, 2.0, "<= 2", True)],
             wall_us_per_call=88.0, x_naive=300.0, x_empty_kernel=2.0),
        _row("e2e_decode_steady", "verify", decode, 25.0, 500_000, 2.0e10, 1120.0, 28.0,
             [(naive, 16.0, ">= 5", True)], wall_us_per_call=33.0, x_naive=16.0, x_naive_wall=24.0,
             x_empty_kernel=10.0, random_sectors_per_entry=1, random_sectors_per_s=2.0e10, pct_random_read=50.0),
        _row("e2e_decode_steady", "step", decode, 38.0, 1_040_000, 1_040_000 / 38e-6, 2100.0, 52.5,
             [(peer, 3.0, ">= 2", True)], mode="graph", graph_wall_us=20.0, wall_us_per_call=999.0, x_peer=3.0,
             random_sectors_per_entry=1, random_sectors_per_s=2.7e10, pct_random_read=68.4),
        dict(case="e2e_decode_steady", op="scatter", mode="eager"),  # a benchmark that failed before it was timed
        _row("e2e_decode_steady", "plan", decode, 10.0, 499_999, 4.99999e10, 1800.0, 45.0, wall_us_per_call=80.0,
             x_naive=60.0, x_empty_kernel=4.0),
        _row("e2e_decode_steady", "step", decode, 40.0, 1_040_000, 2.6e10, 2000.0, 50.0,
             [(peer, 2.5, ">= 2", True)], wall_us_per_call=30.0, x_naive=100.0, x_peer=2.5, x_empty_kernel=16.0,
             random_sectors_per_entry=1, random_sectors_per_s=2.6e10, pct_random_read=65.0),
        dict(case="ceilings", op="ceilings_end", empty_kernel_us=3.0),
    ]
    return dict(datetime="2026-12-03T10:00:00+00:00", commit_info=dict(id="0123456789abcdef"),
                benchmarks=[dict(name=f"test_{i}", extra_info=info) for i, info in enumerate(infos)])


def _written(tmp_path, data: dict) -> str:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    return str(path)


SMALL_RUN_TABLE = """\
**Device:** NVIDIA H200 · scale 1.0 · 2026-12-03T10:00:00+00:00 · commit 0123456789

**Ceilings:** copy 4000 GB/s (read+write) · random 32-B gather 30.00 G entries/s (960 GB/s) · random 32-B read, \
nothing written 40.00 G entries/s · empty kernel 2.50 µs device (3.00 µs at the end of the run), 2.25 µs as graph \
replay, 5.00 µs host per launch

| case | shape | op | time µs | host µs | entries/s | GB/s | % copy | × naive | × peer | targets |
|---|---|---|---|---|---|---|---|---|---|---|
| e2e_decode_steady | bs256 prefix4096 decode | step | 40.00 | 30.0 | 26.00 G | 2000.0 | 50.0 | 100.0 | 2.50 | \
✅ x faster than peer step 2.5 (want >= 2) |
| e2e_decode_steady | bs256 prefix4096 decode | step (graph) | 38.00 | 20.0 | 27.37 G | 2100.0 | 52.5 | – | 3.00 | \
✅ x faster than peer step 3 (want >= 2) |
| e2e_decode_steady | bs256 prefix4096 decode | plan | 10.00 | 80.0 | 50.00 G | 1800.0 | 45.0 | 60.0 | – |  |
| e2e_decode_steady | bs256 prefix4096 decode | verify | 25.00 | 33.0 | 20.00 G | 1120.0 | 28.0 | 16.0 / 24.0 | – | \
✅ x faster than naive 16 (want >= 5) |
| e2e_decode_steady | bs256 prefix4096 decode | write | 5.00 | 88.0 | 51.20 M | 1.8 | 0.0 | 300.0 | – | \
✅ x empty kernel (decode-shaped) 2 (want <= 2) |
| e2e_decode_tail | bs128 prefix8192 decode | step | 50.00 | 40.0 | 81.92 M | 3.2 | 0.1 | – | 0.80 | \
❌ x faster than peer step 0.8 (want >= 2) |
| e2e_decode_steady_hash | bs256 prefix4096 decode | write | 6.00 | 90.0 | 42.67 M | 1.5 | 0.0 | 250.0 / 12.5 | – | \
❌ x empty kernel (decode-shaped) 2.4 (want <= 2) |
| plan_bs1024_prefix4096 | bs1024 prefix4096 | plan | 100.00 | 120.0 | 41.94 G | 2200.0 | 55.0 | 30.0 | – | \
✅ plan % copy ceiling 55 (want >= 50) |

**Random reads.** The random 32-byte sectors that a verify or step row's verify entries read (each its slot, and \
the sectors each source hashed spans) a second, against the bare kernels:

| case | op | sectors an entry | G sectors/s | % random read | % random gather |
|---|---|---|---|---|---|
| e2e_decode_steady | step | 1 | 26.00 | 65 | 87 |
| e2e_decode_steady | verify | 1 | 20.00 | 50 | 67 |

**Targets:** 6 of 8 met

| row | target | achieved | wanted | met |
|---|---|---|---|---|
| e2e_decode_steady step | x faster than peer step | 2.5 | >= 2 | yes |
| e2e_decode_steady step (graph) | x faster than peer step | 3 | >= 2 | yes |
| e2e_decode_steady verify | x faster than naive | 16 | >= 5 | yes |
| e2e_decode_steady write | x empty kernel (decode-shaped) | 2 | <= 2 | yes |
| e2e_decode_tail step | x faster than peer step | 0.8 | >= 2 | **no** |
| e2e_decode_steady_hash write | x empty kernel (decode-shaped) | 2.4 | <= 2 | **no** |
| plan_bs1024_prefix4096 plan | plan % copy ceiling | 55 | >= 50 | yes |
| cross-case | write e2e_decode_steady_hash / e2e_decode_steady | 1.2 | <= 1.2 | yes |
"""


def test_a_small_run_gives_the_table_worked_out_by_hand(tmp_path):
    """Rows in the suite's order of cases, eager before graph; each figure in its column and
    precision; a graph row's host time its replay's wall time; the random reads of the eager
    verify and step rows alone, against the bare read and gather rates (26 G sectors/s: 65 % of
    40 G, 87 % of 30 G); an ALL-hash write at exactly 1.2× its twin met; a row never timed left out."""
    report = _report()
    assert report.markdown(*report.load(_written(tmp_path, _small_run()))) == SMALL_RUN_TABLE


def test_a_run_without_the_ceilings_benchmark_has_a_table_without_them(tmp_path):
    """A run selected with -k may hold the empty kernel timed at its end but not the ceilings: the
    table names the device the rows ran on, and reads no row against a ceiling it lacks."""
    report = _report()
    data = _small_run()
    data["benchmarks"] = [b for b in data["benchmarks"] if b["extra_info"]["op"] != "ceilings"]
    text = report.markdown(*report.load(_written(tmp_path, data)))
    assert text.startswith("**Device:** cuda · scale 1.0 · ")
    assert "**Ceilings:**" not in text and "**Random reads.**" not in text and "**Targets:** 6 of 8 met" in text


def test_large_counts_take_the_unit_they_reach():
    report = _report()
    assert [report._si(v) for v in (None, 640.4, 1e3, 1e9, 2.5e12)] == ["–", "640", "1.00 k", "1.00 G", "2.50 T"]


def test_a_small_run_gives_the_summary_worked_out_by_hand(tmp_path):
    """Each case's step at the better of eager and graph replay, or its eager ratio alone where it
    has no graph row, however far below the peer; the eager rows of 500,000 entries or more
    against their ceiling (a plan against copy, a step or verify against random reads); the rows
    with a decode-shaped target against the empty kernel, green or red by that target."""
    report = _report()
    panels = report.summary_panels(*report.load(_written(tmp_path, _small_run()))[:2])
    bars = [[(b["label"], b["value"], b["met"]) for b in panel["bars"]] for panel in panels]
    assert bars == [
        [("e2e_decode_steady", 3.0, True), ("e2e_decode_tail", 0.8, False)],
        [("e2e_decode_steady · step (of random reads)", 65.0, None),
         ("e2e_decode_steady · verify (of random reads)", 50.0, None),
         ("plan_bs1024_prefix4096 · plan (of copy)", 55.0, None)],
        [("e2e_decode_steady · write", 2.0, True), ("e2e_decode_steady_hash · write", 2.4, False)],
    ]
    assert [(p["line"], p["log"]) for p in panels] == [(2.0, True), (100.0, False), (2.0, False)]
    assert panels[2]["title"].endswith("(empty kernel 2.50 µs)")


class _OpenFigures:
    """pyplot, but the figures drawn through it stay open to be read back."""

    def __init__(self, pyplot):
        self.pyplot, self.figures = pyplot, []

    def subplots(self, *args, **kwargs):
        figure, axes = self.pyplot.subplots(*args, **kwargs)
        self.figures.append(figure)
        return figure, axes

    def close(self, figure):
        pass


def _drawn(report, monkeypatch, draw, *args):
    """The figure that ``draw`` makes of ``args`` (it writes its PNG too)."""
    pytest.importorskip("matplotlib")
    pyplot = _OpenFigures(report._pyplot())
    monkeypatch.setattr(report, "_pyplot", lambda: pyplot)
    assert draw(*args) is True
    (figure,) = pyplot.figures
    return figure


def test_the_chart_draws_each_row_at_its_bandwidth_against_the_ceilings(tmp_path, monkeypatch):
    """A bar per row that has a bandwidth, in the table's order and at its GB/s, the graph rows
    hatched over theirs; the copy ceiling and the random gather as lines at their GB/s."""
    from matplotlib.colors import to_hex  # noqa: PLC0415 (importorskip in _drawn)
    report = _report()
    ceilings, rows, _ = report.load(_written(tmp_path, _small_run()))
    out = tmp_path / "chart.png"
    (ax,) = _drawn(report, monkeypatch, report.chart, ceilings, rows, str(out)).axes
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bars = ax.containers[0]
    assert [round(b.get_width(), 6) for b in bars] == [2000.0, 2100.0, 1800.0, 1120.0, 1.8, 3.2, 1.5, 2200.0]
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["e2e_decode_steady · step",
                                                                "e2e_decode_steady · step (graph)"]
    assert to_hex(bars[4].get_facecolor()) == "#c44e52" and to_hex(bars[2].get_facecolor()) == "#dd8452"
    (hatched,) = ax.containers[1]
    assert hatched.get_hatch() == "//" and hatched.get_width() == 2100.0
    assert sorted(line.get_xdata()[0] for line in ax.lines) == [960.0, 4000.0]


def test_the_summary_chart_colours_each_bar_by_its_target(tmp_path, monkeypatch):
    """Each panel's bars at their values, green where the target is met, red where missed, blue
    where the panel holds no target; the target line where the panel puts it; the steps on a log
    scale."""
    from matplotlib.colors import to_hex  # noqa: PLC0415 (importorskip in _drawn)
    report = _report()
    ceilings, rows, _ = report.load(_written(tmp_path, _small_run()))
    axes = _drawn(report, monkeypatch, report.summary_chart, ceilings, rows, str(tmp_path / "summary.png")).axes
    green, red, blue = "#55a868", "#c44e52", "#4c72b0"
    drawn = [[(round(b.get_width(), 6), to_hex(b.get_facecolor())) for b in ax.containers[0]] for ax in axes]
    assert drawn == [[(3.0, green), (0.8, red)], [(65.0, blue), (50.0, blue), (55.0, blue)],
                     [(2.0, green), (2.4, red)]]
    assert [line.get_xdata()[0] for ax in axes for line in ax.lines] == [2.0, 100.0, 2.0]
    assert [ax.get_xscale() for ax in axes] == ["log", "linear", "linear"]


def test_the_index_written_through_the_command_line_is_the_committed_one(tmp_path):
    """The command benchmarks/README.md gives for INDEX.md writes it as committed: every run's
    JSON, gzipped or not, and it reports success."""
    report = _report()
    folder = ROOT / "benchmarks" / "results"
    out = tmp_path / "INDEX.md"
    assert report.main(["--index", str(folder), "--markdown", str(out)]) == 0
    assert out.read_text() == (folder / "INDEX.md").read_text()


def test_a_file_without_rows_of_the_suite_is_a_failure(tmp_path, capsys):
    """A JSON of the ceilings alone (or of another suite) has no table to make: it says so and
    fails, writing nothing."""
    report = _report()
    data = _small_run()
    data["benchmarks"] = [b for b in data["benchmarks"] if b["extra_info"]["case"] == "ceilings"]
    out = tmp_path / "table.md"
    assert report.main([_written(tmp_path, data), "--markdown", str(out)]) == 1
    assert "no benchmark rows of this suite" in capsys.readouterr().err and not out.exists()


# --- the harness's targets (benchmarks/conftest.py) -------------------------------------------
# The latest full run whose rows hold every input of the targets set on them (x_naive_wall came later)
TARGETS_RUN = ROOT / "benchmarks" / "results" / "2026-12-02-h200-32ed251.json.gz"


def _bench_conftest():
    return _load("kvcanary_bench_conftest", ROOT / "benchmarks" / "conftest.py")


def _harness(conftest, device: str, scale: float, ceilings: dict):
    """The suite's harness without its timer or pytest config: what ``_targets`` reads."""
    harness = object.__new__(conftest.Harness)
    harness.device, harness.scale, harness.results, harness._ceilings = device, scale, {}, ceilings
    return harness


def _targets_of(conftest, harness, info: dict) -> dict:
    """``info`` (a row's extra_info) with the targets the harness sets on it now, timed as the row
    was: its time recorded first, as the harness records each benchmark's before its targets."""
    case = conftest.S.BY_NAME[info["case"]].scaled(harness.scale)
    graph = info.get("mode") == "graph"
    harness.results[(case.name, info["op"] + ("_graph" if graph else ""))] = info["time_us"] * 1e-6
    made = {key: value for key, value in info.items() if key not in ("targets", "targets_met")}
    harness._targets(types.SimpleNamespace(case=case), info["op"], graph, made)
    return made


def test_the_harness_sets_the_targets_that_the_committed_run_recorded():
    """Each row of a full GPU run, its measured inputs given again in the run's order, gets the
    very targets (achieved, bar, verdict) and work (entries, bytes, random sectors an entry) the
    run recorded: a ratio turned over, a bar moved or a basis swapped changes one. When the
    targets change on purpose, commit a run made with them and read that one here."""
    conftest = _bench_conftest()
    report = _report()
    ceilings, rows, _ = report.load(str(TARGETS_RUN))
    harness = _harness(conftest, "cuda", 1.0, ceilings)
    checked = 0
    for row in [info for info in (b["extra_info"] for b in report._read(TARGETS_RUN)["benchmarks"])
                if "case" in info and "time_us" in info]:
        made = _targets_of(conftest, harness, row)
        where = (row["case"], row["op"], row.get("mode"))
        assert (made["targets"], made["targets_met"]) == (row["targets"], row["targets_met"]), where
        case = conftest.S.BY_NAME[row["case"]]
        assert conftest.work_of(case, row["op"]) == (row["entries"], row["bytes"]), where
        if "random_sectors_per_entry" in row:
            assert conftest._verify_sectors(case) == row["random_sectors_per_entry"], where
        checked += bool(row["targets"])
    assert checked >= 100 and len(rows) == 132


def test_a_cpu_run_checks_a_large_verify_against_its_own_bar_and_binds_nothing():
    """On the CPU a verify of 65536 entries or more is held to >= 2e7 entries/s (a smaller one to
    nothing), where a GPU run holds it to no such bar; a CPU run's targets, as a scaled-down GPU
    run's, are not binding."""
    conftest = _bench_conftest()
    report = _report()
    ceilings, rows, _ = report.load(str(TARGETS_RUN))
    verify = next(r for r in rows if r["case"] == "decode_mid_batch" and r["op"] == "verify")
    for scale, device in ((1.0, "cpu"), (0.5, "cuda"), (1.0, "cuda")):
        harness = _harness(conftest, device, scale, ceilings)
        for rate, met in ((1.9e7, False), (2.1e7, True)):
            made = _targets_of(conftest, harness, dict(verify, entries_per_s=rate, entries=1 << 16))
            names = [t["name"] for t in made["targets"]]
            assert ("cpu verify entries/s" in names) == (device == "cpu")
            assert all(t["binding"] == (device == "cuda" and scale == 1.0) for t in made["targets"])
            if device == "cpu":
                assert names == ["cpu verify entries/s"] and made["targets"][0]["met"] is met
                small = _targets_of(conftest, harness, dict(verify, entries_per_s=rate, entries=(1 << 16) - 1))
                assert small["targets"] == []


# (case, op, mode, the target's name starts, met at or above the bar (else at or below), the bar (None: the
# step's raised bar from the run's ceilings), the row's fields that make its achieved value v, given the
# case ``c`` and the run's rows ``by`` (case, op, mode))
BARS = [
    ("verify_16m", "verify", "eager", "verify entries/s", True, 15e9, lambda c, row, v, by: {"entries_per_s": v}),
    ("e2e_decode_steady", "verify", "eager", "verify entries/s", True, 22e9,
     lambda c, row, v, by: {"entries_per_s": v}),
    ("e2e_decode_steady_hash", "verify", "eager", "verify entries/s", True, 5e9,
     lambda c, row, v, by: {"entries_per_s": v}),
    ("e2e_decode_steady", "step", "eager", "step verify entries/s", True, None,
     lambda c, row, v, by: {"time_us": c.n_verify / v * 1e6, "wall_us_per_call": 0.0}),
    ("verify_16m", "plan", "eager", "x faster than peer plan", True, 2,
     lambda c, row, v, by: {"time_us": c.peer_plan_us / v}),
    ("e2e_prefill_chunk_first", "write", "eager", "write ns/token", False, 100,
     lambda c, row, v, by: {"time_us": v * row["entries"] / 1e3}),
    ("e2e_decode_steady_hash", "write", "eager", "ALL-hash write", False, 1.2,
     lambda c, row, v, by: {"time_us": v * by[("e2e_decode_steady", "write", "eager")]["time_us"]}),
    ("e2e_decode_tail", "verify", "eager", "x empty kernel", False, 2, lambda c, row, v, by: {"x_empty_kernel": v}),
    ("plan_bs1024_prefix4096", "plan", "eager", "plan % copy ceiling", True, 50,
     lambda c, row, v, by: {"pct_copy_ceiling": v}),
    ("e2e_decode_tail", "step", "eager", "x faster than peer step", True, 2,
     lambda c, row, v, by: {"time_us": c.peer_us / v, "wall_us_per_call": 0.0}),
    ("e2e_decode_tail", "step", "eager", "x faster than peer step", True, 2,  # host-bound: its wall time counts
     lambda c, row, v, by: {"time_us": 1.0, "wall_us_per_call": c.peer_us / v}),
    ("e2e_decode_steady", "step", "graph", "x faster than peer step", True, 2,  # the peer's graph replay
     lambda c, row, v, by: {"time_us": c.peer_graph_us / v, "graph_wall_us": 0.0}),
    ("verify_16m", "verify", "eager", "x faster than naive", True, 5,
     lambda c, row, v, by: {"x_naive": v, "x_naive_wall": 2 * v}),
    ("verify_16m", "verify", "eager", "x faster than naive", True, 5,  # the lower of device and wall
     lambda c, row, v, by: {"x_naive": 2 * v, "x_naive_wall": v}),
]


@pytest.mark.parametrize(("case", "op", "mode", "name", "at_least", "bar", "fields"), BARS,
                         ids=[f"{b[0]}-{b[1]}-{b[2]}-{b[3]}-{i}" for i, b in enumerate(BARS)])
def test_each_target_is_met_on_its_side_of_its_bar_alone(case, op, mode, name, at_least, bar, fields):
    """The bars benchmarks/README.md states, each held at a value 1 % on either side of it."""
    conftest = _bench_conftest()
    report = _report()
    ceilings, rows, _ = report.load(str(TARGETS_RUN))
    by = {(r["case"], r["op"], r.get("mode")): r for r in rows}
    row, shape = by[(case, op, mode)], conftest.S.BY_NAME[case]
    if bar is None:
        bar = 0.85 * ceilings["gather32_entries_per_s"] / conftest._verify_sectors(shape)
    for value in (0.99 * bar, 1.01 * bar):
        harness = _harness(conftest, "cuda", 1.0, ceilings)
        twin = conftest.S.NO_HASH_TWIN.get(case)
        if twin is not None:
            harness.results[(twin, "write")] = by[(twin, "write", "eager")]["time_us"] * 1e-6
        made = _targets_of(conftest, harness, dict(row, **fields(shape, row, value, by)))
        (target,) = [t for t in made["targets"] if t["name"].startswith(name)]
        assert target["achieved"] == pytest.approx(value, rel=1e-9)
        assert target["met"] == (value >= bar if at_least else value <= bar)

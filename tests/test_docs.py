"""The README and the design notes cite committed results files for their figures: each cited file exists; and
the package names they write as ``kc.<name>`` exist."""

from __future__ import annotations

import pathlib
import re

import pytest

from _tools import import_tools

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a results path in backticks or a Markdown link, or a short form (`-swa-9e25cfb.json`) that names a
# sibling of the full path cited last: that path up to its last "-", then the short form
CITED = re.compile(r"[`(]((?:tests|benchmarks)/results/[^`)\s]+|-[A-Za-z0-9_.-]+\.(?:json|txt|md|png)(?:\.gz)?)[`)]")


def _cited(document: pathlib.Path) -> list[str]:
    """The results paths ``document`` cites, short forms resolved; paths with wildcards or ranges
    (which name several runs) left out."""
    paths, last = set(), None
    for path in CITED.findall(document.read_text(encoding="utf-8")):
        if path.startswith("-"):
            if last is None:
                continue
            path = last.rsplit("-", 1)[0] + path
        else:
            last = path
        if not re.search(r"[*\[\]–]", path):
            paths.add(path)
    return sorted(paths)


# the measured results live in the repository; a source distribution leaves them out
IN_REPOSITORY = (ROOT / "tests" / "results").is_dir() and (ROOT / "benchmarks" / "results").is_dir()
requires_results = pytest.mark.skipif(not IN_REPOSITORY, reason="results files are kept in the repository only")


@requires_results
@pytest.mark.parametrize("document", DOCUMENTS, ids=[d.name for d in DOCUMENTS])
def test_cited_results_files_exist(document):
    missing = [path for path in _cited(document) if not (ROOT / path).is_file()]
    assert not missing, f"{document.name} cites results files that are not in the repository: {missing}"


def test_the_readme_cites_results():
    cited = _cited(ROOT / "README.md")
    assert len(cited) > 10
    assert "tests/results/2026-12-01-h200-demo-swa-550d273.json" in cited  # a short form, resolved


@pytest.mark.parametrize("document", DOCUMENTS, ids=[d.name for d in DOCUMENTS])
def test_the_kc_names_a_document_uses_exist(document):
    """Every ``kc.<name>`` (and ``kc.<name>.<attribute>``) a document writes is in the package: a name
    renamed or dropped in the code would otherwise leave the docs pointing at nothing."""
    import kvcanary_cupy as kc

    missing = set()
    for dotted in re.findall(r"\bkc\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", document.read_text(encoding="utf-8")):
        target = kc
        for part in dotted.split("."):
            if not hasattr(target, part):
                missing.add(f"kc.{dotted}")
                break
            target = getattr(target, part)
    assert not missing, f"{document.name} names what kvcanary_cupy does not have: {sorted(missing)}"


@requires_results
def test_the_cpu_runs_page_is_written_from_the_results_files():
    """docs/cpu-runs.md is tools/cpu_runs.py's table of the CPU results files: a file added without
    the page written again (``python tools/cpu_runs.py --write``), or a file whose seeds do not add up,
    fails here."""
    (cpu_runs,) = import_tools("cpu_runs")
    assert cpu_runs.DOCUMENT.read_text(encoding="utf-8") == cpu_runs.render()


@requires_results
def test_the_cpu_figures_of_the_readme_and_the_results_notes_are_the_tables():
    """The seeds, faults and cases the README and docs/results.md give for the CPU runs are the sums of
    docs/cpu-runs.md, so a run added to the table without the figures moved on fails here."""
    (cpu_runs,) = import_tools("cpu_runs")
    runs = cpu_runs.read()
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    notes = " ".join((ROOT / "docs" / "results.md").read_text(encoding="utf-8").split())
    assert f"On the CPU backend, {runs.distinct_seeds:,} more seeds ran" in readme
    assert f"{runs.distinct_cases:,} random cases agreed" in readme
    assert f"On the CPU backend, {runs.distinct_seeds:,} seeds that no GPU run drew" in notes
    assert f"{runs.distinct_bounds_checked:,} of them with numba's bounds checking on" in notes
    assert f"{runs.faults:,} faults injected" in notes
    assert f"{runs.distinct_cases:,} distinct cases" in notes


def test_a_recorded_run_is_a_row_of_the_table(tmp_path):
    """``tools/cpu_runs.py --record`` writes, from a finished run's log, a file the table reads back as
    that run: a fuzz run of two parts, a bounds-checked one, an agreement run; a log of neither, or a
    name already taken, is refused."""
    (cpu_runs,) = import_tools("cpu_runs")
    totals = ("{n} seeds x 40 forwards on cpu in 1.0 s: 0 with false positives, 0 with counter mismatches, "
              "{n} faults injected (0 found no place), 0 missed, 0 misnamed, 0 crashes\n")
    fuzz = cpu_runs.record("[1/60 seeds, 1 s] 0 failing\n" + totals.format(n=60) + totals.format(n=40),
                           commit="0000000", start=500, day="2026-12-06", results=tmp_path)
    bounds = cpu_runs.record(totals.format(n=10), commit="0000000", start=600, bounds_checked=True,
                             day="2026-12-06", results=tmp_path)
    agreement = cpu_runs.record("....\n500 passed, 15 deselected in 3.10s\n", commit="0000000", start=7000,
                                note="a test", day="2026-12-06", results=tmp_path)
    runs = cpu_runs.read(tmp_path)
    assert [(r.first, r.seeds, r.forwards, r.bounds_checked, r.faults) for r in runs.fuzz] == [
        (500, 100, 40, False, 100), (600, 10, 40, True, 10)]
    assert [(a.first, a.last, a.passed, a.commit) for a in runs.agreements] == [(7000, 7099, 500, "0000000")]
    assert {fuzz.name, bounds.name, agreement.name} == {
        "2026-12-06-cpu-canary-fuzz-40f-0000000.txt", "2026-12-06-cpu-canary-fuzz-boundscheck-0000000.txt",
        "2026-12-06-cpu-reference-agreement-from7000-0000000.txt"}
    assert "none drawn by an earlier run" in agreement.read_text()
    again = cpu_runs.record(totals.format(n=5), commit="0000000", start=700, day="2026-12-06", results=tmp_path)
    assert again.name == "2026-12-06-cpu-canary-fuzz-40f-from700-0000000.txt"
    for log, rule in (("no totals here\n", "neither"), ("501 passed in 1.0s\n", "not 5 a seed")):
        with pytest.raises(ValueError, match=rule):
            cpu_runs.record(log, commit="0000000", start=1, day="2026-12-06", results=tmp_path)
    with pytest.raises(ValueError, match="exists"):
        cpu_runs.record("....\n500 passed in 3.10s\n", commit="0000000", start=7000, day="2026-12-06",
                        results=tmp_path)


@requires_results
def test_the_cpu_figures_are_carried_into_the_sentences_that_give_them(tmp_path):
    """``--write`` puts the table's totals back in the README's and the results notes' sentences, line
    breaks inside them kept, whatever figures they held."""
    (cpu_runs,) = import_tools("cpu_runs")
    copies = {path: tmp_path / path.name for path, *_ in cpu_runs.FIGURES}
    for path, copy in copies.items():
        copy.write_text(re.sub(r"\d{1,3}(?:,\d{3})+", "1", path.read_text(encoding="utf-8")), encoding="utf-8")
    figures = tuple((copies[path], *rest) for path, *rest in cpu_runs.FIGURES)
    runs = cpu_runs.read()
    assert set(cpu_runs.carry_figures(runs, figures)) == set(copies.values())
    for copy, before, after, total in figures:
        said = " ".join(copy.read_text(encoding="utf-8").split())
        assert f"{before} {getattr(runs, total):,} {after}" in said
    assert cpu_runs.carry_figures(runs, figures) == []


def test_the_cpu_runs_table_checks_that_a_file_adds_up(tmp_path):
    """A seed range its runs do not cover, or runs of other forwards, is an error, not a row."""
    (cpu_runs,) = import_tools("cpu_runs")
    header = ("date: 2026-12-06\ncommit: 0000000 (a test)\nseeds: 100-199 with 40 forwards\n"
              "command: tools/canary_fuzz.py\n")
    totals = ("{n} seeds x {f} forwards on cpu in 1.0 s: 0 with false positives, 0 with counter mismatches, "
              "{n} faults injected (0 found no place), 0 missed, 1 misnamed, 0 crashes\n")
    path = tmp_path / "2026-12-06-cpu-canary-fuzz-40f-0000000.txt"
    path.write_text(header + totals.format(n=60, f=40) + totals.format(n=40, f=40))
    (row,) = cpu_runs.fuzz_ranges(path)
    assert (row.first, row.seeds, row.forwards, row.faults, row.findings) == (100, 100, 40, 100, (0, 0, 0, 2, 0))
    for log, rule in ((totals.format(n=60, f=40), "not all run"), (totals.format(n=100, f=60), "60"),
                      (totals.format(n=100, f=40) * 2, "past the seeds")):
        path.write_text(header + log)
        with pytest.raises(ValueError, match=rule):
            cpu_runs.fuzz_ranges(path)

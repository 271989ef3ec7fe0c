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

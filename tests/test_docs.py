"""The README and the design notes cite committed results files for their figures: each cited file exists; and
the package names they write as ``kc.<name>`` exist."""

from __future__ import annotations

import pathlib
import re

import pytest

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

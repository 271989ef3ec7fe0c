"""The README and the design notes cite committed results files for their figures: each cited file exists."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a results path in backticks or a Markdown link; paths with wildcards or ranges name several runs
CITED = re.compile(r"[`(]((?:tests|benchmarks)/results/[^`)\s]+)[`)]")


def _cited(document: pathlib.Path) -> list[str]:
    text = document.read_text(encoding="utf-8")
    return sorted({path for path in CITED.findall(text) if not re.search(r"[*\[\]–]", path)})


@pytest.mark.parametrize("document", DOCUMENTS, ids=[d.name for d in DOCUMENTS])
def test_cited_results_files_exist(document):
    missing = [path for path in _cited(document) if not (ROOT / path).is_file()]
    assert not missing, f"{document.name} cites results files that are not in the repository: {missing}"


def test_the_readme_cites_results():
    assert len(_cited(ROOT / "README.md")) > 10

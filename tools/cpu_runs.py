"""The long CPU runs, one table row per seed range, read from their committed results files: the
kc.Canary fuzz (tools/canary_fuzz.py, tests/results/*-cpu-canary-fuzz*.txt) and the CPU backend
against the plain-Python model (tests/test_reference_agreement.py,
tests/results/*-cpu-reference-agreement*.txt).

docs/cpu-runs.md is what ``python tools/cpu_runs.py --write`` writes, and tests/test_docs.py checks
that it still is, so a new results file needs only this command. A file whose seed ranges do not add
up to what its runs say they ran is an error, not a row."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tests" / "results"
DOCUMENT = ROOT / "docs" / "cpu-runs.md"

# the totals line tools/canary_fuzz.py prints at the end of a run (a file of several parts has one a part)
FUZZ_TOTALS = re.compile(
    r"^(?P<seeds>\d+) seeds x (?P<forwards>\d+) forwards on cpu in [\d.]+ s: (?P<false_positives>\d+) with false "
    r"positives, (?P<counter_mismatches>\d+) with counter mismatches, (?P<faults>\d+) faults injected .*, "
    r"(?P<missed>\d+) missed, (?P<misnamed>\d+) misnamed, (?P<crashes>\d+) crashes$",
    re.MULTILINE)
# a range of canary-fuzz seeds as the header names it: "2000000-2009999 with 60 forwards", or
# "(2050000-2050999, 60 forwards)" in a file that ran the fuzz after other checks
SEED_RANGE = re.compile(r"(\d+)-(\d+)(?: with |, )(\d+) forwards")
CASES_A_SEED = 5  # a seed of the agreement test draws a case of each of its five ops
FINDINGS = ("false_positives", "counter_mismatches", "missed", "misnamed", "crashes")


@dataclasses.dataclass(frozen=True)
class FuzzRange:
    """Seeds ``first``..``first + seeds - 1`` of one results file, all run with ``forwards`` forwards."""

    path: str
    commit: str
    first: int
    seeds: int
    forwards: int
    bounds_checked: bool
    faults: int
    findings: tuple[int, ...]  # in the order of FINDINGS

    @property
    def span(self) -> tuple[int, int]:
        return self.first, self.first + self.seeds - 1


@dataclasses.dataclass(frozen=True)
class AgreementRun:
    path: str
    commit: str
    first: int
    last: int
    passed: int
    failed: int

    @property
    def span(self) -> tuple[int, int]:
        return self.first, self.last


def _header(text: str) -> dict[str, str]:
    """The ``key: value`` lines before the log, continuation lines (indented) joined to theirs."""
    header, key = {}, None
    for line in text.splitlines():
        if line.startswith("  ") and key is not None:
            header[key] += " " + line.strip()
            continue
        match = re.match(r"([a-z]+): (.*)$", line)
        if not match or line.startswith("result:"):
            break
        key = match.group(1)
        header[key] = match.group(2)
    return header


def _relative(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def fuzz_ranges(path: pathlib.Path, text: str | None = None) -> list[FuzzRange]:
    """The seed ranges ``path`` names in its ``seeds:`` line, each with the runs (parts) that cover it
    in order: a range's parts run its forwards, and their seeds add up to its size. ``text`` is the
    file's, where the caller has read it already."""
    text = path.read_text(encoding="utf-8") if text is None else text
    header = _header(text)
    runs = [match.groupdict() for match in FUZZ_TOTALS.finditer(text)]
    named = header.get("seeds", header.get("what", ""))
    spans = list(SEED_RANGE.finditer(named))
    if not spans:
        raise ValueError(f"{_relative(path)}: names no seed range")
    ranges = []
    for number, span in enumerate(spans):
        # what the header says of this range: up to the next range
        said = named[span.end():spans[number + 1].start() if number + 1 < len(spans) else None]
        first, last, forwards = map(int, span.groups())
        covered, faults, findings = 0, 0, [0] * len(FINDINGS)
        while covered < last - first + 1:
            if not runs:
                raise ValueError(f"{_relative(path)}: seeds {first}-{last} are not all run")
            run = runs.pop(0)
            if int(run["forwards"]) != forwards:
                raise ValueError(f"{_relative(path)}: seeds {first}-{last} say {forwards} forwards, "
                                 f"a run of them {run['forwards']}")
            covered += int(run["seeds"])
            faults += int(run["faults"])
            findings = [total + int(run[name]) for total, name in zip(findings, FINDINGS)]
        if covered != last - first + 1:
            raise ValueError(f"{_relative(path)}: seeds {first}-{last} run as {covered} seeds")
        ranges.append(FuzzRange(path=_relative(path), commit=header["commit"].split()[0],
                                first=first, seeds=covered, forwards=forwards,
                                bounds_checked="bounds checking" in said or "bounds" in path.name, faults=faults,
                                findings=tuple(findings)))
    if runs:
        raise ValueError(f"{_relative(path)}: {len(runs)} runs past the seeds it names")
    return ranges


def agreement_run(path: pathlib.Path) -> AgreementRun:
    text = path.read_text(encoding="utf-8")
    header = _header(text)
    first, last = map(int, re.search(r"\(seeds (\d+)-(\d+)", header["what"]).groups())
    result = re.search(r"^(?:(\d+) failed, )?(\d+) passed, .* in [\d.]+s", text, re.MULTILINE)
    if result is None:
        raise ValueError(f"{_relative(path)}: no pytest result line")
    run = AgreementRun(path=_relative(path), commit=header["commit"].split()[0].rstrip(","),
                       first=first, last=last, passed=int(result.group(2)), failed=int(result.group(1) or 0))
    if run.passed + run.failed != (last - first + 1) * CASES_A_SEED:
        raise ValueError(f"{_relative(path)}: seeds {first}-{last} ran as {run.passed + run.failed} cases")
    return run


def _fuzz_files(results: pathlib.Path) -> list[tuple[pathlib.Path, str]]:
    """The canary-fuzz files, and the bounds-checking files that ran fuzz seeds after their other
    checks, each with its text."""
    fuzz = [(p, p.read_text(encoding="utf-8")) for p in sorted(results.glob("*-cpu-canary-fuzz*.txt"))]
    bounds = [(p, text) for p in sorted(results.glob("*-cpu-bounds-*.txt"))
              if FUZZ_TOTALS.search(text := p.read_text(encoding="utf-8"))]
    return fuzz + bounds


def _check_whole(spans: list[tuple[int, int]]) -> None:
    """``spans`` (``(first, last)`` seed ranges) share seeds only by being the same range: seeds
    shared in part could not be told from the rows."""
    for a in spans:
        for b in spans:
            if a != b and a[0] <= b[1] and b[0] <= a[1]:
                raise ValueError(f"seeds {a[0]}-{a[1]} and {b[0]}-{b[1]} overlap in part")


def _distinct(spans: list[tuple[int, int]]) -> int:
    """How many seeds ``spans`` (whole ranges, see ``_check_whole``) run, each counted once."""
    return sum(last - first + 1 for first, last in set(spans))


def _times_run(spans: list[tuple[int, int]]) -> list[str]:
    """For each of ``spans`` (whole ranges), how many of them run its seeds, as a note to its row."""
    counts = [spans.count(span) for span in spans]
    return [{1: "", 2: " (run twice)"}.get(count, f" (run {count} times)") for count in counts]


def _number(value: int) -> str:
    return f"{value:,}"


@dataclasses.dataclass(frozen=True)
class CpuRuns:
    """Every canary-fuzz seed range and agreement run of the results files, in seed order."""

    fuzz: tuple[FuzzRange, ...]
    agreements: tuple[AgreementRun, ...]

    def __post_init__(self) -> None:
        _check_whole([r.span for r in self.fuzz])
        _check_whole([a.span for a in self.agreements])

    @property
    def distinct_seeds(self) -> int:
        """Canary-fuzz seeds run, each counted once."""
        return _distinct([r.span for r in self.fuzz])

    @property
    def distinct_bounds_checked(self) -> int:
        """Canary-fuzz seeds run with numba's bounds checking on, each counted once."""
        return _distinct([r.span for r in self.fuzz if r.bounds_checked])

    @property
    def faults(self) -> int:
        return sum(r.faults for r in self.fuzz)

    @property
    def distinct_cases(self) -> int:
        """Agreement cases compared, each seed's counted once."""
        return _distinct([a.span for a in self.agreements]) * CASES_A_SEED


def read(results: pathlib.Path = RESULTS) -> CpuRuns:
    fuzz = sorted((r for p, text in _fuzz_files(results) for r in fuzz_ranges(p, text)), key=lambda r: (r.first, r.path))
    agreements = sorted((agreement_run(p) for p in sorted(results.glob("*-cpu-reference-agreement*.txt"))),
                        key=lambda r: (r.first, r.path))
    return CpuRuns(fuzz=tuple(fuzz), agreements=tuple(agreements))


def render(runs: CpuRuns | None = None) -> str:
    runs = read() if runs is None else runs
    ranges, agreements = runs.fuzz, runs.agreements
    lines = [
        "# The long CPU runs",
        "",
        "Every long run of the CPU backend, one row per seed range, as its results file in `tests/results/`",
        "says it; `python tools/cpu_runs.py --write` writes this page from those files, and the test suite",
        "checks that it is current. The findings of a canary-fuzz run are what `tools/canary_fuzz.py`",
        "counts: seeds with a false positive (a violation in a clean run), seeds whose counters disagree",
        "with what the engine did, injected faults not reported (missed) or reported against a request",
        "they do not harm (misnamed), and crashes. A clean run has all five at 0. Runs with numba's bounds",
        "checking on (`NUMBA_BOUNDSCHECK=1`) would also stop at the first index out of range.",
        "A run's every-seed rows (`--json`) are kept beside its file only where the run found something;",
        "the rows of the clean runs before 1222aaa are in the git history (`git log --diff-filter=D -1",
        "-- FILE` names the commit that dropped them, its parent holds them), and a clean run's seeds",
        "run again from its range.",
        "",
        "## The canary fuzz on the CPU",
        "",
        "| first seed | seeds | forwards | bounds checked | commit | faults injected "
        "| false positives | counter mismatches | missed | misnamed | crashes | file |",
        "|---:|---:|---:|:---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r, times in zip(ranges, _times_run([r.span for r in ranges])):
        findings = " | ".join(str(value) for value in r.findings)
        lines.append(f"| {_number(r.first)} | {_number(r.seeds)}{times} | {r.forwards} | {'yes' if r.bounds_checked else ''} "
                     f"| {r.commit} | {_number(r.faults)} | {findings} | `{r.path}` |")
    totals = [sum(r.findings[i] for r in ranges) for i in range(len(FINDINGS))]
    lines += [
        f"| **all** | **{_number(sum(r.seeds for r in ranges))}** | | "
        f"{_number(sum(r.seeds for r in ranges if r.bounds_checked))} | "
        f"| **{_number(runs.faults)}** | " + " | ".join(f"**{value}**" for value in totals) + " | |",
        "",
        f"{_number(runs.distinct_seeds)} of these seeds are distinct: rows marked *run twice* ran the same seeds.",
        "",
        "## The CPU backend against the plain-Python model",
        "",
        "verify, write, plan, scatter and `copy_records` of the numba backend against `kvcanary_cupy.reference`,",
        "random cases (garbage included) compared byte for byte; each seed draws one case of each op.",
        "",
        "| seeds | commit | cases passed | failed | file |",
        "|---|---|---:|---:|---|",
    ]
    for a, times in zip(agreements, _times_run([a.span for a in agreements])):
        lines.append(f"| {_number(a.first)}–{_number(a.last)}{times} | {a.commit} | {_number(a.passed)} "
                     f"| {a.failed} | `{a.path}` |")
    lines += [
        f"| **all** | | **{_number(sum(a.passed for a in agreements))}** | **{sum(a.failed for a in agreements)}** | |",
        "",
        f"{_number(runs.distinct_cases)} of these cases are distinct ({_number(runs.distinct_cases // CASES_A_SEED)} seeds, "
        f"a case of each of the {CASES_A_SEED} ops a seed): rows marked *run twice* drew the same seeds.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {_relative(DOCUMENT)} instead of printing")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOCUMENT.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

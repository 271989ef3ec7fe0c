"""The long CPU runs, one table row per seed range, read from their committed results files: the
kc.Canary fuzz (tools/canary_fuzz.py, tests/results/*-cpu-canary-fuzz*.txt) and the CPU backend
against the plain-Python model (tests/test_reference_agreement.py,
tests/results/*-cpu-reference-agreement*.txt).

docs/cpu-runs.md is what ``python tools/cpu_runs.py --write`` writes, and tests/test_docs.py checks
that it still is; the same command carries the totals into the sentences of README.md and
docs/results.md that give them. A file whose seed ranges do not add up to what its runs say they ran
is an error, not a row.

``--record LOG`` writes a finished run's results file from its log (the canary fuzz's output, or the
agreement test's pytest output), with the header the table reads:

    python tools/cpu_runs.py --record fuzz.log --commit abc1234 --start 2840000 [--bounds-checked]
    python tools/cpu_runs.py --record agreement.log --commit abc1234 --start 5400000"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import platform
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tests" / "results"
DOCUMENT = ROOT / "docs" / "cpu-runs.md"
README = ROOT / "README.md"
NOTES = ROOT / "docs" / "results.md"

# the totals line tools/canary_fuzz.py prints at the end of a run (a file of several parts has one a part)
FUZZ_TOTALS = re.compile(
    r"^(?P<seeds>\d+) seeds x (?P<forwards>\d+) forwards on cpu in [\d.]+ s: (?P<false_positives>\d+) with false "
    r"positives, (?P<counter_mismatches>\d+) with counter mismatches, (?P<faults>\d+) faults injected .*, "
    r"(?P<missed>\d+) missed, (?P<misnamed>\d+) misnamed, (?P<crashes>\d+) crashes$",
    re.MULTILINE)
# a range of canary-fuzz seeds as the header names it: "2000000-2009999 with 60 forwards", or
# "(2050000-2050999, 60 forwards)" in a file that ran the fuzz after other checks
SEED_RANGE = re.compile(r"(\d+)-(\d+)(?: with |, )(\d+) forwards")
# the line pytest ends an agreement run with (bordered with "=" unless -q)
AGREEMENT_RESULT = re.compile(r"^=*\s*((?:(\d+) failed, )?(\d+) passed(?:, [^\n]*?)? in [\d.]+s[^\n]*?)\s*=*$",
                              re.MULTILINE)
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
    result = AGREEMENT_RESULT.search(text)
    if result is None:
        raise ValueError(f"{_relative(path)}: no pytest result line")
    run = AgreementRun(path=_relative(path), commit=header["commit"].split()[0].rstrip(","),
                       first=first, last=last, passed=int(result.group(3)), failed=int(result.group(2) or 0))
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


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether seed ranges ``a`` and ``b`` (``(first, last)``) share a seed."""
    return a[0] <= b[1] and b[0] <= a[1]


def _check_whole(spans: list[tuple[int, int]]) -> None:
    """``spans`` (``(first, last)`` seed ranges) share seeds only by being the same range: seeds
    shared in part could not be told from the rows."""
    for a in spans:
        for b in spans:
            if a != b and _overlap(a, b):
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
        "checks that it is current (`--record LOG` writes a finished run's file from its log). The findings",
        "of a canary-fuzz run are what `tools/canary_fuzz.py` counts: seeds with a false positive (a",
        "violation in a clean run), seeds whose counters disagree with what the engine did, injected faults",
        "not reported (missed) or reported against a request they do not harm (misnamed), and crashes. A",
        "clean run has all five at 0. Runs with numba's bounds checking on (`NUMBA_BOUNDSCHECK=1`) would",
        "also stop at the first index out of range.",
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


# Where README.md and docs/results.md give the totals: the words around each figure (a line break
# may fall between any two of them) and the total it is.
FIGURES = (
    (README, "On the CPU backend,", "more seeds ran", "distinct_seeds"),
    (README, "and", "random cases agreed", "distinct_cases"),
    (NOTES, "On the CPU backend,", "seeds that no GPU run drew", "distinct_seeds"),
    (NOTES, "forwards each;", "of them with numba's bounds checking on", "distinct_bounds_checked"),
    (NOTES, "machine:", "faults injected", "faults"),
    (NOTES, "have all agreed,", "distinct cases", "distinct_cases"),
)


def _words(text: str) -> str:
    return r"\s+".join(map(re.escape, text.split()))


def carry_figures(runs: CpuRuns, figures: tuple = FIGURES) -> list[pathlib.Path]:
    """Puts ``runs``' totals in the sentences ``figures`` names; the documents it changed."""
    changed = []
    for path in dict.fromkeys(path for path, *_ in figures):
        text = original = path.read_text(encoding="utf-8")
        for _, before, after, total in (f for f in figures if f[0] == path):
            pattern = re.compile(rf"({_words(before)}\s+)[\d,]+(\s+{_words(after)})")
            text, found = pattern.subn(lambda m: f"{m.group(1)}{getattr(runs, total):,}{m.group(2)}", text)
            if found != 1:
                raise ValueError(f"{_relative(path)}: '{before} N {after}' found {found} times, not once")
        if text != original:
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def _machine() -> str:
    model = platform.processor() or platform.machine()
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        model = found.group(1).strip() if found else model
    import numba
    import numpy

    return f"{os.cpu_count()} cores ({model}), numba {numba.__version__}, numpy {numpy.__version__}"


def _fuzz_record(totals: list, *, start: int, bounds_checked: bool) -> tuple[str, list[str]]:
    """A canary-fuzz run's file name (past the date) and the header lines past its commit."""
    seeds, forwards = sum(int(t["seeds"]) for t in totals), int(totals[0]["forwards"])
    checks = (", numba bounds checking on (NUMBA_BOUNDSCHECK=1, a numba cache of its own so that every build is"
              " made with it)" if bounds_checked else "")
    command = (("NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR=<empty dir> " if bounds_checked else "")
               + f"PYTHONPATH=. python tools/canary_fuzz.py --device cpu --seeds {seeds} --start {start} "
               f"--forwards {forwards} --brief-rows --json part.json.xz")
    return (f"cpu-canary-fuzz-{'boundscheck' if bounds_checked else f'{forwards}f'}",
            [f"seeds: {start}-{start + seeds - 1} with {forwards} forwards{checks}", f"cpu: {_machine()}",
             f"command: {command}"])


def _agreement_record(result: re.Match, *, start: int, results: pathlib.Path) -> tuple[str, list[str]]:
    """An agreement run's file name (past the date) and the header lines past its commit."""
    cases = int(result.group(2) or 0) + int(result.group(3))
    if cases % CASES_A_SEED:
        raise ValueError(f"{cases} cases are not {CASES_A_SEED} a seed")
    first, last = start, start + cases // CASES_A_SEED - 1
    fresh = not any(_overlap((first, last), run.span) for run in read(results).agreements)
    command = (f"KVCANARY_AGREEMENT_FIRST_SEED={start} KVCANARY_AGREEMENT_SEEDS={last - first + 1} PYTHONPATH=. "
               "python -m pytest tests/test_reference_agreement.py -q -p no:cacheprovider -k \"agrees and not large"
               " and not parallel and not any_non_zero and not past_the and not padding\"")
    return (f"cpu-reference-agreement-from{start}",
            [f"cpu: {_machine()}", f"command: {command}",
             "what: verify, write, plan, scatter and copy_records of the numba CPU backend against the plain-Python"
             " model (kvcanary_cupy.reference),",
             f"      {last - first + 1:,} random cases an op (seeds {first}-{last}"
             f"{', none drawn by an earlier run' if fresh else ''}), garbage included, compared byte for byte",
             "result:"])


def record(log: str, *, commit: str, start: int, bounds_checked: bool = False, note: str = "",
           day: str | None = None, results: pathlib.Path = RESULTS) -> pathlib.Path:
    """Writes the results file of one finished run from its log: a canary-fuzz run (its totals lines
    say how many seeds of how many forwards) or an agreement run (its pytest line, a case of each
    op a seed). Refuses a log that holds neither, and a name already taken."""
    day = day or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    totals, result = list(FUZZ_TOTALS.finditer(log)), AGREEMENT_RESULT.search(log)
    if totals:
        name, lines = _fuzz_record(totals, start=start, bounds_checked=bounds_checked)
        body = log
    elif result:
        name, lines = _agreement_record(result, start=start, results=results)
        body = result.group(1) + "\n"
    else:
        raise ValueError("the log holds neither a canary-fuzz totals line nor a pytest result line")
    path = results / f"{day}-{name}-{commit}.txt"
    if path.exists() and "-from" not in name:  # a second run at one commit
        path = results / f"{day}-{name}-from{start}-{commit}.txt"
    if path.exists():
        raise ValueError(f"{_relative(path)} exists")
    header = [f"date: {day}", f"commit: {commit}" + (f" ({note})" if note else ""), *lines]
    path.write_text("\n".join(header) + "\n" + body, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help=f"write {_relative(DOCUMENT)} instead of printing, and carry its totals into "
                             f"{_relative(README)} and {_relative(NOTES)}")
    parser.add_argument("--record", metavar="LOG", help="write the results file of the finished run whose log this is")
    parser.add_argument("--commit", help="with --record: the commit the run ran")
    parser.add_argument("--start", type=int, help="with --record: the run's first seed")
    parser.add_argument("--bounds-checked", action="store_true", help="with --record: a fuzz run with NUMBA_BOUNDSCHECK=1")
    parser.add_argument("--note", default="", help="with --record: said of the commit, in brackets")
    args = parser.parse_args(argv)
    if args.record:
        if not args.commit or args.start is None:
            parser.error("--record needs --commit and --start")
        path = record(pathlib.Path(args.record).read_text(encoding="utf-8"), commit=args.commit, start=args.start,
                      bounds_checked=args.bounds_checked, note=args.note)
        print(_relative(path))
        return 0
    runs = read()
    text = render(runs)
    if args.write:
        DOCUMENT.write_text(text, encoding="utf-8")
        for path in carry_figures(runs):
            print(f"{_relative(path)}: figures carried")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How well the tests guard the host side: small deliberate changes to the package's Python, one
at a time, each run against the tests that should notice it. No GPU is needed but for the CUDA tests.

    python tools/host_mutants.py --json out.json                      # kvcanary_cupy/validate/rules.py
    python tools/host_mutants.py --files kvcanary_cupy/ops/write.py --tests tests/test_write.py
    python tools/host_mutants.py --list
    python tools/host_mutants.py --replay out.json --tests tests --json again.json
    python tools/host_mutants.py --replay out.json --tests tests -k "cuda or gpu" --confirm  # on a GPU machine
    python tools/host_mutants.py --replay out.json --tests tests/test_step.py -m gpu --confirm  # a file's GPU tests
    python tools/host_mutants.py --files kvcanary_cupy/session.py --lines 444 647 --tests tests/test_session.py
    python tools/host_mutants.py --files kvcanary_cupy/ops/step.py --skip sample.json --json rest.json

A change flips one comparison (``<`` and ``<=``, ``==`` and ``!=``, ``in`` and ``not in``, ``is``
and ``is not``), swaps ``and`` and ``or``, drops a ``not``, or turns a ``raise`` into ``pass``;
``--arithmetic`` runs instead the changes of one arithmetic or bitwise operator (``+`` and ``-``,
``*`` and ``//``, ``<<`` and ``>>``, ``&`` and ``|``) in an expression of numbers or an augmented
assignment.
Every such place of the files given is a candidate; ``--mutants`` of them are drawn with ``--seed``
(all of them by default) and judged in the order drawn. Each worker owns a copy of the package and
the tests (the files' numba caches copied with their sources' times, so the CPU backend loads
instead of compiling), changes one line of its copy, and runs ``pytest -x`` over ``--tests`` there.
Verdicts: ``tests`` (a test failed: caught), ``hang`` (past ``--timeout``: caught), ``stillborn``
(the changed file does not compile; not counted), ``unjudged`` (a test failed for want of device
memory, which workers sharing one GPU can exhaust: the device, not the change; not counted, and
``--replay`` takes it again, best with fewer workers) and ``survived``: either equivalent (no input
can tell it apart) or a gap in the tests, which the results file says change by change.

A test that fails now and then (a GPU shared by several workers can make a graph capture fail
for want of memory, in other words than an allocation's) would call a change caught that is not.
``--confirm`` runs each catch's first failing test alone twice more, with the change and without:
the catch stands only where the test fails with the change and passes without it; otherwise the
change is ``unjudged``, and the row says which run disagreed.

A row of an earlier run names its change by line and by text. Where the file has moved since,
``--replay`` and ``--skip`` find the change by its text (the nearest of the same text, one change
per row), so a run's survivors can be judged again, or the rest of a sample drawn, after the file
has been edited.
"""

from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_FILES = ("kvcanary_cupy/validate/rules.py",)
DEFAULT_TESTS = ("tests/test_validation.py", "tests/test_api.py", "tests/test_capacities.py",
                 "tests/test_block_tables.py", "tests/test_dlpack.py")
# each comparison's text and the text it is flipped to
COMPARE_FLIPS = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
                 ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.In: ("in", "not in"),
                 ast.NotIn: ("not in", "in"), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is")}
# with --arithmetic: each arithmetic or bitwise operator's text and the text it is turned to
ARITHMETIC_FLIPS = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "//"), ast.FloorDiv: ("//", "*"),
                    ast.Mod: ("%", "//"), ast.LShift: ("<<", ">>"), ast.RShift: (">>", "<<"),
                    ast.BitAnd: ("&", "|"), ast.BitOr: ("|", "&"), ast.BitXor: ("^", "|")}
ARITHMETIC_OPERATORS = {text for pair in ARITHMETIC_FLIPS.values() for text in (pair[0], pair[0] + "=")}
# operands that make an arithmetic operator a string's or a sequence's: a change would fail on its
# first use, which says nothing of the tests
_NOT_NUMBERS = (ast.JoinedStr, ast.List, ast.Tuple, ast.ListComp, ast.Dict, ast.Set)


@dataclasses.dataclass(frozen=True)
class Change:
    """One change: bytes [start, end) of ``filename`` replaced by ``after_text``."""

    ident: int
    filename: str
    line: int
    operator: str
    start: int
    end: int
    after_text: str

    def apply(self, source: bytes) -> bytes:
        return source[:self.start] + self.after_text.encode() + source[self.end:]


def _line_starts(source: bytes) -> list[int]:
    starts, offset = [0], 0
    for line in source.splitlines(keepends=True):
        offset += len(line)
        starts.append(offset)
    return starts


def _operator_span(source: bytes, start: int, end: int, wanted: set[str]) -> tuple[int, int] | None:
    """The byte span of the operator in ``source[start:end]``, the gap between two operands, where
    its text is in ``wanted``; ``not in`` and ``is not`` are two words. Besides the operator a gap
    holds only parentheses, space, line continuations and comments (the tokenizer refuses a gap's
    unbalanced parentheses)."""
    gap = re.sub(r"#[^\n]*", lambda comment: " " * len(comment.group()), source[start:end].decode())
    first = re.search(r"[^\s()\\]+", gap)
    if first is None:
        return None
    text, stop = first.group(), first.end()
    second = re.match(r"\s+(in|not)\b", gap[stop:]) if text in ("not", "is") else None
    if second is not None:
        text, stop = f"{text} {second.group(1)}", stop + second.end()
    if text not in wanted:
        return None
    return start + len(gap[:first.start()].encode()), start + len(gap[:stop].encode())


def _annotation_nodes(tree: ast.AST) -> set[int]:
    """The ids of every node inside an annotation (``int | None`` is no arithmetic)."""
    annotations = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            annotations += [a.annotation for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                                                   arguments.vararg, arguments.kwarg) if a is not None]
            annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
    return {id(inner) for annotation in annotations if annotation is not None for inner in ast.walk(annotation)}


def _numeric(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    return not isinstance(node, _NOT_NUMBERS)


def candidates(filename: str, source: bytes, first_ident: int = 0, kinds=("logic",)) -> list[Change]:
    """Every change of one file of ``kinds``, in source order: ``logic`` (comparisons, ``and`` and
    ``or``, ``not``, ``raise``) and ``arithmetic`` (arithmetic and bitwise operators, in expressions
    and augmented assignments)."""
    tree = ast.parse(source)
    starts = _line_starts(source)
    logic, arithmetic = "logic" in kinds, "arithmetic" in kinds
    in_annotations = _annotation_nodes(tree) if arithmetic else set()

    def at(lineno: int, col: int) -> int:
        return starts[lineno - 1] + col

    found = []

    def add(line: int, operator: str, span: tuple[int, int] | None, after_text: str) -> None:
        if span is not None:
            found.append((span[0], line, operator, span[1], after_text))

    for node in ast.walk(tree):
        if logic and isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands, operands[1:]):
                if type(op) not in COMPARE_FLIPS:
                    continue
                before, flip = COMPARE_FLIPS[type(op)]
                span = _operator_span(source, at(left.end_lineno, left.end_col_offset),
                                      at(right.lineno, right.col_offset), {before})
                add(left.end_lineno, before, span, flip)
        elif logic and isinstance(node, ast.BoolOp):
            word = "and" if isinstance(node.op, ast.And) else "or"
            for left, right in zip(node.values, node.values[1:]):
                span = _operator_span(source, at(left.end_lineno, left.end_col_offset),
                                      at(right.lineno, right.col_offset), {word})
                add(left.end_lineno, word, span, "or" if word == "and" else "and")
        elif logic and isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            first = at(node.lineno, node.col_offset)
            word = source[first:first + 4]
            # the word and one space: a parenthesised operand keeps its parenthesis
            add(node.lineno, "not", (first, first + 4) if word in (b"not ", b"not(") else None,
                "" if word == b"not " else "(")
        elif (arithmetic and isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC_FLIPS
              and id(node) not in in_annotations and _numeric(node.left) and _numeric(node.right)):
            before, flip = ARITHMETIC_FLIPS[type(node.op)]
            span = _operator_span(source, at(node.left.end_lineno, node.left.end_col_offset),
                                  at(node.right.lineno, node.right.col_offset), {before})
            add(node.left.end_lineno, before, span, flip)
        elif arithmetic and isinstance(node, ast.AugAssign) and type(node.op) in ARITHMETIC_FLIPS:
            before, flip = (text + "=" for text in ARITHMETIC_FLIPS[type(node.op)])
            span = _operator_span(source, at(node.target.end_lineno, node.target.end_col_offset),
                                  at(node.value.lineno, node.value.col_offset), {before})
            add(node.target.end_lineno, before, span, flip)
        elif logic and isinstance(node, ast.Raise) and node.exc is not None:
            span = (at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset))
            # the lines the raise spanned stay, empty, so every later line keeps its number
            add(node.lineno, "raise", span, "pass" + "\n" * (node.end_lineno - node.lineno))
    found.sort()
    return [Change(first_ident + i, filename, line, operator, start, end, after)
            for i, (start, line, operator, end, after) in enumerate(found)]


def line_text(source: bytes, line: int) -> str:
    return source.splitlines()[line - 1].decode().strip()


def changed_line(changed: bytes, line: int) -> str:
    """Line ``line`` of a changed source (``(empty)`` where a dropped ``raise`` leaves nothing), as
    rows record it and ``--replay`` matches it."""
    return line_text(changed, line) or "(empty)"


def _copy_tree(destination: pathlib.Path) -> None:
    """The package (its numba caches with their sources' times), the tests and what they read (the
    docs, the examples, the tools and benchmarks), without committed results."""
    for name in ("kvcanary_cupy", "tests", "docs", "examples", "tools", "benchmarks"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, destination / name, copy_function=shutil.copy2,
                            ignore=shutil.ignore_patterns("results", ".benchmarks"))
    for path in ROOT.iterdir():
        if path.is_file():
            shutil.copy2(path, destination / path.name)


def run_tests(workdir: pathlib.Path, tests: list[str], timeout: float) -> tuple[str, str]:
    """(verdict, the last lines of pytest's output) for the copy in ``workdir``; ``tests`` may
    hold pytest's options too."""
    env = dict(os.environ, PYTHONPATH=str(workdir), PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang", ""
    output = done.stdout + done.stderr
    return verdict_of(done.returncode, output), "\n".join(output.strip().splitlines()[-6:])


# What CuPy, PyTorch and the CUDA runtime and driver say (lower-cased) when an allocation fails.
OUT_OF_MEMORY = ("outofmemory", "out of memory", "cuda_error_out_of_memory", "cudaerrormemoryallocation")


# The verdicts --replay judges again (and a run lists at its end).
REPLAYED = ("survived", "unjudged")


def matching(changes: list[Change], originals: dict, rows: list[dict]) -> list[Change]:
    """The changes that ``rows`` of earlier runs name, in source order: the change at a row's line
    where its text is still there, otherwise the nearest change of the row's text (the line it
    changes, and how) that no other row took. Rows of several runs that name one change take it
    once."""
    def text(change: Change) -> tuple:
        source = originals[change.filename]
        return (change.filename, change.operator, line_text(source, change.line),
                changed_line(change.apply(source), change.line))

    texts = {change: text(change) for change in changes}
    by_line = {(change.filename, change.line, change.operator, texts[change][3]): change for change in changes}
    # runs that judged the same change name it once
    named = {(row["filename"], row["line"], row["operator"], row["after"]): row for row in rows}
    taken: set[Change] = set()
    moved = []
    for key, row in named.items():
        change = by_line.get(key)
        if change is None:
            moved.append(row)
        else:
            taken.add(change)
    for row in moved:
        wanted = (row["filename"], row["operator"], row.get("before"), row["after"])
        alike = [change for change in changes if change not in taken and texts[change] == wanted]
        if alike:
            taken.add(min(alike, key=lambda change: abs(change.line - row["line"])))
    return sorted(taken, key=lambda change: change.ident)


def verdict_of(returncode: int, output: str) -> str:
    """A finished pytest run's verdict: ``unjudged`` where a failure ran out of device memory."""
    if returncode == 0:
        return "survived"
    return "unjudged" if any(sign in output.lower() for sign in OUT_OF_MEMORY) else "tests"


_OUTCOME = {"tests": "failed", "hang": "hung", "survived": "passed", "unjudged": "ran out of device memory"}
FAILED_TEST = re.compile(r"^(?:FAILED|ERROR) (\S+?\.py::[^\[\s]+(?:\[[^\]]*\])?)", re.MULTILINE)


def confirmed(workdir: pathlib.Path, target: pathlib.Path, original: bytes, tail: str, timeout: float) -> tuple[str, str]:
    """(verdict, what was seen) for a catch: its first failing test, named in ``tail``, run alone
    in ``workdir`` with the change in place (as it is on entry) and then without it."""
    found = FAILED_TEST.search(tail)
    if not found:
        return "tests", "no failing test named"
    test = found.group(1)
    again, _ = run_tests(workdir, [test], timeout)
    if again not in ("tests", "hang"):
        return "unjudged", f"{test} {_OUTCOME[again]} when run again with the change"
    target.write_bytes(original)
    without, _ = run_tests(workdir, [test], timeout)
    if without != "survived":
        return "unjudged", f"{test} {_OUTCOME[without]} without the change"
    return "tests", f"{test} failed again with the change and passed without it"


def judge(change: Change, workers: "queue.Queue[pathlib.Path]", originals: dict, tests: list[str],
          timeout: float, confirm: bool = False) -> dict:
    workdir = workers.get()
    target = workdir / change.filename
    try:
        changed = change.apply(originals[change.filename])
        row = {"ident": change.ident, "filename": change.filename, "line": change.line,
               "operator": change.operator, "before": line_text(originals[change.filename], change.line),
               "after": changed_line(changed, change.line)}
        try:
            compile(changed, change.filename, "exec")
        except SyntaxError as error:
            return {**row, "verdict": "stillborn", "tail": str(error), "seconds": 0.0}
        target.write_bytes(changed)
        started = time.monotonic()
        verdict, tail = run_tests(workdir, tests, timeout)
        if confirm and verdict == "tests":
            verdict, row["confirmed"] = confirmed(workdir, target, originals[change.filename], tail, timeout)
        return {**row, "verdict": verdict, "tail": tail[-600:], "seconds": round(time.monotonic() - started, 1)}
    finally:
        target.write_bytes(originals[change.filename])
        workers.put(workdir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--files", nargs="+",
                        help="Python files of the package to change (default: with --replay, the files of its rows; "
                             f"otherwise {', '.join(DEFAULT_FILES)})")
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS), help="the test files each change runs")
    parser.add_argument("-k", "--keyword", help="pytest's -k: only the tests whose names match (e.g. \"cuda or gpu\")")
    parser.add_argument("-m", "--marker", help="pytest's -m: only the tests so marked (e.g. \"gpu\")")
    parser.add_argument("--mutants", type=int, default=0, help="how many changes to draw (0: all, in source order)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one change's tests")
    parser.add_argument("--json", help="write every change's verdict here (rewritten as they come)")
    parser.add_argument("--replay", nargs="+", metavar="JSON",
                        help="judge again the changes that survived these earlier --json runs "
                             "or that they left unjudged")
    parser.add_argument("--skip", nargs="+", metavar="JSON",
                        help="leave out the changes these earlier --json runs judged (to draw the rest of a sample)")
    parser.add_argument("--lines", nargs="+", type=int, metavar="LINE",
                        help="only the candidates on these lines (of the files given)")
    parser.add_argument("--confirm", action="store_true",
                        help="run each catch's first failing test again alone, with the change and without; "
                             "a catch that does not repeat, or that fails without the change, is unjudged")
    parser.add_argument("--arithmetic", action="store_true",
                        help="change arithmetic and bitwise operators instead (+ and -, * and //, %% to //, << and >>, "
                             "& and |, ^ to |; each also in an augmented assignment); --replay takes the kinds "
                             "of its rows")
    parser.add_argument("--list", action="store_true", help="list the candidates and run nothing")
    args = parser.parse_args(argv)
    tests = [*args.tests, *(("-k", args.keyword) if args.keyword else ()),
             *(("-m", args.marker) if args.marker else ())]

    earlier = _rows_of(args.replay or ())
    if not args.files:
        args.files = sorted({row["filename"] for row in earlier}) if earlier else list(DEFAULT_FILES)
    if earlier:  # the kinds of the rows replayed
        kinds = {"arithmetic" if row["operator"] in ARITHMETIC_OPERATORS else "logic" for row in earlier}
    else:
        kinds = {"arithmetic" if args.arithmetic else "logic"}
    originals = {name: (ROOT / name).read_bytes() for name in args.files}
    changes = []
    for name in args.files:
        changes += candidates(name, originals[name], first_ident=len(changes), kinds=kinds)
    if args.lines:
        lines = set(args.lines)
        changes = [change for change in changes if change.line in lines]
    if args.skip:
        left_out = set(matching(changes, originals, _rows_of(args.skip)))
        changes = [change for change in changes if change not in left_out]
    if args.list:
        for change in changes:
            before = line_text(originals[change.filename], change.line)
            print(f"{change.filename}:{change.line} [{change.operator}] {before}")
        print(f"{len(changes)} candidates")
        return 0
    if args.replay:
        drawn = matching(changes, originals, [row for row in earlier if row["verdict"] in REPLAYED])
    elif 0 < args.mutants < len(changes):
        drawn = random.Random(args.seed).sample(changes, args.mutants)
    else:
        drawn = changes

    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="host-mutants-") as scratch:
        workers: queue.Queue = queue.Queue()
        for k in range(args.workers):
            workdir = pathlib.Path(scratch) / f"w{k}"
            _copy_tree(workdir)
            workers.put(workdir)
        baseline, tail = run_tests(workers.queue[0], tests, args.timeout)
        if baseline != "survived":
            print(f"the unchanged sources fail their tests ({baseline}):\n{tail}", file=sys.stderr)
            return 1
        print(f"[{time.monotonic() - started:.0f} s] unchanged sources pass; {len(drawn)} changes, "
              f"{args.workers} workers", flush=True)
        with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
            futures = [pool.submit(judge, change, workers, originals, tests, args.timeout, args.confirm) for change in drawn]
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                row = future.result()
                rows.append(row)
                print(f"[{time.monotonic() - started:.0f} s] {done}/{len(drawn)} {row['filename']}:{row['line']} "
                      f"[{row['operator']}] {row['verdict']}", flush=True)
                if args.json:
                    _write_json(args, rows, started)
    summary = _summary(args, rows, started)
    print(json.dumps(summary))
    for row in sorted(rows, key=lambda r: r["ident"]):
        if row["verdict"] in REPLAYED:
            print(f"{row['verdict']} {row['filename']}:{row['line']} [{row['operator']}] {row['after']}")
    if args.json:
        _write_json(args, rows, started)
    return 0


def _rows_of(paths) -> list[dict]:
    """Every row of the earlier --json runs at ``paths``."""
    return [row for path in paths for row in json.loads(pathlib.Path(path).read_text())["rows"]]


def _summary(args, rows: list, started: float) -> dict:
    verdicts = collections.Counter(row["verdict"] for row in rows)
    return {"files": args.files, "tests": args.tests, "keyword": args.keyword,
            "marker": args.marker, "seed": args.seed,
            "drawn": args.mutants or "all", "judged": len(rows), "verdicts": dict(verdicts),
            "wall_s": round(time.monotonic() - started, 1)}


def _write_json(args, rows: list, started: float) -> None:
    payload = {"summary": _summary(args, rows, started), "rows": sorted(rows, key=lambda r: r["ident"])}
    pathlib.Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())

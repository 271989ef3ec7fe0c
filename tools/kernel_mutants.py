"""How well the GPU checks guard the CUDA sources: small deliberate changes to the kernels, one at a
time, each run against the checks that should notice it.

    python tools/kernel_mutants.py --mutants 150 --workers 8 --json out.json      # needs a GPU
    python tools/kernel_mutants.py --list                                         # no GPU needed

A change flips one comparison (``<`` and ``<=``, ``==`` and ``!=``, ...), swaps ``&&`` and ``||``,
turns a binary ``+`` into ``-`` or the reverse, or drops one statement that stores, counts or calls.
The candidates are every such place in ``kvcanary_cupy/rawkernels`` outside comments and preprocessor
lines; ``--mutants`` of them are drawn with ``--seed`` and judged in the order drawn. Each worker
owns a copy of the kernel sources (the package's Python is the repository's), so the unchanged
sources of its copy compile once and then load from CuPy's cache.

Each change runs the differential fuzz (``tools/differential_fuzz.py``) of the ops its file feeds,
with the write's three forced forms for the write's sources; the session kernels run the session
fuzz (``tools/canary_fuzz.py``) and the block-table kernels their GPU tests. A change that survives
the fuzz then runs, where asked, the fuzz again under compute-sanitizer (``--memcheck``: every array
an allocation of its own size; ``--racecheck``: shared memory that two warps reach in no fixed
order; ``--synccheck``: a barrier or warp primitive that names threads which do not reach it), then
the GPU tests of its ops. ``--stale-shared`` runs every fuzz with ``tools/differential_fuzz.py
--stale-shared``: each kernel over shared memory left full of non-zero words, where a change that
reads a shared word it never stored shows.
Verdicts: ``fuzz``, ``memcheck``, ``racecheck``, ``synccheck``, ``tests`` (caught by that check),
``hang`` (a check ran past ``--timeout``, counted as caught where the same check on the unchanged
sources ends within it), ``stillborn`` (NVRTC refused it, or crashed compiling
it; not counted), ``unfinished`` (cut short by ``--limit``, not started before ``--deadline``, or its
check runs past ``--timeout`` on the unchanged sources too, as the GPU tests of a much-included
header may on a card that many workers share; not counted, and ``--replay`` takes it: ``--replay
--unfinished`` takes these alone), ``unjudged`` (a check's process crashed, and it crashes on
the unchanged sources too: the check, not the change, is at fault; the change is judged once more a
little later while the deadline allows, the first try kept in its row as ``first_try``; still so, it
is not counted, and ``--replay`` takes it again) and ``survived``.
A check whose process crashes (killed by a signal, or Python's fatal error; a sanitizer's check
that fails with no error of its own found) catches the change only where the same check passes on
the unchanged sources; the row's ``crash`` holds the crash's first lines and the signal. A
survivor is either equivalent (no input can tell it apart) or a gap in the checks; the results file
says which, change by change. Each survivor's row also says whether its kernel images are the
unchanged ones (``images``: ``same``, ``changed``, or ``unknown`` without NVRTC; see ``--cubins``).

    python tools/kernel_mutants.py --replay out.json --cubins                    # no GPU needed
    python tools/kernel_mutants.py --replay out.json --survived --memcheck --no-tests   # survivors, memcheck

``--cubins`` runs no check: it compiles each change with NVRTC (``cuda-bindings``) for sm_80 and
sm_90 and says whether every kernel image of the sources that include its file is byte for byte
the unchanged sources' (``same``: equivalent as compiled, whatever the checks) or which differ.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import importlib
import json
import os
import pathlib
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

REPO = pathlib.Path(__file__).resolve().parents[1]
KERNELS = "kvcanary_cupy/rawkernels"
# the survivors' images are compiled by the package's own loader, from this checkout whether or not
# it is installed or on PYTHONPATH (the checks' processes are given the same path)
sys.path.insert(0, str(REPO))

# What each source feeds: the fuzz's ops, and the GPU test files that exercise it.
OPS_BY_FILE = {
    "canary_common.cuh": ("verify", "write", "plan", "scatter", "step", "records"),
    "verify_entry.cuh": ("verify", "step"),
    "verify.cu": ("verify",),
    "write_request.cuh": ("write", "step"),
    "write.cu": ("write",),
    "write_decode.cu": ("write",),
    "batch_plan.cuh": ("plan", "step"),
    "plan.cu": ("plan",),
    "scatter.cu": ("scatter",),
    "step.cu": ("step",),
    "records.cu": ("records",),
    "session.cu": (),
    "block_tables.cu": (),
}
TESTS_BY_OP = {
    "verify": "tests/test_verify.py",
    "write": "tests/test_write.py",
    "plan": "tests/test_plan.py",
    "scatter": "tests/test_scatter.py",
    "step": "tests/test_step.py",
    "records": "tests/test_copy_records.py",
}
WRITE_SOURCES = ("write_request.cuh", "write.cu", "write_decode.cu", "canary_common.cuh")

SWAPS = {" < ": " <= ", " <= ": " < ", " > ": " >= ", " >= ": " > ", " == ": " != ", " != ": " == ",
         " && ": " || ", " || ": " && ", " + ": " - ", " - ": " + "}
SWAP_PATTERN = re.compile("|".join(re.escape(token) for token in SWAPS))
# A whole statement that stores, counts or calls: dropped by the deletion operator. Declarations
# (a type before the name) do not match: the name must start the statement.
STATEMENT = re.compile(r"^\s*(?:atomic\w+\(|kvc_\w+\(|\*?[A-Za-z_][\w.\[\]>-]*\s*(?:=|\+=|\|=|&=)\s)[^;]*;\s*$")
SKIPPED_LINE = re.compile(r"^\s*(#|//|\*|/\*|static_assert|template|namespace|constexpr)")


@dataclasses.dataclass(frozen=True)
class Mutant:
    ident: int
    filename: str
    line: int         # 1-based
    before: str
    after: str
    operator: str     # the token swapped, or "drop"


def candidates() -> list[Mutant]:
    """Every single-place change of every source, in file and line order."""
    found = []
    for path in sorted((REPO / KERNELS).glob("*.cu*")):
        in_block_comment = False
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if "/*" in text and "*/" not in text:
                in_block_comment = True
            if in_block_comment:
                in_block_comment = "*/" not in text
                continue
            if SKIPPED_LINE.match(text):
                continue
            code, _, comment = text.partition("//")
            tail = "//" + comment if comment else ""
            for match in SWAP_PATTERN.finditer(code):
                token = match.group(0)
                changed = code[:match.start()] + SWAPS[token] + code[match.end():]
                found.append((path.name, number, text, changed + tail, token.strip()))
            if STATEMENT.match(code) and not code.rstrip().endswith("{"):
                indent = code[:len(code) - len(code.lstrip())]
                found.append((path.name, number, text, indent + ";  // dropped", "drop"))
    return [Mutant(i, *fields) for i, fields in enumerate(found)]


@dataclasses.dataclass(frozen=True)
class Checks:
    """Which checks a change runs, in order, the first that fails giving the verdict."""

    cases: int            # differential fuzz cases an op
    memcheck: bool        # the fuzz again under compute-sanitizer's memcheck, exact allocations
    tests: bool           # the GPU tests of the change's ops
    racecheck: bool = False  # the fuzz again under racecheck: shared-memory accesses of two warps unordered
    synccheck: bool = False  # the fuzz again under synccheck: barriers and warp primitives missing threads
    stale_shared: bool = False  # every fuzz's kernels over shared memory full of non-zero words

    def commands(self, mutant: Mutant, seed: int) -> list:
        """(verdict if it fails, name, argv) for each check of ``mutant``."""
        python = sys.executable
        ops = OPS_BY_FILE[mutant.filename]
        pytest = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "cuda or gpu"]
        def sanitizer(tool: str) -> list:
            padding = memcheck_padding() if tool == "memcheck" else ()
            # the default 10 s for the target to first touch CUDA is short on a card many workers share
            return ["compute-sanitizer", "--tool", tool, "--error-exitcode", "1", "--launch-timeout", "300", *padding]
        stages = []
        if ops:
            def fuzz_seeded(fuzz_seed: int) -> list:
                stale = ["--stale-shared"] if self.stale_shared else []
                return [python, "tools/differential_fuzz.py", "--seed", str(fuzz_seed), *stale, "--ops"]

            fuzz = fuzz_seeded(seed)
            stages.append(("fuzz", "fuzz " + " ".join(ops), fuzz + [*ops, "--cases", str(self.cases)]))
            if mutant.filename in WRITE_SOURCES:
                for offset, team in enumerate(("thread", "one", "two"), start=1):
                    # cases of their own: the fuzz seeds each op's cases from (seed, op), so the
                    # same seed would give each form the first cases of the run above again
                    stages.append(("fuzz", f"fuzz write {team}",
                                   fuzz_seeded(seed + 100_000 * offset) + ["write", "--write-team", team,
                                                                           "--cases", str(max(1, self.cases // 2))]))
            small_fuzz = [*fuzz, *ops, "--cases", "20", "--max-entries", "20000", "--large-every", "10"]  # sanitizers are slow
            for tool, wanted in (("memcheck", self.memcheck), ("racecheck", self.racecheck),
                                 ("synccheck", self.synccheck)):
                if wanted:
                    stages.append((tool, f"{tool} fuzz " + " ".join(ops),
                                   [*sanitizer(tool), *small_fuzz, "--exact-allocations"]))
        elif mutant.filename == "session.cu":
            session_fuzz = [python, "tools/canary_fuzz.py", "--device", "cuda", "--start", str(seed)]
            stages.append(("fuzz", "canary fuzz", session_fuzz + ["--seeds", "12", "--forwards", "40"]))
            if self.memcheck:
                stages.append(("memcheck", "memcheck canary fuzz",
                               [*sanitizer("memcheck"), *session_fuzz, "--seeds", "4", "--forwards", "30", "--exact-allocations"]))
        if mutant.filename == "block_tables.cu":
            stages.append(("tests", "tests", pytest + ["tests/test_block_tables.py"]))
        elif self.tests and mutant.filename == "session.cu":
            stages.append(("tests", "tests", pytest + ["tests/test_session.py", "tests/test_session_poll.py"]))
        elif self.tests:
            stages.append(("tests", "tests", pytest + sorted({TESTS_BY_OP[op] for op in ops})))
        return stages


@functools.lru_cache(maxsize=None)
def memcheck_padding() -> tuple[str, ...]:
    """compute-sanitizer's gap after each allocation, where its version has the option: a read one
    past an array's end then lands in no allocation, whatever the next cudaMalloc returned."""
    try:
        shown = subprocess.run(["compute-sanitizer", "--help"], capture_output=True, text=True)
    except FileNotFoundError:
        return ()
    return ("--padding", "64") if "--padding" in shown.stdout + shown.stderr else ()


# Runs a script or module (``-m``) with the package's kernel sources read from another directory.
PRELUDE = """
import pathlib, runpy, sys
from kvcanary_cupy.rawkernels import _loader
_loader.RAWKERNEL_DIR = pathlib.Path(sys.argv.pop(1))
if sys.argv[1] == "-m":
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _memory_available() -> str:
    """The machine's available memory now, for a crash's row: a process the kernel's out-of-memory
    killer took dies of SIGKILL with nothing said."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            fields = dict(line.split(":", 1) for line in info)
        return f", {int(fields['MemAvailable'].split()[0]) >> 20} GiB of memory available after it"
    except (OSError, KeyError, ValueError):
        return ""


class Worker:
    """A copy of the kernel sources: a change is made in the copy and undone after its run. The
    package's Python (and so numba's cache of the CPU oracle) is the repository's own."""

    def __init__(self, root: pathlib.Path):
        self.kernels = root / "rawkernels"
        shutil.copytree(REPO / KERNELS, self.kernels, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
        # faulthandler: a process that dies of a signal says where (in NVRTC, in a kernel launch...)
        self.env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
        self.env.pop("KVCANARY_CONFORMANCE", None)

    def run(self, argv, timeout: float) -> tuple[str, str]:
        """('pass' | 'fail' | 'crash' | 'hang' | 'stillborn', the output's tail; a crash's from its
        fatal error on)."""
        at = argv.index(sys.executable) + 1  # after a wrapper's own arguments (compute-sanitizer's)
        argv = [*argv[:at], "-c", PRELUDE, str(self.kernels), *argv[at:]]
        try:
            done = subprocess.run(argv, cwd=REPO, env=self.env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            out = (expired.stdout or b"")
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            return "hang", out[-600:]
        out = done.stdout + done.stderr
        if done.returncode == 0:
            return "pass", out[-300:]
        if "CompileException" in out or "NVRTC_ERROR" in out:
            return "stillborn", out[-600:]
        fatal = out.find(FATAL)
        if fatal >= 0 and COMPILER_FRAME.search(out[fatal:]):
            return "stillborn", out[fatal:][:600]  # NVRTC itself died compiling the change
        signalled = -done.returncode if done.returncode < 0 else 0
        if signalled or fatal >= 0 or SANITIZER_CLEAN.search(out):
            named = [f", {sig.name}" for sig in signal.Signals if sig == signalled]
            how = f"[exit status {done.returncode}{''.join(named)}{_memory_available()}]\n"
            return "crash", how + (out[fatal:][:600] if fatal >= 0 else out[-600:])
        return "fail", out[-600:]

    def judge(self, mutant: Mutant, checks: Checks, seed: int, timeout: float, end: float) -> dict:
        """The change's verdict; no check runs past ``end`` (a perf_counter time): one cut short
        by it leaves the verdict ``unfinished``."""
        source = self.kernels / mutant.filename
        original = source.read_text(encoding="utf-8")
        lines = original.splitlines(keepends=True)
        lines[mutant.line - 1] = mutant.after + "\n"
        source.write_text("".join(lines), encoding="utf-8")
        start = time.perf_counter()
        verdict, by, tail, confirm = "survived", "", "", None
        try:
            for caught, name, argv in checks.commands(mutant, seed):
                left = end - time.perf_counter()
                outcome, tail = self.run(argv, min(timeout, max(left, 0.0)))
                if outcome == "hang" and left < timeout:
                    outcome = "unfinished"
                if outcome != "pass":
                    verdict, by = (caught if outcome in ("fail", "crash") else outcome), name
                    confirm = argv if outcome in ("crash", "hang") else None
                    break
        finally:
            source.write_text(original, encoding="utf-8")
        row = {**dataclasses.asdict(mutant), "verdict": verdict, "by": by,
               "seconds": round(time.perf_counter() - start, 1),
               "tail": tail if verdict in ("survived", "stillborn", "hang") else tail[-200:]}
        if confirm is not None:
            # a crash or a hang is the change's only if the same check ends well without it
            if verdict != "hang":
                row["crash"] = tail
            left = end - time.perf_counter()
            unchanged, _ = self.run(confirm, min(timeout, max(left, 0.0)))
            if unchanged != "pass":
                row["verdict"] = "unjudged" if unchanged in ("fail", "crash") else "unfinished"
                if unchanged == "hang" and left < timeout:
                    # ``--limit`` stopped it first: it says nothing of how long it takes
                    row["by"] = f"{by}: cut short by --limit on the unchanged sources"
                else:
                    how = "runs past the timeout" if unchanged == "hang" else "fails"
                    row["by"] = f"{by}: {how} on the unchanged sources too ({unchanged})"
            row["seconds"] = round(time.perf_counter() - start, 1)
        return row


# The crashes of checks on the unchanged sources met so far (fresh processes dying inside the CPU
# backend's verify) came in windows of a few seconds, in which every process that started died the
# same way; their cause was a numba cache entry stored without the step that starts numba's
# threading layer, which the CPU backend guards against since. A crash that the unchanged sources
# share may still be passing trouble: the change is judged again once this long has passed.
RETRY_UNJUDGED_AFTER_S = 20.0


def judged_once_more_if_unjudged(judge, wait_s: float, time_left) -> dict:
    """``judge()``'s row; where it is ``unjudged`` and ``time_left()`` (seconds) allows the wait,
    ``judge()``'s row again after ``wait_s``, with the first try's verdict, check and crash as its
    ``first_try``."""
    row = judge()
    if row["verdict"] != "unjudged" or time_left() < wait_s:
        return row
    time.sleep(wait_s)
    again = judge()
    again["first_try"] = {key: row[key] for key in ("verdict", "by", "crash", "seconds") if key in row}
    return again


CUBIN_ARCHES = ("sm_80", "sm_90")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _included(filename: str, sources: dict) -> set:
    """``filename`` and every source it includes, directly or through another."""
    seen, todo = set(), [filename]
    while todo:
        name = todo.pop()
        if name in seen or name not in sources:
            continue
        seen.add(name)
        todo.extend(INCLUDE.findall(sources[name]))
    return seen


def _cubin(spec, arch: str, root: str, code: str) -> bytes:
    """``code`` compiled as ``spec`` is, its includes read from ``root`` (the options' header digest
    stays the unchanged sources': it only names CuPy's cache entry)."""
    from kvcanary_cupy.rawkernels import _loader, _ptxas  # noqa: PLC0415

    options = [f"-I{root}" if o == f"-I{_loader.RAWKERNEL_DIR}" else o for o in spec.options]
    compiled = _ptxas.nvrtc_compile(code, spec.filename, spec.name_expressions,
                                    [*options, f"--gpu-architecture={arch}"])
    return compiled.cubin if compiled.ok else b"refused: " + compiled.log.encode()


@functools.lru_cache(maxsize=None)
def _unchanged_cubin(spec, arch: str) -> bytes:
    return _cubin(spec, arch, str(REPO / KERNELS), spec.code)


def compiled_differences(mutant: Mutant) -> list[str]:
    """``arch:kernel source`` of each image that the change alters (empty: equivalent as compiled).
    Every source that includes the changed file is compiled for CUBIN_ARCHES, changed and not."""
    from kvcanary_cupy.rawkernels import _loader  # noqa: PLC0415

    kernels = REPO / KERNELS
    sources = {p.name: p.read_text(encoding="utf-8") for p in kernels.glob("*.cu*")}
    lines = sources[mutant.filename].splitlines(keepends=True)
    lines[mutant.line - 1] = mutant.after + "\n"
    with tempfile.TemporaryDirectory(prefix="kvc_cubins_") as root:
        for name, text in sources.items():
            pathlib.Path(root, name).write_text("".join(lines) if name == mutant.filename else text, encoding="utf-8")
        changed = pathlib.Path(root, mutant.filename).read_text(encoding="utf-8")
        differ = []
        for spec in _loader.compile_specs():
            if mutant.filename not in _included(spec.filename, sources):
                continue
            code = changed if spec.filename == mutant.filename else spec.code
            for arch in CUBIN_ARCHES:
                if _cubin(spec, arch, root, code) != _unchanged_cubin(spec, arch):
                    differ.append(f"{arch}:{spec.filename}")
    return differ


def images_of(mutant: Mutant) -> str:
    """A survivor's kernel images against the unchanged ones: ``same`` (equivalent as compiled),
    ``changed``, or ``unknown`` where NVRTC cannot be driven here (no ``cuda-bindings``)."""
    try:
        importlib.import_module("cuda.bindings.nvrtc")
    except ImportError:
        return "unknown"
    return "changed" if compiled_differences(mutant) else "same"


# Python's own words when a process dies of a signal with faulthandler on
FATAL = "Fatal Python error"
# the crashed thread's innermost frame in CuPy's compiler: NVRTC died compiling a source (the
# loader compiles on threads of its own; only the thread that took the signal counts)
COMPILER_FRAME = re.compile(r"Current thread [^\n]*\(most recent call first\):\n"
                            r"\s+File \"[^\"]*cupy/cuda/compiler\.py\"")
# a sanitizer's summary of no findings: a failing check that shows it failed for another reason
# (compute-sanitizer says "the application may have hit an error" of a process that crashed under it)
SANITIZER_CLEAN = re.compile(r"========= (ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards)")


def crashed(row: dict) -> bool:
    """Whether an earlier run's row was given by a check whose process crashed, as this tool's
    earlier versions counted as caught without asking whether the unchanged sources crash too:
    its tail ends in the interpreter's list of extension modules, holds the fatal error, or is a
    sanitizer's check that failed with no error of the sanitizer's own."""
    tail = row.get("tail", "")
    return row["verdict"] not in ("survived", "stillborn", "unjudged") and \
        (FATAL in tail or "crash" in row or tail.rstrip().endswith(")") and "(total: " in tail
         or SANITIZER_CLEAN.search(tail) is not None)


REPLAY_ONLY = ("crashed", "unfinished", "survived")  # the subsets of a replay that --replay can be told to take


def replayed(paths: list[str], named: frozenset = frozenset(), only: Optional[str] = None) -> list[Mutant]:
    """The changes that survived earlier runs (their ``--json``) or were cut short or never started
    there (``unfinished``), that a crashed check judged (``crashed``), or that were left unjudged
    (their check crashed on the unchanged sources too); ``only``, one of :data:`REPLAY_ONLY`, takes
    the last two alone (``crashed``), the unfinished alone, or the survivors whose kernel images
    changed alone (``survived``: those equivalent as compiled stay out). The changes at a
    ``FILE:LINE`` of ``named`` (where the earlier run had them) whatever their verdict: a check found
    at fault since (a test that failed on its own) judges them again. A change several runs judged
    goes by the last of them (``paths`` in the order run). Each still where it was, each once."""
    latest: dict = {}
    for path in paths:
        for row in json.loads(pathlib.Path(path).read_text())["rows"]:
            change = (row["filename"], row["line"], row["before"], row["after"])
            latest.pop(change, None)  # to the end: the order judged
            latest[change] = row

    def wanted(row: dict) -> bool:
        if f"{row['filename']}:{row['line']}" in named:
            return True
        if only == "unfinished":
            return row["verdict"] == "unfinished"
        if only == "survived":
            return row["verdict"] == "survived" and row.get("images") != "same"
        return crashed(row) or row["verdict"] == "unjudged" or \
            (only is None and row["verdict"] in ("survived", "unfinished"))

    rows = [row for row in latest.values() if wanted(row)]
    mutants, seen = [], set()
    for row in rows:
        source = (REPO / KERNELS / row["filename"]).read_text(encoding="utf-8").splitlines()
        # the line where it was, else the one line that now holds its text (lines above it moved)
        same = [row["line"]] if source[row["line"] - 1:row["line"]] == [row["before"]] else \
            [number for number, text in enumerate(source, start=1) if text == row["before"]]
        if len(same) != 1:
            print(f"{row['filename']}:{row['line']} changed since: not replayed")
            continue
        change = (row["filename"], same[0], row["after"])
        if change not in seen:  # a change two runs drew, its line moved between them, is judged once
            seen.add(change)
            mutants.append(Mutant(row["ident"], row["filename"], same[0], row["before"], row["after"],
                                  row["operator"]))
    return mutants


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mutants", type=int, default=150, help="changes drawn from the candidates")
    parser.add_argument("--seed", type=int, default=1, help="which changes are drawn")
    parser.add_argument("--skip", type=int, default=0,
                        help="leave out the first SKIP changes drawn (judged by an earlier run of this seed)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--cases", type=int, default=120, help="fuzz cases an op, each change")
    # the GPU tests of a change to canary_common.cuh (every kernel's) took up to 146 s with twelve
    # workers on one H100
    parser.add_argument("--timeout", type=float, default=240, help="seconds a check may run")
    parser.add_argument("--deadline", type=float, default=400, help="no change starts after this many seconds")
    parser.add_argument("--limit", type=float, default=560, help="no check runs past this many seconds")
    parser.add_argument("--files", nargs="*", help="draw only from these sources (with --replay: FILE or FILE:LINE, the changes at "
                        "a FILE:LINE taken whatever their verdict)")
    parser.add_argument("--json", help="write every change's verdict here (rewritten as they come)")
    parser.add_argument("--list", action="store_true", help="print the drawn changes and stop")
    parser.add_argument("--replay", nargs="+", metavar="JSON",
                        help="judge again the changes that survived these earlier --json runs (in the order"
                             " run: the last run's verdict of a change counts) or that --limit cut short or"
                             " --deadline kept from starting there, that a check whose process crashed"
                             " judged, or that were left unjudged")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--unfinished", action="store_true",
                      help="with --replay: only the changes cut short by --limit or not started before --deadline")
    only.add_argument("--crashed", action="store_true",
                      help="with --replay: only the changes that a check whose process crashed judged or"
                           " left unjudged")
    only.add_argument("--survived", action="store_true",
                      help="with --replay: only the survivors whose kernel images changed, e.g. to run them all"
                           " under --memcheck")
    parser.add_argument("--memcheck", action="store_true",
                        help="after the fuzz, the fuzz again under compute-sanitizer's memcheck")
    parser.add_argument("--racecheck", action="store_true",
                        help="after the fuzz, the fuzz again under compute-sanitizer's racecheck")
    parser.add_argument("--synccheck", action="store_true",
                        help="after the fuzz, the fuzz again under compute-sanitizer's synccheck")
    parser.add_argument("--stale-shared", action="store_true",
                        help="every fuzz runs each kernel after a fill of the SMs' shared memory with non-zero words")
    parser.add_argument("--no-tests", action="store_true", help="skip the GPU tests of the change's ops")
    parser.add_argument("--cubins", action="store_true",
                        help="no checks: whether each change leaves every kernel image as it was (no GPU needed)")
    args = parser.parse_args()
    checks = Checks(cases=args.cases, memcheck=args.memcheck, tests=not args.no_tests, racecheck=args.racecheck,
                    synccheck=args.synccheck, stale_shared=args.stale_shared)

    if args.replay:
        named = frozenset(name for name in args.files or () if ":" in name)
        subset = next((name for name in REPLAY_ONLY if getattr(args, name)), None)
        pool = drawn = [m for m in replayed(args.replay, named, subset)
                        if not args.files or {m.filename, f"{m.filename}:{m.line}"} & set(args.files)]
    else:
        pool = [m for m in candidates() if not args.files or m.filename in args.files]
        # in drawn order, so that the changes judged before the deadline are a random sample too
        drawn = random.Random(args.seed).sample(pool, min(args.mutants, len(pool)))[args.skip:]
    if args.list:
        for m in sorted(drawn, key=lambda m: (m.filename, m.line)):
            print(f"{m.ident:4d} {m.filename}:{m.line} [{m.operator}] {m.after.strip()}")
        print(f"{len(drawn)} of {len(pool)} candidates")
        return 0

    if args.cubins:
        for m in drawn:
            differ = compiled_differences(m)
            print(f"{m.filename}:{m.line} [{m.operator}] " + ("differs: " + " ".join(differ) if differ else "same"),
                  flush=True)
        return 0

    began = time.perf_counter()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvc_mutants_"))
    workers: queue.Queue = queue.Queue()
    copies = [Worker(scratch / f"w{k}") for k in range(args.workers)]
    # numba's oracle jits once, into the repository's cache; then each copy's unchanged sources
    # compile once, before any change
    jitted = subprocess.run([sys.executable, "tools/differential_fuzz.py", "--device", "cpu", "--cases", "4"],
                            cwd=REPO, env=copies[0].env, capture_output=True, text=True)
    if jitted.returncode != 0:
        print("the CPU oracle fails its own fuzz:", jitted.stdout[-600:], jitted.stderr[-600:])
        return 2
    warm_up = [sys.executable, "tools/differential_fuzz.py", "--cases", "4",
               *(["--stale-shared"] if checks.stale_shared else [])]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(copies)) as executor:
        warmed = list(executor.map(lambda worker: worker.run(warm_up, args.timeout), copies))
    for outcome, tail in warmed:
        if outcome != "pass":
            print("the unchanged sources fail their own fuzz:", tail)
            return 2
    for worker in copies:
        workers.put(worker)
    print(f"[{time.perf_counter() - began:.0f} s] unchanged sources pass; {len(drawn)} changes, "
          f"{args.workers} workers", flush=True)
    results: list = []
    lock = threading.Lock()

    def one(mutant: Mutant):
        if time.perf_counter() - began > args.deadline:
            return None

        def judge() -> dict:
            worker = workers.get()
            try:
                return worker.judge(mutant, checks, 7000 + mutant.ident, args.timeout, began + args.limit)
            finally:
                workers.put(worker)

        row = judged_once_more_if_unjudged(judge, RETRY_UNJUDGED_AFTER_S,
                                           lambda: args.deadline - (time.perf_counter() - began))
        if row["verdict"] == "survived":
            row["images"] = images_of(mutant)
        with lock:
            results.append(row)
            if args.json:
                pathlib.Path(args.json).write_text(json.dumps({"rows": results}, indent=1))
            print(f"[{time.perf_counter() - began:.0f} s] {len(results)}/{len(drawn)} "
                  f"{mutant.filename}:{mutant.line} [{mutant.operator}] {row['verdict']} {row['by']}"
                  + (f"(images {row['images']})" if "images" in row else "")
                  + (" (judged again: the first try was unjudged)" if "first_try" in row else ""), flush=True)
        return row

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.workers) as executor:
        rows = list(executor.map(one, drawn))
    # the changes the deadline kept from starting stay in the file, for a later --replay to take
    results.extend({**dataclasses.asdict(m), "verdict": "unfinished", "by": "not started before --deadline",
                    "seconds": 0.0, "tail": ""} for m, row in zip(drawn, rows) if row is None)
    counts: dict = {}
    for row in results:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    # a change --limit cut short is no more judged than one the deadline kept from starting
    summary = {"drawn": len(drawn), "judged": len(results) - counts.get("unfinished", 0), "candidates": len(pool),
               "seed": args.seed,
               "checks": dataclasses.asdict(checks), "replay": args.replay, "verdicts": counts, "wall_s": round(time.perf_counter() - began, 1)}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"summary": summary, "rows": results}, indent=1))
    print(json.dumps(summary))
    for row in results:
        if row["verdict"] == "survived":
            same = " (images unchanged: equivalent as compiled)" if row.get("images") == "same" else ""
            print(f"survived {row['filename']}:{row['line']} [{row['operator']}] {row['after'].strip()}{same}")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

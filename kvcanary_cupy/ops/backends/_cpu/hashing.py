"""numba building blocks shared by the CPU ops: the hash, slot links, real-KV folds, ring records.

All hashing is done on ``uint64`` values; the canary buffer and plans are ``int64`` and are
reinterpreted, never converted, so every bit matches the CUDA kernels.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import threading
import types
import warnings

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

from .... import _layout as L

try:
    from numba.core.caching import FunctionCache
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.sigutils import normalize_signature
    from numba.np.ufunc.parallel import _launch_threads
except ImportError:  # a numba that moved them: its own cache keys, unsalted, and its own locking
    FunctionCache = None
try:
    import fcntl
except ImportError:  # not POSIX: numba's own locking alone
    fcntl = None
try:
    from numba.core.cpu import CPUTargetOptions
except ImportError:  # a numba that moved them: the serial builds count references as any build does
    CPUTargetOptions = None


def _sources_digest() -> str:
    """The CPU backend's sources and the layout constants they use, hashed. numba checks a cached
    function against its own file alone, not against the functions it calls or inlines nor the
    globals it froze into its code: after a change to the hash in this file, a checkout would
    otherwise keep loading ops compiled with the old one."""
    digest = hashlib.sha256()
    try:
        for path in sorted(pathlib.Path(__file__).parent.glob("*.py")) + [pathlib.Path(L.__file__)]:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    except OSError:  # sources not on a file system (a zip import): numba's own keys alone
        return ""
    return digest.hexdigest()


SOURCES_DIGEST = _sources_digest()

if FunctionCache is not None:
    class _SourcesKeyedCache(FunctionCache):
        """numba's on-disk cache, each entry keyed by the backend's sources too."""

        def _index_key(self, sig, codegen):
            return (*super()._index_key(sig, codegen), SOURCES_DIGEST)

        def load_overload(self, sig, target_context):
            # numba starts its threading layer before loading an entry only where the entry's own
            # code holds a parallel loop: one compiled in a process that loaded its parallel
            # callees from this cache (``_verify`` over ``hash_slots_parallel``) is stored without
            # that step (numba issues 8578 and 9938), and loaded first in a process its calls are
            # left unresolved: the process dies jumping to address 0.
            _launch_threads()
            return super().load_overload(sig, target_context)


class _CompileLock:
    """One process at a time compiles the backend's functions into a cache directory (and loads and
    stores their entries meanwhile). numba's on-disk cache does not guard against two processes
    compiling the same functions at once (numba issues 4807 and 10128): a later process may load
    entries stored by different ones, whose code does not fit together, and crash. Taken under
    numba's own compiler lock, so that threads keep numba's lock order and nested compiles (an op
    and the functions it calls) take the file lock once."""

    def __init__(self):
        self.depth = 0
        self.handle = None

    @contextlib.contextmanager
    def held(self, directory: str):
        with global_compiler_lock:
            if self.depth == 0:
                self.handle = self._lock_file(directory)
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
                if self.depth == 0 and self.handle is not None:
                    self.handle.close()  # which releases the lock
                    self.handle = None

    @staticmethod
    def _lock_file(directory: str):
        if fcntl is None:
            return None
        try:
            os.makedirs(directory, exist_ok=True)
            handle = open(os.path.join(directory, "kvcanary-compile.lock"), "a")
        except OSError:  # a directory numba cannot store into either: nothing to guard
            return None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a file system without locks
            handle.close()
            return None
        return handle


_COMPILE_LOCK = _CompileLock()


def _compile_one_process_at_a_time(dispatcher) -> None:
    """Route ``dispatcher``'s compiles of new signatures through :data:`_COMPILE_LOCK` (numba calls
    ``compile`` on a dispatch miss and when typing a caller; a signature already compiled in this
    process takes no lock)."""
    compile_unlocked, directory = dispatcher.compile, dispatcher._cache.cache_path

    def compile(sig):
        args, _ = normalize_signature(sig)
        if tuple(args) in dispatcher.overloads:
            return compile_unlocked(sig)
        with _COMPILE_LOCK.held(directory):
            return compile_unlocked(sig)

    dispatcher.compile = compile


_NO_CACHE_WARNED = False


def _warn_no_cache_directory(error: RuntimeError) -> None:
    """Say once per process that the CPU backend compiles without numba's on-disk cache."""
    global _NO_CACHE_WARNED
    if _NO_CACHE_WARNED:
        return
    _NO_CACHE_WARNED = True
    given = numba.config.CACHE_DIR  # NUMBA_CACHE_DIR, which numba passes over where it cannot write
    tried = f"NUMBA_CACHE_DIR ({given}), " if given else ""
    advice = "Point NUMBA_CACHE_DIR at" if given else "Set NUMBA_CACHE_DIR to"
    warnings.warn(
        f"kvcanary_cupy: numba has no writable cache directory for the CPU backend's kernels (neither {tried}"
        "the installed package's __pycache__ nor numba's user cache directory); they are compiled "
        f"again in every process. {advice} a writable directory to keep them. "
        f"(numba: {error})", RuntimeWarning, stacklevel=3)


def njit(**flags):
    """``numba.njit(**flags)``, with its cache (when ``cache=True``) keyed by :data:`SOURCES_DIGEST`
    and filled by one process at a time (:class:`_CompileLock`). Where numba finds no directory it
    can store its cache in (a read-only install with no writable user cache directory and no
    ``NUMBA_CACHE_DIR``), the functions are compiled in each process instead, with a warning."""
    def build(fn):
        if not flags.get("cache") or FunctionCache is None:
            try:
                return numba.njit(**flags)(fn)
            except RuntimeError as error:  # numba: "cannot cache function ...: no locator available"
                if not flags.get("cache"):
                    raise
                _warn_no_cache_directory(error)
                return numba.njit(**dict(flags, cache=False))(fn)
        # numba's own cache is not set up (it would probe its cache directory only to be replaced)
        dispatcher = numba.njit(**dict(flags, cache=False))(fn)
        if hasattr(dispatcher, "enable_caching"):  # a Dispatcher (not the plain function NUMBA_DISABLE_JIT gives)
            try:
                cache = _SourcesKeyedCache(dispatcher.py_func)
            except RuntimeError as error:  # numba: "cannot cache function ...: no locator available"
                _warn_no_cache_directory(error)
                return dispatcher
            dispatcher._cache = cache
            _compile_one_process_at_a_time(dispatcher)
        return dispatcher
    return build


JIT = dict(cache=True, nogil=True)
# Small helpers are inlined at numba's IR level: as separate calls, passing arrays into them costs
# reference-count traffic that dominated the per-entry time.
INLINE = dict(JIT, inline="always")

_MUL_1 = np.uint64(L.SPLITMIX_MUL_1)
_MUL_2 = np.uint64(L.SPLITMIX_MUL_2)
_SHIFT_1 = np.uint64(L.SPLITMIX_SHIFT_1)
_SHIFT_2 = np.uint64(L.SPLITMIX_SHIFT_2)
_SHIFT_3 = np.uint64(L.SPLITMIX_SHIFT_3)
_ANCHOR = np.uint64(L.CHAIN_ANCHOR)
_ZERO = np.uint64(0)

F_TOKEN = L.FIELD_TOKEN
F_POSITION = L.FIELD_POSITION
F_PREV_HASH = L.FIELD_PREV_HASH
F_REAL_KV_HASH = L.FIELD_REAL_KV_HASH
_S_STRIDE = L.SRC_ROW_STRIDE_BYTES
_S_ROWS = L.SRC_NUM_ROWS
_S_PAGE = L.SRC_PAGE_SIZE
_S_BPT = L.SRC_BYTES_PER_TOKEN
_S_READ = L.SRC_READ_BYTES
BIT_OUT_OF_RANGE = int(L.FailReason.OUT_OF_RANGE)


# numba counts a reference to each array a loop hands to a helper inlined at its IR level, on every
# pass, with atomic updates: they made the serial builds of the verify check and real-KV hashing
# loops four to six times slower an entry than uncounted, and than the parallel builds on one
# thread, whose loop bodies count none (tools/cpu_serial_probe.py). Those loops allocate nothing,
# so their serial builds run without numba's reference counting, where this numba has the option.
WITHOUT_REFERENCE_COUNTS = {"_nrt": False} if hasattr(CPUTargetOptions, "_nrt") else {}


def serial_and_parallel(fn):
    """``(serial, parallel)`` jitted builds of ``fn`` (whose loop is a ``numba.prange`` and which
    allocates nothing: its serial build counts no references). numba's on-disk cache is keyed by
    the function's name and line, not by its compile flags: two builds of one function would share
    a cache entry and load each other's code, so each build gets a copy of ``fn`` under a name of
    its own."""

    def renamed(suffix):
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix, fn.__defaults__,
                                  fn.__closure__)
        copy.__qualname__ = fn.__qualname__ + suffix
        copy.__module__ = fn.__module__
        return copy

    return (njit(**JIT, **WITHOUT_REFERENCE_COUNTS)(renamed("_serial")),
            njit(parallel=True, **JIT)(renamed("_parallel")))


_PARALLEL_REGION = threading.Lock()


def one_parallel_call_at_a_time(uses_threads: bool):
    """Held around a call that may run a parallel build (``uses_threads``; a no-op otherwise).
    numba's workqueue threading layer, the one it falls back to where neither TBB nor OpenMP is
    installed, ends the process when two Python threads run parallel regions at once (two
    canaries driven from two threads, a host tier's thread beside the engine's); a parallel build
    takes every core anyway. Serial builds release the GIL and run side by side."""
    return _PARALLEL_REGION if uses_threads else contextlib.nullcontext()


def threads_can_hash(sources) -> bool:
    """Whether a parallel build can take ``sources``: numba unpacks a tuple passed into a parallel
    region only up to ``NUMBA_PARFOR_MAX_TUPLE_SIZE`` items (100 by default), and refuses to
    compile one longer (a model of 51 layers hashing K and V has 102 sources)."""
    return len(sources) <= numba.config.PARFOR_MAX_TUPLE_SIZE


def _cache_line_hint(*, for_write: bool):
    """An intrinsic ``hint(array, index)`` that asks the CPU to bring the cache line of element
    ``index`` of the C-contiguous ``array`` (counted as if flat) closer, without waiting and without
    faulting; ``for_write``: saying that the line is about to be stored to."""

    @intrinsic
    def hint(typingctx, array, index):
        if not isinstance(array, nbtypes.Array) or not isinstance(index, nbtypes.Integer):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
            int32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [address.type, int32, int32, int32])
            # the intrinsic is named after its pointer type: "ptr" (opaque pointers) or "i8*" (older LLVM)
            name = "llvm.prefetch.p0" if str(address.type) == "ptr" else "llvm.prefetch.p0i8"
            # read or write, keep in every cache level, data cache
            builder.call(cgutils.get_or_insert_function(builder.module, fnty, name),
                         [address, int32(1 if for_write else 0), int32(3), int32(1)])
            return context.get_dummy_value()

        return nbtypes.void(array, index), codegen

    return hint


# Random reads issued ahead of their use overlap instead of stalling one after another.
prefetch = _cache_line_hint(for_write=False)


if numba.config.DISABLE_JIT:  # numba's debugging switch: the jitted functions run as plain Python
    def prefetch(array, index):  # noqa: F811 - an intrinsic cannot run in plain Python
        """Nothing: a hint to the CPU's caches that plain Python cannot give."""

    warnings.warn("kvcanary_cupy: NUMBA_DISABLE_JIT is set, so the CPU backend's kernels run as plain Python: "
                  "results are the same, but ops take thousands of times longer (unset it outside debugging)",
                  RuntimeWarning, stacklevel=2)
    # the hash's uint64 products wrap on purpose, as they do when compiled: NumPy's scalars warn
    warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning, r"kvcanary_cupy\.ops\.backends\._cpu")


@njit(**JIT)
def sm(x):
    x = (x ^ (x >> _SHIFT_1)) * _MUL_1
    x = (x ^ (x >> _SHIFT_2)) * _MUL_2
    return x ^ (x >> _SHIFT_3)


@njit(**JIT)
def mix3(a, b, c):
    return sm(sm(sm(a) ^ b) ^ c)


@njit(**JIT)
def as_i64(value):
    return np.int64(value)


@njit(**INLINE)
def link(words, slot):
    """Chain link of ``slot``; any negative slot is "no predecessor"."""
    if slot < 0:
        return sm(_ANCHOR)
    return mix3(np.uint64(words[slot, F_PREV_HASH]), np.uint64(words[slot, F_TOKEN]),
                np.uint64(words[slot, F_POSITION]))


@njit(**INLINE)
def _first_word(table, j, slot):
    """Index of ``slot``'s first uint64 word in source ``j`` (0 <= slot), or -1 past the source's rows."""
    page = table[j, _S_PAGE]
    if page == 1:  # the common layout: no division
        return (slot * table[j, _S_STRIDE]) // 8 if slot < table[j, _S_ROWS] else -1
    row = slot // page
    if row >= table[j, _S_ROWS]:
        return -1
    return (row * table[j, _S_STRIDE] + (slot - row * page) * table[j, _S_BPT]) // 8


@njit(**INLINE)
def _fold(words, first, count):
    folded = _ZERO
    for w in range(count):
        folded = sm(folded ^ words[first + w])
    return folded


@njit(**INLINE)
def real_kv_hash(sources, table, slot):
    """``(hash, out_of_range)`` of ``slot`` (0 <= slot) over every source row of ``table``; a row past
    a source folds as 0."""
    acc = _ZERO
    out_of_range = False
    for j in range(table.shape[0]):
        first = _first_word(table, j, slot)
        folded = _ZERO
        if first < 0:
            out_of_range = True
        else:
            folded = _fold(sources[j], first, table[j, _S_READ] // 8)
        acc = sm(acc ^ folded)
    return acc, out_of_range


@njit(**INLINE)
def hashable(slot, num_slots):
    """``slot`` when it indexes the canary, else slot 0 (its hash is then computed and ignored)."""
    return slot if 0 <= slot < num_slots else 0


@njit(**INLINE)
def real_kv_hash4(sources, table, s0, s1, s2, s3):
    """:func:`real_kv_hash` of four slots (each >= 0) at once: each fold is a serial chain of
    splitmix rounds, so four independent chains interleaved keep the multipliers busy."""
    a0 = a1 = a2 = a3 = _ZERO
    o0 = o1 = o2 = o3 = False
    for j in range(table.shape[0]):
        words = sources[j]
        count = table[j, _S_READ] // 8
        b0 = _first_word(table, j, s0)
        b1 = _first_word(table, j, s1)
        b2 = _first_word(table, j, s2)
        b3 = _first_word(table, j, s3)
        f0 = f1 = f2 = f3 = _ZERO
        if b0 >= 0 and b1 >= 0 and b2 >= 0 and b3 >= 0:
            for w in range(count):
                f0 = sm(f0 ^ words[b0 + w])
                f1 = sm(f1 ^ words[b1 + w])
                f2 = sm(f2 ^ words[b2 + w])
                f3 = sm(f3 ^ words[b3 + w])
        else:
            o0 |= b0 < 0
            o1 |= b1 < 0
            o2 |= b2 < 0
            o3 |= b3 < 0
            f0 = _fold(words, b0, count) if b0 >= 0 else _ZERO
            f1 = _fold(words, b1, count) if b1 >= 0 else _ZERO
            f2 = _fold(words, b2, count) if b2 >= 0 else _ZERO
            f3 = _fold(words, b3, count) if b3 >= 0 else _ZERO
        a0 = sm(a0 ^ f0)
        a1 = sm(a1 ^ f1)
        a2 = sm(a2 ^ f2)
        a3 = sm(a3 ^ f3)
    return a0, a1, a2, a3, o0, o1, o2, o3


# Where verify and write take the threaded builds of their hash and check loops: below this
# many entries the thread pool saves little, on two cores a quarter to a third of the check's
# and the hash's time at 2,048 entries and about nothing at 512
# (benchmarks/results/2026-12-05-cpu-2core-serial-builds-8a80dc9.txt).
PARALLEL_MIN_ENTRIES = 2048

# Entries ahead of the one being hashed (or checked) whose rows are prefetched: the source rows
# of a batch are random reads, and issued one group at a time they dominated the CPU verify.
PREFETCH_AHEAD = 32


@njit(**INLINE)
def prefetch_source_rows(sources, table, slot):
    """Prefetches the bytes each source reads for ``slot`` (0 <= slot)."""
    for j in range(table.shape[0]):
        first = _first_word(table, j, slot)
        if first >= 0:
            prefetch(sources[j], first)
            prefetch(sources[j], first + table[j, _S_READ] // 8 - 1)


def _hash_slots(num_slots, sources, table, slots, hashes, out_of_range):
    """Real-KV hash of every slot in ``slots`` (slots outside the canary get slot 0's, to be
    ignored), four at a time so their folds interleave, the rows PREFETCH_AHEAD entries on asked for
    meanwhile."""
    count = slots.shape[0]
    for group in numba.prange((count + 3) // 4):
        i = group * 4
        for ahead in range(i + PREFETCH_AHEAD, min(i + PREFETCH_AHEAD + 4, count)):
            prefetch_source_rows(sources, table, hashable(slots[ahead], num_slots))
        last = min(i + 4, count) - 1
        h0, h1, h2, h3, o0, o1, o2, o3 = real_kv_hash4(
            sources, table, hashable(slots[i], num_slots), hashable(slots[min(i + 1, last)], num_slots),
            hashable(slots[min(i + 2, last)], num_slots), hashable(slots[last], num_slots))
        hashes[i], out_of_range[i] = h0, o0
        if i + 1 <= last:
            hashes[i + 1], out_of_range[i + 1] = h1, o1
        if i + 2 <= last:
            hashes[i + 2], out_of_range[i + 2] = h2, o2
        if i + 3 <= last:
            hashes[i + 3], out_of_range[i + 3] = h3, o3


hash_slots_serial, hash_slots_parallel = serial_and_parallel(_hash_slots)


@njit(**INLINE)
def record(ring, write_index, kind, slot, position, stored_token, expected_token, chain_hash, aux, bits):
    """Claim the next ring row; store it only while the ring has room (fill-once)."""
    index = write_index[0]
    write_index[0] = index + 1
    if 0 <= index < ring.shape[0]:
        row = ring[index]
        row[L.RING_COL_KERNEL_KIND] = kind
        row[L.RING_COL_SLOT] = slot
        row[L.RING_COL_POSITION] = position
        row[L.RING_COL_STORED_TOKEN] = stored_token
        row[L.RING_COL_EXPECTED_TOKEN] = expected_token
        row[L.RING_COL_STORED_CHAIN_HASH] = chain_hash
        row[L.RING_COL_EXPECTED_AUX] = aux
        row[L.RING_COL_FAIL_BITS] = bits


_EMPTY_SOURCE = np.zeros(1, dtype=np.uint64)
_EMPTY_SOURCE.flags.writeable = False


def source_arguments(ctx):
    """``(sources, table)`` for the jitted ops: a homogeneous tuple of read-only uint64 arrays
    (one dummy when there is none, so the tuple type is stable) and the descriptor table."""
    views = []
    for words in ctx.source_words:
        view = words.view()
        view.flags.writeable = False
        views.append(view)
    return (tuple(views) if views else (_EMPTY_SOURCE,)), ctx.source_table


def slot_words(ctx) -> np.ndarray:
    """The canary buffer as ``int64 [num_slots, slot_stride_bytes // 8]``."""
    return ctx.canary_buf.view(np.int64)

"""A canary session: plans, verify and write launches per forward pass, decoded reports.

:class:`Canary` owns the canary buffers, violation rings and plans of one KV pool (and of an optional
sliding-window pool). An engine calls :meth:`Canary.before_forward` once the batch's slots are known,
:meth:`Canary.after_forward` once the forward has written its KV, :meth:`Canary.sweep` now and then,
and :meth:`Canary.poll` whenever it can afford a host synchronisation. Nothing but ``poll`` (and
``stats``) waits for the device, but for one wait for CuPy's current stream when the canary, a
static forward or the first sweep's plans are built.

``poll`` maps each violation back to the request and position it concerns, from a host-side log of
the launches since the previous poll (references to the batch metadata, nothing copied; at most
``max_logged_forwards`` forwards' worth) and the ``req_to_token`` table; the mapping is done only
for the violating slots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from . import _layout as L
from . import validate as check
from ._dlpack import (Device, assign, cupy_module, device_of, filled, launch_geometry, native_view,
                      order_after_torch, own_view, parse_device, require_device, settle, stream_capturing, to_host)
from ._mapping import RowMapper
from ._recent import RecentlyUsed
from .block_tables import forward_batch
from .capacities import Capacities
from .context import CanaryContext, Violation, VerifyPlan, WritePlan, reason_names, ring_index, tag_name
from .ops._dispatch import backend_module, check_stream_form, on_device, resolve_stream
from .ops.batches import PlanBatch, RecordCopy, WriteBatch, launch_tag, owning
from .ops.copy_records import run_record_copy, stored_destinations
from .sources import RealKvSource, source_list

__all__ = ["Canary", "CanaryEvent", "CanaryReport", "CanaryViolation", "ForwardBatch", "LiveRequests",
           "SwaGroup", "MODES"]

MODES = ("off", "log", "raise")
_LOG = logging.getLogger("kvcanary_cupy")
_RUN_COUNTS_PER_ARRAY = 64


# --- inputs ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class ForwardBatch:
    """The metadata of one forward pass, as the engine already has it (device or host arrays).

    ``req_pool_indices``, ``prefix_lens``, ``extend_seq_lens``: ``int64 [bs]``; ``input_ids``,
    ``positions``, ``out_cache_loc``: ``int64 [n]``, request after request. ``req_ids`` (host, one per
    batch row) only names requests in reports. ``expected_input_tokens``/``_positions`` (both, or
    neither) turn on the write input assert; ``expected_valid_lens`` (``int64 [bs]``) bounds the
    expected-token pool (defaults to ``prefix_lens``). ``swa_out_cache_loc`` overrides
    ``lut[out_cache_loc]`` for the SWA group. Arrays are referenced, not copied: if the engine
    refills them in place before :meth:`Canary.poll`, reports may name the wrong request; an array
    object reshaped, re-typed or resized in place before it leaves that forward's rows unplaced (no
    step, no request; a warning says so).
    """

    req_pool_indices: Any
    prefix_lens: Any
    extend_seq_lens: Any
    input_ids: Any
    positions: Any
    out_cache_loc: Any
    req_ids: Optional[Sequence[Any]] = None
    expected_input_tokens: Optional[Any] = None
    expected_input_positions: Optional[Any] = None
    expected_valid_lens: Optional[Any] = None
    swa_out_cache_loc: Optional[Any] = None

    # a batch from cumulative token offsets and total lengths, int32 or int64 (vLLM-style metadata)
    from_offsets = staticmethod(forward_batch)


@dataclasses.dataclass(frozen=True, eq=False)
class LiveRequests:
    """The requests a sweep re-checks: pool rows and how many tokens each has in the cache."""

    req_pool_indices: Any
    seq_lens: Any
    req_ids: Optional[Sequence[Any]] = None


@dataclasses.dataclass(frozen=True, eq=False)
class SwaGroup:
    """A sliding-window KV pool beside the full one: ``lut`` (``int64``, a cell for each full-pool
    slot at least: ``pool_slot_count`` cells or more, as SGLang's ``+ 1``) maps a full-pool slot to
    its SWA slot; verify checks the last ``window`` positions of each request."""

    window: int
    lut: Any
    num_slots: int
    real_kv_sources: Sequence[RealKvSource] = ()


# --- outputs -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CanaryEvent:
    """One violation, decoded and mapped back to the engine's request and position.

    ``group`` is ``"full"`` or ``"swa"``; ``phase`` the launch that recorded it: ``"head"``
    (``before_forward``'s verify), ``"tail"`` (``after_forward``'s), ``"sweep"``, or ``"write"``
    (``after_forward``'s fingerprinting, whose asserts check the tokens given). ``request`` is the
    batch row's ``req_ids`` entry (its index in the batch where the batch has none) and ``position``
    its position, both None where the row names no request; ``slot`` the slot checked or written;
    ``violation`` the raw row, whose :class:`FailReason` names are ``reasons`` and whose launch tag
    is ``tag``.

    ``step`` is the number of the forward whose launch recorded it, counted as
    :attr:`CanaryReport.forwards` counts (eager forwards and static forwards' runs, replays
    included; a sweep takes the number of the forward before it), or None where that cannot be
    told: a replay's place among the forwards and sweeps since the previous poll is not known on
    the host, so a replay has its step when it is the only forward since the previous poll, and a
    sweep beside a replay has none. Polled after each forward and each sweep, every event has its
    step, but for a row whose entry's predecessor slot was written again later in the same forward
    (a page freed while in use and taken by another request of the batch): which write the row saw
    is not known."""

    group: str
    phase: str
    step: Optional[int]
    slot: int
    request: Any
    position: Optional[int]
    violation: Violation

    @property
    def tag(self) -> L.LaunchTag | int:
        return self.violation.kernel_kind

    @property
    def reasons(self) -> tuple[str, ...]:
        return reason_names(self.violation.fail_reason)

    def __repr__(self) -> str:
        # the dataclass's own, but for a request id that cannot be shown (see _shown)
        fields = ", ".join(f"{field.name}={(_shown if field.name == 'request' else repr)(getattr(self, field.name))}"
                           for field in dataclasses.fields(self))
        return f"{type(self).__qualname__}({fields})"

    def describe(self) -> str:
        tag = tag_name(self.tag)
        # an id from a NumPy array of ids (np.str_, np.int64) as the value it holds: 'a', not np.str_('a')
        request = self.request.item() if isinstance(self.request, np.generic) else self.request
        where = "unknown request" if request is None else f"request {_shown(request)}"
        pos = "?" if self.position is None else str(self.position)
        step = "?" if self.step is None else str(self.step)
        if self.slot == L.UNRESOLVED_SLOT:
            slot = "unresolved (no cell of req_to_token or the LUT)"
        elif self.slot == -1 and self.phase == "write":
            slot = "none (the request's entries reach past input_ids)"
        else:
            slot = str(self.slot)
        v, reasons = self.violation, self.reasons
        wanted = "".join(text for flags, text in (
            (("VERIFY_TOKEN", "WRITE_TOKEN"), f", expected token {v.expected_token}"),
            (("WRITE_POSITION",), f", expected position {v.expected_aux}")) if set(flags) & set(reasons))
        # an out-of-range row's token and position are what the launch meant to check or store (its
        # slot may lie outside the pool, where nothing is stored: SPEC §4), not a record's
        held = "row's" if "OUT_OF_RANGE" in reasons else "stored"
        return (f"[{tag} step {step}] {where} position {pos} slot {slot}: {'|'.join(reasons)} "
                f"({held} token {v.stored_token} position {v.position}{wanted})")


@dataclasses.dataclass(frozen=True)
class CanaryReport:
    """What :meth:`Canary.poll` found since the previous poll: its events, the rows recorded
    (``total``, ``dropped`` when the ring was full) and the verify launches skipped for capacity.
    ``forwards`` is different: every forward the canary has counted since it was built, eager and
    static."""

    events: tuple[CanaryEvent, ...] = ()
    total: int = 0
    dropped: int = 0
    capacity_overflows: int = 0
    forwards: int = 0

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[CanaryEvent]:
        return iter(self.events)

    def __getitem__(self, index: int) -> CanaryEvent:
        return self.events[index]

    def __bool__(self) -> bool:
        return self.total > 0

    @property
    def requests(self) -> set:
        """The requests the events name (their ``req_ids``, which must be hashable for this)."""
        named = [e.request for e in self.events if e.request is not None]
        try:
            return set(named)
        except Exception:  # an engine's id whose __hash__ raises what it likes
            unhashable = next(name for name in named if _unhashable(name))
            raise TypeError(f"{check.PREFIX}CanaryReport.requests needs hashable req_ids, got "
                            f"{type(unhashable).__name__} {_shown(unhashable)}: read each event's request instead") from None

    def counts_by_reason(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for event in self.events:
            for name in event.reasons:
                counts[name] = counts.get(name, 0) + 1
        return counts

    def counts_by_tag(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for event in self.events:
            name = tag_name(event.tag)
            counts[name] = counts.get(name, 0) + 1
        return counts

    def describe(self, limit: int = 20) -> str:
        """A line for the report and one for each of its first ``limit`` events (an int >= 0),
        with a count of the ones left out."""
        limit = check.non_negative("CanaryReport.describe limit", limit)
        lines = [f"kv-canary: {self.total} violation(s) since the previous poll ({self.forwards} forward(s) so far)"
                 + (f", {self.dropped} dropped by the ring" if self.dropped else "")
                 + (f", {self.capacity_overflows} verify launch(es) skipped: plan capacity exceeded"
                    if self.capacity_overflows else "")]
        lines += ["  " + e.describe() for e in self.events[:limit]]
        if len(self.events) > limit:
            lines.append(f"  ... {len(self.events) - limit} more")
        return "\n".join(lines)


def _shown(value: Any, what: str = "request id") -> str:
    """``repr(value)``, or ``<unprintable request id of type X>`` where its ``__repr__`` raises or
    returns no str: a request id is any object of the engine's, and one that cannot be shown must
    not cost a poll its report (``describe()`` is the logged message and the CanaryViolation's)."""
    try:
        return str.__str__(repr(value))  # an exact str: a str subclass's own __str__ or __format__ is not run
    except Exception:
        return f"<unprintable {what} of type {type(value).__name__}>"


def _unhashable(value: Any) -> bool:
    try:
        hash(value)
    except Exception:
        return True
    return False


class CanaryViolation(RuntimeError):
    """Raised by :meth:`Canary.poll` in ``raise`` mode; ``.report`` holds the decoded report."""

    def __init__(self, report: CanaryReport):
        super().__init__(report.describe())
        self.report = report

    def __reduce__(self):
        # rebuilt from its report, not from its message: pickled (a worker process's exception
        # handed to its parent) or copied, it keeps ``.report`` and its message
        return type(self), (self.report,), self.__dict__


# --- internals ---------------------------------------------------------------------------------
@dataclasses.dataclass
class _Launch:
    phase: str  # "head", "tail", "sweep" (verify launches), "write" or "move" (Canary.copy_records)
    tag: int
    step: int
    batch: Any  # ForwardBatch or LiveRequests (None for a move)
    write_loc: Any = None  # the slots the write used (SWA: translated), or a move's destinations

    @property
    def kind(self) -> str:
        """``"write"`` for the write launch, ``"move"`` for records copied in, ``"verify"`` for the others."""
        return self.phase if self.phase in ("write", "move") else "verify"


_PER_REQUEST_READ = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "seq_lens")  # what poll's mapping reads
_PER_TOKEN_READ = ("input_ids", "positions")


def _still_as_checked(batch: Any, expects_tokens: bool) -> bool:
    """Whether the per-request arrays of a logged batch that poll's mapping reads still have the
    form its forward's checks gave them: each 1-D, of an integer dtype and of one length (their
    values may be anything, as a refilled batch's are: the mapping reads them as it would hostile
    ones). ``expected_valid_lens`` is read, and was checked, only where the canary expects tokens.
    The per-token arrays only a write reads are judged against its slots
    (:func:`_entries_as_checked`); a verify's call, a ``before_forward``, neither checks nor reads
    them."""
    per_request = _PER_REQUEST_READ + (("expected_valid_lens",) if expects_tokens else ())
    lengths = [_vector_length(array) for array in (getattr(batch, name, None) for name in per_request)
               if array is not None]
    return None not in lengths and len(set(lengths)) <= 1


def _vector_length(array: Any) -> Optional[int]:
    """The length of a 1-D array of integers (None for any other), read from its own attributes
    where they say it (no view made: poll does this for every logged batch): NumPy's, CuPy's and
    JAX's dtypes are NumPy's, torch's says what it is. Any other array the calls took (they take
    anything that speaks DLPack) is read through a view, as the mapping reads it; one that no
    longer gives one is not as checked."""
    dtype = getattr(array, "dtype", None)
    if isinstance(dtype, np.dtype):
        integer = dtype.kind in "iu"
    elif hasattr(dtype, "is_floating_point") and hasattr(dtype, "is_complex"):  # torch's
        integer = not (dtype.is_floating_point or dtype.is_complex)
    else:
        try:
            array = native_view(array, "a logged batch array")
        except (TypeError, ValueError, BufferError, RuntimeError):
            return None
        integer = array.dtype.kind in "iu"
    shape = tuple(array.shape)
    return int(shape[0]) if integer and len(shape) == 1 else None


def _entries_as_checked(launch: _Launch) -> bool:
    """Whether a write launch's slots and its batch's ids and positions are still one per entry,
    as its forward checked them: the mapping reads an entry's id and position at the index of its
    slot, so an array resized in place shorter than the slots would fail the poll (and every later
    one, which finds the same rows)."""
    entries = _vector_length(launch.write_loc)
    return entries is not None and all(_vector_length(getattr(launch.batch, name)) == entries
                                       for name in _PER_TOKEN_READ)


@dataclasses.dataclass(eq=False)
class _StaticRecord:
    """A static forward as a group keeps it until it is closed: a weak reference (a forward the
    engine lets go of without ``close()`` is closed once collected, its arrays kept here for the
    poll that maps its last runs), or the forward itself once a graph captured it (the graph may
    replay over its buffers whoever else holds it), where its run count lies (which names it
    across groups), and its launches over the group."""

    forward: Any  # weakref.ref to the StaticForward
    run_count_at: tuple
    launches: list
    captured: Any = None  # the StaticForward, once captured in a graph

    @property
    def closed(self) -> bool:
        forward = self.captured or self.forward()
        return forward is None or forward.closed


class _Group:
    """The canary state of one KV pool (full or SWA)."""

    def __init__(self, name: str, ctx: CanaryContext, capacities: Capacities, device, window: int, lut: Any,
                 tags: tuple[int, int, int]):
        self.name = name
        self.ctx = ctx
        self.device = device
        self.window = window
        self.lut = lut
        # As the verify op passes them on: plain ints (a LaunchTag member crashes the numba backend).
        self.head_tag, self.tail_tag, self.sweep_tag = (launch_tag(tag) for tag in tags)
        self.vplan = VerifyPlan.allocate(capacities.verify_capacity, device=device)
        self.wplan = WritePlan.allocate(capacities.write_req_capacity, device=device)
        self.sweep_vplan: Optional[VerifyPlan] = None
        self.sweep_wplan: Optional[WritePlan] = None
        self.overflows = filled((1,), np.int64, device)
        settle(device)
        self.log: list[_Launch] = []
        # the static forwards until they are closed: poll matches the rows it cannot place in the log
        # against the forwards that ran since the previous poll, reading their arrays as they are
        # then (a replayed graph leaves no log behind)
        self.static_log: list[_StaticRecord] = []
        self.checks: dict = {}  # by tag, on a GPU: the packed verify and disabled-count launches


# The ForwardBatch arrays each part of a forward launches over: the plan's, then the write's.
_PLAN_FIELDS = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "expected_valid_lens")
_WRITE_FIELDS = ("input_ids", "positions", "out_cache_loc", "expected_input_tokens", "expected_input_positions",
                 "swa_out_cache_loc")


class _PreparedLaunches:
    """Launches prepared for arrays of one geometry (framework, shapes, strides, dtypes, device), for
    the geometries a session meets again: a decode batch of one size comes back forward after
    forward, whether in an engine's static buffers or in fresh tensors. A geometry met a second time
    gets its launches packed once (what ``kc.CanaryStep`` does for one); a call whose arrays have a
    prepared geometry is neither validated nor converted again (every rule depends on the geometry
    alone, and on the element alignment of the addresses, which ``launch_geometry`` checks), only
    its addresses are written into the packed parameters. The launches hold no reference to the
    caller's arrays (a cache must not keep an engine's tensors alive)."""

    def __init__(self):
        self.prepared = RecentlyUsed()
        self.met_once = RecentlyUsed()

    def get(self, geometry):
        """The launches prepared for ``geometry`` (a :class:`_Geometry` or None), or None."""
        return self.prepared.get(geometry.key) if geometry is not None else None

    def second_meeting(self, geometry) -> bool:
        """Whether ``geometry`` (a :class:`_Geometry` or None) was met before without being prepared
        (and remember it if not)."""
        if geometry is None:
            return False
        if self.met_once.pop(geometry.key):
            return True
        self.met_once.put(geometry.key)
        return False

    def put(self, geometry, entry):
        return self.prepared.put(geometry.key, entry)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """A forward's arrays of one part: their geometry (the cache's key), their addresses this call,
    and whether any is a torch tensor (whose stream CuPy's is made to wait for, as a view would)."""

    key: tuple
    addresses: list
    torch: bool


@dataclasses.dataclass(frozen=True)
class _Bound:
    """A prepared launch, and which of its parameters take which of the batch's addresses."""

    launch: Any
    bindings: tuple  # (parameter index, index into _Geometry.addresses)

    @classmethod
    def of(cls, launch, views: list) -> "_Bound":
        """``launch``, packed over this call's arrays, bound by ``views``: ``(array, slot)``, each
        array one the launch was given, to the index of its address in every call's addresses."""
        bindings = tuple((index, slot) for view, slot in views for index in launch.parameters_of(view))
        return cls(launch.detach(), bindings)

    def __call__(self, addresses: list, stream) -> None:
        self.launch.rebind(self.bindings, addresses)
        self.launch(stream)


def _views(bundle, slots: dict) -> list:
    """``(array, slot)`` of each of ``bundle``'s arrays named in ``slots`` (attribute -> slot)."""
    return [(getattr(bundle, name), slot) for name, slot in slots.items() if getattr(bundle, name) is not None]


@dataclasses.dataclass(frozen=True)
class _PreparedWrites:
    """The write part of a forward, prepared: each group's write and, when the batch does not give
    the SWA group's slots, their translation into a buffer of ``swa_entries`` each forward allocates
    (``swa_entries`` None: no such buffer)."""

    translate: Any
    writes: tuple
    swa_entries: Optional[int]


# --- argument checks (SPEC §4) of what only the session takes; the ops' own rules run through their
# --- argument bundles (PlanBatch, WriteBatch), all built before the first launch of a call ---------
def _sources(name: str, sources: Any, device: Device, slots: int) -> tuple:
    """``sources`` by CanaryContext's rules of type and device, checked here so that an SWA
    group's are named as such and refused before the full group's context is allocated; each must
    hold the KV of all ``slots`` slots of its pool (a smaller buffer is a wrong buffer or a wrong
    ``pool_slot_count``: every slot past it would be reported OUT_OF_RANGE)."""
    sources = source_list(name, sources)
    for index, source in enumerate(sources):
        check.one_device({"the canary": device, f"{name}[{index}].tensor": source.device})
        held = source.num_rows * source.page_size
        if held < slots:
            raise ValueError(f"{check.PREFIX}{name}[{index}] must hold the KV of every slot of its pool: "
                             f"{source.num_rows} rows x page_size {source.page_size} = {held} slots, "
                             f"fewer than the pool's {slots}")
    return sources


def _adopt(name: str, array: Any, device: Device, rule, *rule_args, keep: bool = False):
    """A zero-copy native view of ``array`` on the session's device, passing ``rule(name, view,
    *rule_args)``. For the tables the session keeps (checked at construction by the rule the ops
    apply, not at the first forward; ``keep``: a view of its own, see ``own_view``) and for the
    arrays the ops would check under another name (``LiveRequests.seq_lens`` becomes the plan's
    ``prefix_lens``)."""
    check.one_device({"the canary": device, name: device_of(array, name)})
    view = native_view(own_view(array) if keep else array, name, device)
    rule(name, view, *rule_args)
    return view


def _req_ids(req_ids: Any, req_pool_indices: Any) -> None:
    """Only ``poll`` reads them (``len`` and indexing), long after the call that took them; a str
    or a dict would index as a sequence of something else, and a longer list than the batch names
    requests it does not hold. The batch's rows are counted from ``req_pool_indices``' shape, which
    its own rules check later."""
    if req_ids is None:
        return
    if not isinstance(req_ids, (list, tuple, np.ndarray)) or (isinstance(req_ids, np.ndarray) and req_ids.ndim != 1):
        raise TypeError(f"{check.PREFIX}req_ids must be None or a list, tuple or 1-D NumPy array (one per batch "
                        f"row), got {type(req_ids).__name__} {_shown(req_ids, 'req_ids')}")
    rows = _batch_rows(req_pool_indices)
    if rows is not None and len(req_ids) > rows:
        raise ValueError(f"{check.PREFIX}req_ids must have at most one id per batch row (req_pool_indices has "
                         f"{rows}; rows past the ids, e.g. padding, are named by their index), "
                         f"got {len(req_ids)}")


def _batch_rows(req_pool_indices: Any) -> Optional[int]:
    """The batch's rows, counted from ``req_pool_indices``' shape where it is 1-D (None otherwise:
    its own rules, checked later, refuse it). An array that speaks DLPack alone has no ``shape``:
    its view's counts them, so that the rules bounded by the rows (``req_ids``,
    ``expected_valid_lens``) refuse for it what they refuse for any other array, under the names
    the batch gives."""
    shape = getattr(req_pool_indices, "shape", None)
    if shape is None and hasattr(req_pool_indices, "__dlpack__"):
        try:
            shape = native_view(req_pool_indices, "req_pool_indices").shape
        except (TypeError, ValueError, BufferError, RuntimeError):
            return None
    return int(shape[0]) if isinstance(shape, tuple) and len(shape) == 1 else None


class Canary:
    """A KV-cache canary session for one engine.

    Parameters are the engine's facts: ``pool_slot_count`` KV slots (slot 0 is the padding slot),
    its :class:`Capacities`, the ``req_to_token`` table (``int32 [rows, max_len]``, referenced in
    place), the ``device``, the real-KV sources (see :mod:`kvcanary_cupy.layouts`) and hash mode, the
    ring capacity and an optional :class:`SwaGroup`. ``expected_tokens`` (``int32``, at least
    ``req_to_token``'s rows and columns: the token id of every position, referenced in place) turns
    on expected-token checks in verify.
    ``mode`` is ``"off"`` (forwards, sweeps and polls return at once, but for the first poll after
    switching it off, which decodes what came before; ``static_forward`` still validates and binds
    its batch, so that the forward runs once the canary is on again), ``"log"`` (poll logs and
    returns the report) or ``"raise"`` (poll raises :class:`CanaryViolation` when anything was
    found). Between two polls the canary keeps the batches of at most ``max_logged_forwards``
    forwards and sweeps, to name the requests and steps of their rows; later ones are checked all
    the same, but that poll's rows get no step and theirs may name no request. ``logger`` (default: the ``kvcanary_cupy``
    logger) gets every warning as one formatted message, ``logger.warning(message)``; one that
    raises has the message given to the ``kvcanary_cupy`` logger instead.
    """

    def __init__(self, *, pool_slot_count: int, capacities: Capacities, req_to_token: Any, device: Any = "cpu",
                 real_kv_sources: Sequence[RealKvSource] = (), hash_mode: L.HashMode = L.HashMode.PARTIAL,
                 ring_capacity: int = 1024, mode: str = "log", swa: Optional[SwaGroup] = None,
                 expected_tokens: Optional[Any] = None, check_expected_token: Optional[bool] = None,
                 token_offset: int = 0, chain_position_assert: bool = False,
                 logger: Optional[logging.Logger] = None, max_logged_forwards: int = 1024):
        # Every argument is checked before anything is allocated.
        check.choice("mode", mode, MODES)
        check.instance("capacities", capacities, Capacities)
        device = parse_device(device)
        require_device(device)  # said first: every table would otherwise be refused as on another device
        pool_slot_count = check.slot_count("pool_slot_count", pool_slot_count)
        hash_mode = check.member("hash_mode", hash_mode, L.HashMode)
        real_kv_sources = _sources("real_kv_sources", real_kv_sources, device, pool_slot_count)
        req_to_token = _adopt("req_to_token", req_to_token, device, check.table, np.int32, keep=True)
        if expected_tokens is not None:
            expected_tokens = _adopt("expected_tokens", expected_tokens, device, check.table, np.int32, keep=True)
            # a row or a position past it is never checked, without a word
            if expected_tokens.shape[0] < req_to_token.shape[0]:
                raise ValueError(f"{check.PREFIX}expected_tokens must have a row for every req_to_token row: "
                                 f"rows >= {req_to_token.shape[0]}, got shape {check.shape_text(expected_tokens)}")
            if expected_tokens.shape[1] < req_to_token.shape[1]:
                raise ValueError(f"{check.PREFIX}expected_tokens must have a column for every req_to_token column "
                                 f"(position): columns >= {req_to_token.shape[1]}, got shape "
                                 f"{check.shape_text(expected_tokens)}")
        check_expected_token = (expected_tokens is not None if check_expected_token is None
                                else check.boolean("check_expected_token", check_expected_token))
        if check_expected_token and expected_tokens is None:  # nothing to check against: no token would be
            raise ValueError(f"{check.PREFIX}check_expected_token=True needs expected_tokens (the pool of the "
                             f"tokens each request expects), got expected_tokens=None")
        token_offset = check.int64_scalar("token_offset", token_offset)  # the plan's kv_token_id_vs_position_offset
        max_logged_forwards = check.positive("max_logged_forwards", max_logged_forwards)
        if logger is not None and not callable(getattr(logger, "warning", None)):
            raise TypeError(f"{check.PREFIX}logger must be None or a logging.Logger (anything with a warning "
                            f"method), got {type(logger).__name__} {logger!r}")
        if swa is not None:
            check.instance("swa", swa, SwaGroup)
            window = check.positive("SwaGroup.window", check.int64_scalar("SwaGroup.window", swa.window))
            lut = _adopt("SwaGroup.lut", swa.lut, device, check.vector, np.int64, keep=True)
            if lut.shape[0] < pool_slot_count:
                raise ValueError(f"{check.PREFIX}SwaGroup.lut must map every slot of the full pool: length >= "
                                 f"pool_slot_count={pool_slot_count}, got {lut.shape[0]}")
            swa_slots = check.slot_count("SwaGroup.num_slots", swa.num_slots)
            swa_sources = _sources("SwaGroup.real_kv_sources", swa.real_kv_sources, device, swa_slots)

        self._mode = mode
        # The mode the canary had when it was last switched off, until a poll decodes what the
        # launches made before the switch left (None: no such poll owed).
        self._owed_poll_mode: Optional[str] = None
        self.device = device
        self._capacities = capacities
        self._pool_slot_count = pool_slot_count
        self._hash_mode = hash_mode
        # Read-only (properties below): prepared launches take them in once.
        self._req_to_token = req_to_token
        self._expected_tokens = expected_tokens
        self._check_expected_token = check_expected_token
        self._token_offset = token_offset
        self.logger = logger if logger is not None else _LOG
        self.forwards = 0  # eager forwards
        # Every forward's number, as events' steps and CanaryReport.forwards count them: the eager
        # forwards and logged static runs as they come, the unlogged runs (replays) at each poll.
        self._numbered = 0
        self._logged_runs = 0  # static runs logged since the previous poll
        self._run_counts: list = []  # the StaticForwards' run counts, _RUN_COUNTS_PER_ARRAY an array
        self._static_forward_count = 0
        self._live_run_counts: list = []  # by count array: how many of its forwards a poll still reads
        self._planned: Any = None  # whose plans: a before_forward's batch, an eager before()'s StaticForward
        # The launches of at most max_logged_forwards forwards between two polls are logged (each
        # keeps its batch's arrays until the poll, and the poll's mapping walks them all); later
        # ones are only counted.
        self._max_logged_forwards = max_logged_forwards
        self._polled_at = 0  # _numbered at the previous poll
        self._sweeps = 0  # sweeps since the previous poll, which count toward the cap as forwards do
        self._unlogged = 0  # launches left out of the log since the previous poll
        # Each group's ring write index, copied on the stream before the first launch the log left
        # out since the previous poll (None while the log holds every launch): the rows before it
        # are the logged launches' alone.
        self._log_stops: Optional[list] = None
        self._changed_launches = 0  # launches dropped from it since: their arrays changed in place
        # by group: the (tag, write) of those launches, whose rows are not told from other launches'
        self._changed_kinds: dict[str, set] = {}
        # The report of a poll interrupted once it had made it, which the next poll hands over.
        self._unhanded: Optional[CanaryReport] = None
        # Closed static forwards let go of before a poll could map their runs (max_logged_forwards of
        # them wait): by count array, a mask of their cells, whose runs the next poll still counts.
        self._let_go: dict[int, int] = {}
        # The backends themselves: each call validates its bundles once, up front, for all its launches.
        self._plan_op = backend_module(device, "plan").plan
        self._verify_op = backend_module(device, "verify").verify
        self._write_op = backend_module(device, "write").write
        self._bookkeeping = backend_module(device, "session")
        full_ctx = CanaryContext.allocate(pool_slot_count, device=device, ring_capacity=ring_capacity,
                                          real_kv_sources=real_kv_sources, hash_mode=hash_mode,
                                          chain_position_assert=chain_position_assert)
        T = L.LaunchTag
        self.groups = [_Group("full", full_ctx, capacities, device, 0, None,
                              (T.HEAD_K_FULL, T.TAIL_K_FULL, T.SWEEP_K_FULL))]
        self.swa = swa
        if swa is not None:
            swa_ctx = CanaryContext.allocate(swa_slots, device=device, ring_capacity=ring_capacity,
                                             real_kv_sources=swa_sources, hash_mode=hash_mode,
                                             chain_position_assert=chain_position_assert)
            self.groups.append(_Group("swa", swa_ctx, capacities, device, window, lut,
                                      (T.HEAD_K_SWA, T.TAIL_K_SWA, T.SWEEP_K_SWA)))
        # The batch fields a forward's launches read (the others are ignored, as the ops ignore them).
        self._plan_fields = _PLAN_FIELDS if self._plans_expect_tokens else _PLAN_FIELDS[:3]
        self._write_fields = _WRITE_FIELDS if swa is not None else _WRITE_FIELDS[:5]
        self._prepared_plans = _PreparedLaunches()
        self._prepared_writes = _PreparedLaunches()

    # --- facts ------------------------------------------------------------------------------------
    @property
    def context(self) -> CanaryContext:
        """The full pool's :class:`CanaryContext` (canary buffer, ring, counters)."""
        return self.groups[0].ctx

    @property
    def swa_context(self) -> Optional[CanaryContext]:
        return self.groups[1].ctx if len(self.groups) > 1 else None

    @property
    def mode(self) -> str:
        """``"off"``, ``"log"`` or ``"raise"``; it may change between calls. Tokens written while it
        is off get no record: once it is on again, each verify that reads them reports them
        (POSITION or CHAIN_HASH, and REAL_KV_HASH when KV is hashed), so switch it back on only
        when no request or cached prefix holds such tokens, or expect those reports. While it is
        off, polls return at once, except the first one after the switch: it reports what the
        launches made before the switch found, and logs or raises as the mode it was switched off
        from would. It governs calls, not CUDA graphs: a graph that captured a static forward runs
        its kernels at every replay whatever the mode, and one captured while it was off runs
        none."""
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        mode = check.choice("mode", mode, MODES)
        if mode == "off" and self.enabled:
            self._owed_poll_mode = self._mode
        self._mode = mode

    @property
    def enabled(self) -> bool:
        return self._mode != "off"

    @property
    def capacities(self) -> Capacities:
        return self._capacities

    @property
    def _sweep_capacity(self) -> int:
        """The most requests a sweep takes: every live request has a row of ``req_to_token``, so a
        sweep of them all fits in its rows, however few requests a forward's write plan holds."""
        return max(self.capacities.write_req_capacity, int(self.req_to_token.shape[0]))

    @property
    def pool_slot_count(self) -> int:
        return self._pool_slot_count

    @property
    def hash_mode(self) -> L.HashMode:
        """The hash mode of every group's context, fixed at construction (read-only: the contexts
        hash as they were built)."""
        return self._hash_mode

    @property
    def req_to_token(self):
        """The engine's ``req_to_token`` table, referenced in place (a native view of it)."""
        return self._req_to_token

    @property
    def expected_tokens(self):
        return self._expected_tokens

    @property
    def check_expected_token(self) -> bool:
        return self._check_expected_token

    @property
    def token_offset(self) -> int:
        return self._token_offset

    @property
    def _plans_expect_tokens(self) -> bool:
        """Whether the plans fill expected tokens (from the table, bounded by
        ``ForwardBatch.expected_valid_lens``, which is ignored otherwise)."""
        return self.check_expected_token and self.expected_tokens is not None

    # --- per forward ------------------------------------------------------------------------------
    def _stream(self, stream: Any):
        """The call's stream on the canary's device, resolved (and so checked) once, before anything
        is launched."""
        if not self.device.is_cuda:
            check_stream_form(stream)
            return None
        return resolve_stream(stream, self.device)

    def _plans(self, req_pool_indices, prefix_lens, extend_seq_lens, valid_lens, *,
               sweep: bool = False) -> list[PlanBatch]:
        """Each group's plan bundle, validated by the plan op's rules, plus the checks the op makes
        against its plans (device, write-plan capacity: a forward's, or ``sweep``'s), all before the
        call launches anything."""
        expected = self.expected_tokens if self._plans_expect_tokens else None
        full = PlanBatch(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens,
                         req_to_token=self.req_to_token, req_to_verify_expected_tokens=expected,
                         req_to_verify_expected_tokens_valid_lens=None if expected is None else (
                             prefix_lens if valid_lens is None else valid_lens),
                         kv_token_id_vs_position_offset=self.token_offset)
        check.one_device({"the canary": self.device, "req_pool_indices": full.device})
        if sweep and full.batch_size > self._sweep_capacity:
            raise ValueError(f"{check.PREFIX}LiveRequests.req_pool_indices length must be <= {self._sweep_capacity}, "
                             f"the rows of req_to_token (or capacities.write_req_capacity, if more), "
                             f"got {full.batch_size}")
        if not sweep and full.batch_size > self.capacities.write_req_capacity:  # every forward's write plan's
            raise ValueError(f"{check.PREFIX}batch size (req_pool_indices length) must be <= "
                             f"capacities.write_req_capacity {self.capacities.write_req_capacity}, "
                             f"got {full.batch_size}")
        return [full if group.lut is None else full.for_window(group.window, group.lut) for group in self.groups]

    def _writes(self, batch: ForwardBatch, stream) -> list[WriteBatch]:
        """Each group's write bundle, validated by the write op's rules (the SWA group's slots
        translated on ``stream`` when the batch does not give them)."""
        full = WriteBatch(tag=self.groups[0].tail_tag, input_ids=batch.input_ids, positions=batch.positions,
                          out_cache_loc=batch.out_cache_loc, expected_input_tokens=batch.expected_input_tokens,
                          expected_input_positions=batch.expected_input_positions)
        check.one_device({"the canary": self.device, "input_ids": full.device})
        writes = [full]
        for group in self.groups[1:]:
            if batch.swa_out_cache_loc is not None:
                loc = _adopt("swa_out_cache_loc", batch.swa_out_cache_loc, self.device, check.vector, np.int64,
                             full.num_entries, "one per entry, as input_ids")
            else:
                with on_device(self.device, stream):  # allocated (and zeroed) on the stream that fills it
                    loc = filled((full.num_entries,), np.int64, self.device)
                    self._bookkeeping.translate_slots(full.out_cache_loc, group.lut, loc, stream=stream)
            writes.append(full.for_group(group.tail_tag, loc))
        return writes

    def _check(self, group: _Group, vplan: VerifyPlan, tag: int, stream) -> None:
        """Verify ``vplan`` and count the launch if its plan disabled it, both on ``stream``."""
        self._verify_op(group.ctx, vplan, tag=tag, check_expected_token=self.check_expected_token, stream=stream)
        self._bookkeeping.count_disabled(vplan, group.overflows, stream=stream)  # read by poll()

    def _prepare_checks(self) -> None:
        """On a GPU, pack every group's head and tail checks (verify, then the disabled count: they
        take only the session's own arrays) once, at the first forward, before it launches
        anything, on the current device."""
        if not self.device.is_cuda or self.groups[0].checks:
            return
        verify = backend_module(self.device, "verify")
        for group in self.groups:
            group.checks = {tag: (verify.prepare(group.ctx, group.vplan, tag=tag,
                                                 check_expected_token=self.check_expected_token, packed=True),
                                  self._bookkeeping.prepare_count_disabled(group.vplan, group.overflows, packed=True))
                            for tag in (group.head_tag, group.tail_tag)}

    def _forward_check(self, group: _Group, tag: int, stream) -> None:
        """:meth:`_check` of ``group``'s forward plan, through its packed launches on a GPU."""
        if not self.device.is_cuda:
            self._check(group, group.vplan, tag, stream)
            return
        for launch in group.checks[tag]:
            launch(stream)

    def _geometry(self, batch: Any, fields: tuple[str, ...]) -> Optional[_Geometry]:
        """The geometry and addresses of ``batch``'s ``fields`` (a ForwardBatch's or LiveRequests'; an
        absent one: None and 0), or None where an array's geometry is not known (host arrays, other
        frameworks' device arrays) or its address is misaligned: the validating path then takes the
        call."""
        if not self.device.is_cuda:
            return None
        key, addresses, torch = [], [], False
        for name in fields:
            value = getattr(batch, name)
            found = None if value is None else launch_geometry(value)
            if found is None:
                if value is not None:
                    return None
                found = (None, 0)
            key.append(found[0])
            addresses.append(found[1])
            torch = torch or (found[0] is not None and found[0][0] == "torch")
        # Which fields share an array: a launch prepared over one array passed twice points both
        # parameters at it, so it serves only batches that share it the same way.
        key.append(tuple(addresses.index(address) for address in addresses))
        return _Geometry(tuple(key), addresses, torch)

    # --- packed launches (a GPU's, on its current device): bound to the batch's addresses for the
    # --- prepared geometries, or kept over a static forward's own arrays
    def _pack_plans(self, plans: list[PlanBatch]) -> tuple:
        """Each group's plan launch over ``plans``' arrays."""
        backend = backend_module(self.device, "plan")
        return tuple(backend.prepare(group.vplan, group.wplan, plan, packed=True)
                     for group, plan in zip(self.groups, plans))

    def _pack_writes(self, writes: list[WriteBatch]) -> tuple:
        """Each group's write launch over ``writes``' arrays."""
        backend = backend_module(self.device, "write")
        return tuple(backend.prepare(group.ctx, group.wplan, write, packed=True)
                     for group, write in zip(self.groups, writes))

    def _pack_translate(self, writes: list[WriteBatch]):
        """The SWA group's slots translated from the full group's into ``writes[1]``'s (None for a
        batch without entries)."""
        return self._bookkeeping.prepare_translate_slots(writes[0].out_cache_loc, self.groups[1].lut,
                                                         writes[1].out_cache_loc, packed=True)

    def _prepare_plans(self, batch: ForwardBatch, plans: list[PlanBatch]) -> tuple:
        fields = self._plan_fields
        slots = {name: fields.index(name) for name in _PLAN_FIELDS[:3]}
        if self._plans_expect_tokens:  # the valid lengths are the batch's own, or its prefix lengths
            valid_lens = "expected_valid_lens" if batch.expected_valid_lens is not None else "prefix_lens"
            slots["req_to_verify_expected_tokens_valid_lens"] = fields.index(valid_lens)
        return tuple(_Bound.of(launch, _views(plan, slots)) for launch, plan in zip(self._pack_plans(plans), plans))

    def _prepare_writes(self, batch: ForwardBatch, writes: list[WriteBatch]) -> _PreparedWrites:
        """``writes`` (from :meth:`_writes`, this call's) as packed launches. An SWA group's slots,
        when the batch does not give them, are translated by a launch of the entry into a buffer
        each forward allocates (its address is the last one bound), as the validating path does."""
        fields = self._write_fields
        slots = {name: fields.index(name) for name in _WRITE_FIELDS[:5]}
        group_slots = [slots]
        translate = swa_entries = None
        if len(writes) > 1:
            if batch.swa_out_cache_loc is not None:
                group_slots.append(dict(slots, out_cache_loc=fields.index("swa_out_cache_loc")))
            else:
                per_forward = len(fields)
                group_slots.append(dict(slots, out_cache_loc=per_forward))
                swa_entries = writes[0].num_entries
                launch = self._pack_translate(writes)
                if launch is not None:
                    translate = _Bound.of(launch, [(writes[0].out_cache_loc, slots["out_cache_loc"]),
                                                   (writes[1].out_cache_loc, per_forward)])
        launches = tuple(_Bound.of(launch, _views(write, bound))
                         for launch, write, bound in zip(self._pack_writes(writes), writes, group_slots))
        return _PreparedWrites(translate, launches, swa_entries)

    def _write_addresses(self, batch: ForwardBatch, prepared: _PreparedWrites, geometry: _Geometry, stream):
        """A prepared forward's write addresses and each group's written slots (which ``poll``
        reads): the SWA group's translated by the entry's launch into a buffer of this forward's."""
        addresses, slots = geometry.addresses, [batch.out_cache_loc]
        if len(self.groups) > 1:
            if prepared.swa_entries is None:
                slots.append(batch.swa_out_cache_loc)
            else:
                translated = cupy_module().empty((prepared.swa_entries,), np.int64)  # every cell is written
                addresses = addresses + [translated.data.ptr]
                if prepared.translate is not None:
                    prepared.translate(addresses, stream)
                slots.append(translated)
        return addresses, slots

    def _warn(self, message: str) -> None:
        """Say ``message`` through the canary's logger, formatted here and passed alone (the logger
        may be anything with a ``warning`` method, taking the message only). A logger of the engine's
        that raises loses nothing: the message goes to the package's logger instead, with the
        failure, and the call that warned carries on (a poll still returns or raises its report, a
        forward still runs every launch)."""
        try:
            self.logger.warning(message)
        except Exception:
            _LOG.warning("kv-canary: the canary's logger (%s) raised on a warning, given here instead:\n%s",
                         type(self.logger).__name__, message, exc_info=True)

    def _warn_if_unfinished(self, starting: str) -> None:
        """A forward may be dropped after its before; one that ran left its tokens unfingerprinted."""
        if self._planned is not None:
            self._warn(
                f"kv-canary: {starting}, but the previous forward's before had no after: if its forward ran, its "
                f"new tokens were not fingerprinted, and each verify that reads them reports them (CHAIN_HASH, "
                f"POSITION, REAL_KV_HASH)")

    def before_forward(self, batch: ForwardBatch, *, stream: Any = None) -> None:
        """Plan the batch and verify every prefix slot it is about to read (HEAD)."""
        if not self.enabled:
            self._planned = None  # a forward of its own: an after_forward once on again plans it
            return
        check.instance("batch", batch, ForwardBatch)
        _req_ids(batch.req_ids, batch.req_pool_indices)
        geometry, prepared = self._lookup(self._prepared_plans, batch, self._plan_fields)
        plans = None if prepared is not None else self._batch_plans(batch)
        stream = self._stream(stream)
        self._warn_if_unfinished("before_forward")  # told once the call is accepted: a refused one changes nothing
        with on_device(self.device, stream):
            self._order_after_torch(geometry)
            self._prepare_checks()
            if prepared is None and self._prepared_plans.second_meeting(geometry):
                prepared = self._prepared_plans.put(geometry, self._prepare_plans(batch, plans))
            step = self._next_forward(stream)
            for index, group in enumerate(self.groups):
                self._launch_plan(group, index, plans, prepared, geometry, stream)
                self._forward_check(group, group.head_tag, stream)
                self._log(group, _Launch("head", group.head_tag, step, batch))
        self._planned = batch

    def _batch_plans(self, batch: ForwardBatch) -> list[PlanBatch]:
        valid_lens = batch.expected_valid_lens
        if valid_lens is not None and self._plans_expect_tokens:  # checked under the name the engine gave it
            # its length too, where the batch's rows are counted (req_pool_indices' own rules run later)
            valid_lens = _adopt("expected_valid_lens", valid_lens, self.device, check.vector, np.int64,
                                _batch_rows(batch.req_pool_indices), "one per request, as req_pool_indices")
        return self._plans(batch.req_pool_indices, batch.prefix_lens, batch.extend_seq_lens, valid_lens)

    def _lookup(self, cache: _PreparedLaunches, batch: ForwardBatch, fields: tuple[str, ...]):
        """``(geometry, prepared)``: the geometry of ``batch``'s ``fields`` and ``cache``'s launches for
        it (None for none)."""
        geometry = self._geometry(batch, fields)
        return geometry, cache.get(geometry)

    def _order_after_torch(self, *geometries: Optional[_Geometry]) -> None:
        """Make the stream the call launches on (CuPy's current one inside ``on_device``) wait, once, for
        torch's current stream when any of the call's arrays is a torch tensor, as a DLPack exchange
        makes its consumer wait: a prepared launch builds no view that would, and a view waits on
        CuPy's stream outside ``on_device``, which a ``stream=`` argument can make another one."""
        if any(geometry is not None and geometry.torch for geometry in geometries):
            order_after_torch(self.device.index)

    def _log(self, group: _Group, *launches: _Launch) -> None:
        """Log ``launches`` for the next poll, unless more than ``max_logged_forwards`` forwards and
        sweeps have run since the previous one: then they are only counted, their arrays not kept,
        and none of that poll's rows gets a step (said once, when it first happens)."""
        if not launches:
            return
        if self._numbered - self._polled_at + self._sweeps <= self._max_logged_forwards:
            group.log.extend(launches)
            return
        if not self._unlogged:
            self._warn(
                f"kv-canary: more than {self._max_logged_forwards} forwards and sweeps since the last poll(): the "
                f"canary still checks and fingerprints every forward, but logs no more of them until it polls, so "
                f"that poll's violations past the logged forwards' get no step and name no request (poll more "
                f"often, or raise max_logged_forwards)")
        self._unlogged += len(launches)

    def _note_where_the_log_stops(self, stream: Any, ahead: int) -> None:
        """Before the launches of the first forward or sweep since the previous poll that the log
        will leave out (``ahead``: the forwards about to be counted), copy each group's ring write
        index on ``stream``, the launches' own (a captured graph's runs are never logged, nor noted).
        poll then names the rows before the copy from the log as if it were whole, and leaves the
        later ones unnamed: no batch of their launches is kept, and a row one of them recorded may
        fit a logged launch's entries (a prefix shared with a forward that read the slot while it
        was sound)."""
        if self._log_stops is not None or stream_capturing(stream):
            return
        if self._numbered + ahead - self._polled_at + self._sweeps <= self._max_logged_forwards:
            return
        with on_device(self.device, stream):
            self._log_stops = [group.ctx.violation_write_index.copy() for group in self.groups]

    def _next_forward(self, stream: Any) -> int:
        """Count an eager forward, about to launch on ``stream``; its number."""
        self._note_where_the_log_stops(stream, 1)
        self.forwards += 1
        self._numbered += 1
        return self._numbered

    def _launch_plan(self, group: _Group, index: int, plans, prepared, geometry, stream) -> None:
        if prepared is not None:
            prepared[index](geometry.addresses, stream)
        else:
            self._plan_op(group.vplan, group.wplan, plans[index], stream=stream)

    def after_forward(self, batch: ForwardBatch, *, stream: Any = None) -> None:
        """Fingerprint the batch's new tokens (their KV must be written by now), then re-verify the
        prefix slots the forward read (TAIL).

        ``batch`` may be another batch than ``before_forward``'s, over the same requests and
        prefixes: the tokens the forward keeps. A speculative decoding step verifies k drafts a
        request and keeps those the target accepts; passing only those fingerprints the kept path,
        which a draft tree's flat order does not chain. It is the same forward (one step in
        reports); an ``after_forward`` with no ``before_forward`` before it counts a forward of its
        own."""
        if not self.enabled:
            self._planned = None  # the forward is over, whether or not its before was planned
            return
        check.instance("batch", batch, ForwardBatch)
        _req_ids(batch.req_ids, batch.req_pool_indices)
        stream = self._stream(stream)
        replan = self._planned is not batch
        opens_forward = self._planned is None
        plan_geometry = prepared_plans = plans = None
        if replan:
            plan_geometry, prepared_plans = self._lookup(self._prepared_plans, batch, self._plan_fields)
            plans = None if prepared_plans is not None else self._batch_plans(batch)
        write_geometry, prepared_writes = self._lookup(self._prepared_writes, batch, self._write_fields)
        with on_device(self.device, stream):  # before the call's first launch: _writes may translate SWA slots
            self._order_after_torch(plan_geometry, write_geometry)
        writes = None if prepared_writes is not None else self._writes(batch, stream)
        with on_device(self.device, stream):
            self._prepare_checks()
            if plans is not None and self._prepared_plans.second_meeting(plan_geometry):
                prepared_plans = self._prepared_plans.put(plan_geometry, self._prepare_plans(batch, plans))
            if writes is not None and self._prepared_writes.second_meeting(write_geometry):
                # for the forwards to come; this one's writes are ready (its SWA slots translated)
                self._prepared_writes.put(write_geometry, self._prepare_writes(batch, writes))
            if writes is not None:
                slots = [write.out_cache_loc for write in writes]
            else:
                addresses, slots = self._write_addresses(batch, prepared_writes, write_geometry, stream)
            if replan:
                if opens_forward:
                    self._next_forward(stream)
                for index, group in enumerate(self.groups):
                    self._launch_plan(group, index, plans, prepared_plans, plan_geometry, stream)
            for index, group in enumerate(self.groups):
                if writes is not None:
                    self._write_op(group.ctx, group.wplan, writes[index], stream=stream)
                else:
                    prepared_writes.writes[index](addresses, stream)
                self._forward_check(group, group.tail_tag, stream)
                self._log(group,
                          _Launch("write", group.tail_tag, self._numbered, batch, write_loc=slots[index]),
                          _Launch("tail", group.tail_tag, self._numbered, batch))
        self._planned = None

    def static_forward(self, batch: ForwardBatch) -> "StaticForward":
        """The canary's part of every forward over ``batch``'s arrays, validated and prepared once:
        for an engine that refills the same arrays in place each forward, and for a forward captured
        in a CUDA graph. Call :meth:`StaticForward.before` and :meth:`StaticForward.after` where
        :meth:`before_forward` and :meth:`after_forward` would go (inside the capture, with the
        capturing stream as ``stream=``); build it outside any capture. ``poll`` maps what its
        launches find to requests from the arrays as they are when it polls; a run made eagerly has
        its step, a replay only when it is the only forward since the previous poll."""
        check.instance("batch", batch, ForwardBatch)
        _req_ids(batch.req_ids, batch.req_pool_indices)
        return StaticForward(self, batch)

    def sweep(self, live_requests: LiveRequests, *, stream: Any = None) -> None:
        """Verify every cached token of ``live_requests`` (the last ``window`` of them in the SWA group)."""
        if not self.enabled:
            return
        check.instance("live_requests", live_requests, LiveRequests)
        _req_ids(live_requests.req_ids, live_requests.req_pool_indices)
        rows = _adopt("LiveRequests.req_pool_indices", live_requests.req_pool_indices, self.device, check.vector,
                      np.int64)
        bs = int(rows.shape[0])
        seq_lens = _adopt("LiveRequests.seq_lens", live_requests.seq_lens, self.device, check.vector, np.int64, bs,
                          "one per request, as req_pool_indices")
        stream = self._stream(stream)
        if bs == 0:
            return
        with on_device(self.device, stream):
            zeros = filled((bs,), np.int64, self.device)
        plans = self._plans(rows, seq_lens, zeros, None, sweep=True)
        for group in self.groups:
            # Allocated (and settled) on the current stream, as a group's other plans are, before
            # the launches' stream is made current.
            if group.sweep_vplan is None:
                group.sweep_vplan = VerifyPlan.allocate(self.capacities.verify_capacity, device=self.device)
                group.sweep_wplan = WritePlan.allocate(self._sweep_capacity, device=self.device)
        self._sweeps += 1
        with on_device(self.device, stream):
            self._order_after_torch(self._geometry(live_requests, ("req_pool_indices", "seq_lens")))
            self._note_where_the_log_stops(stream, 0)
            for group, plan in zip(self.groups, plans):
                self._plan_op(group.sweep_vplan, group.sweep_wplan, plan, stream=stream)
                self._check(group, group.sweep_vplan, group.sweep_tag, stream)
                self._log(group, _Launch("sweep", group.sweep_tag, self._numbered, live_requests))

    # --- host side --------------------------------------------------------------------------------
    def copy_records(self, *, src: CanaryContext, dst: CanaryContext, src_slots: Any, dst_slots: Any,
                     stream: Any = None) -> None:
        """:func:`kc.copy_records <kvcanary_cupy.copy_records>`, told to the canary. Where ``dst`` is
        one of its contexts (:attr:`context`, :attr:`swa_context`: a reload from a host tier, a
        compaction within the pool), the next poll knows that ``dst_slots`` got other records
        between the forwards around the call: a violation row showing such a record is never named
        for a request whose forward read the slot before the copy, and one showing the record the
        slot held before is named for the forwards that read it then. Records copied into the pool
        by ``kc.copy_records`` itself leave the poll to guess when they arrived (such rows keep
        their phase alone), as do the replays of this call captured in a CUDA graph (the capture
        tells the canary nothing)."""
        move = RecordCopy(src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots)
        dst_stream = run_record_copy(move, stream)
        group = next((group for group in self.groups if group.ctx is move.dst), None)
        if group is None or not self.enabled or move.count == 0 or stream_capturing(dst_stream):
            return
        # its own array (the caller's may be refilled before the poll reads it), without the pairs
        # that store nothing (a slot out of range): their destinations keep the records they had
        slots = stored_destinations(move, dst_stream)
        self._log(group, _Launch("move", -1, self._numbered, None, write_loc=slots))

    def poll(self) -> CanaryReport:
        """Synchronise, decode every group's ring, map violations to requests, clear the rings.

        ``log`` mode logs a non-empty report; ``raise`` mode raises :class:`CanaryViolation`. While
        the canary is off it returns at once, once the first poll after the switch has decoded
        (in the mode switched off from) what the launches before it left.

        An exception that interrupts a poll (KeyboardInterrupt, MemoryError, a logger's
        KeyboardInterrupt) loses no violation; at worst one is reported twice. Until its report is
        made and logged (or its CanaryViolation made), a poll changes nothing the next one reads
        but the log's launches whose arrays changed in place, which it drops as the next would:
        interrupted there, it leaves every row to the next poll, which names them as it would
        have. It then empties the rings and forgets the log and the counts, holding the report
        until it is done: interrupted there, it leaves the report to the next poll, which hands it
        over before its own events. Those get no step (the rings and the log it left need not
        agree) and repeat the rows and the skipped verify launches of a group it had not emptied,
        and that poll's ``forwards`` may count the graph replays of the interrupted span twice or
        not at all."""
        acting_mode = self._mode if self.enabled else self._owed_poll_mode
        if acting_mode is None:
            return CanaryReport(forwards=self._numbered)
        events: list[CanaryEvent] = []
        total = dropped = overflows = 0
        ran, runs, stray, counts_read = self._static_forwards_ran()
        replays = max(0, runs - self._logged_runs)
        eager = self._numbered > self._polled_at  # eager forwards since the previous poll, logged or not
        self._drop_changed_launches()
        unhanded = self._unhanded
        # Replays leave no trace on the host: their places among the eager forwards are not known
        # (those past max_logged_forwards too, though the log keeps none of them), nor which of
        # several is which; one replay alone since the previous poll is the next forward.
        # A forward closed and let go that ran again by mistake (stray) is no forward: its rows may
        # fit the others' entries, whose steps are then not known either. After a poll interrupted
        # once it had made its report, the rings and the log may not agree. Past max_logged_forwards
        # the rows after each ring's noted write index are the unlogged launches' (and are left
        # unnamed); those before it, the logged ones' alone.
        stops = self._log_stops if unhanded is None else None
        capped = self._unlogged > 0 and stops is None or self._changed_launches > 0 or unhanded is not None
        steps_known = not stray and not (replays and eager) and not capped
        mapper = RowMapper(self, replay_step=self._numbered + 1 if replays == 1 and steps_known else None,
                           log_capped=capped)
        overflowed, recorded = [], []  # the groups whose counts and rings the poll empties
        for number, group in enumerate(self.groups):
            raw = group.ctx.violations()
            group_overflows = int(to_host(group.overflows)[0])
            if group_overflows:
                overflows += group_overflows
                overflowed.append(group)
            if raw.total:
                # a ring that dropped rows keeps the first ones, as a capped log keeps the first launches
                named = self._named_rows(mapper, group, raw, None if stops is None else stops[number], capped, ran)
                if replays or stray or capped:  # a sweep's place beside a replay is not known either
                    named = [(phase, step if steps_known and phase != "sweep" else None, request, position)
                             for phase, step, request, position in named]
                events.extend(CanaryEvent(group.name, phase, step, v.slot_idx, request, position, v)
                              for v, (phase, step, request, position) in zip(raw.rows, named))
                total += raw.total
                dropped += raw.dropped
                recorded.append(group)
        report = CanaryReport(tuple(events), total, dropped, overflows, self._numbered + replays)
        if unhanded is not None:  # found before this poll's rows
            report = CanaryReport(unhanded.events + report.events, unhanded.total + report.total,
                                  unhanded.dropped + report.dropped,
                                  unhanded.capacity_overflows + report.capacity_overflows, report.forwards)
        violation = None
        if report.total or report.capacity_overflows:
            if acting_mode == "raise" and report.total:
                violation = CanaryViolation(report)
            else:
                self._warn(report.describe())
        self._forget_polled(report, counts_read, replays, overflowed, recorded)
        if violation is not None:
            raise violation
        return report

    def _named_rows(self, mapper: RowMapper, group: _Group, raw, stop: Any, capped: bool, ran: set) -> list[tuple]:
        """``(phase, step, request, position)`` of each row of ``raw`` (a group's ring as read): the
        rows before ``stop`` (the ring's noted write index, None while the log holds every launch)
        and of no kind a dropped launch had mapped from the log, the others by their phase alone."""
        logged = raw.rows if stop is None else raw.rows[:ring_index(stop)]
        # the logged launches' rows all kept, or some of them dropped by a full ring
        dropped = raw.dropped > 0 if stop is None else ring_index(stop) > len(logged)
        changed = self._changed_kinds.get(group.name, set())
        mapped = [i for i, v in enumerate(logged) if (int(v.kernel_kind), mapper.is_write_row(group, v)) not in changed]
        named = [mapper.phase_only(group, v) for v in raw.rows]
        for i, name in zip(mapped, mapper.resolve(group, [logged[i] for i in mapped], dropped or capped, ran)):
            named[i] = name
        return named

    def _forget_polled(self, report: CanaryReport, counts_read: list, replays: int, overflowed: list,
                       recorded: list) -> None:
        """Once ``report`` is made: empty each group's ring and skipped-launch count it read, then
        forget the log, the closed static forwards and the counts it was made from. The report is
        held meanwhile (``_unhanded``): an interruption here leaves it to the next poll, whose own
        rows then get no step (the log and the rings may not agree), and a group not yet emptied
        has its rows and skipped launches reported again (so none is, once the groups are)."""
        self._unhanded = report
        for group in self.groups:
            if group in recorded:
                group.ctx.clear_violations()
            if group in overflowed:
                assign(group.overflows, 0, group.device)
                settle(group.device)
        for group in self.groups:
            group.log.clear()
        self._zero_run_counts(counts_read)
        self._numbered += replays
        self._drop_closed_static_forwards()
        self._logged_runs = 0
        self._polled_at, self._sweeps, self._unlogged, self._changed_launches = self._numbered, 0, 0, 0
        self._log_stops, self._changed_kinds = None, {}
        self._owed_poll_mode = None
        self._unhanded = None

    def _drop_changed_launches(self) -> None:
        """Leave out of the log the eager launches whose batch arrays the engine reshaped or re-typed
        in place since their forward (a static forward's are views of its own), rather than this
        poll and every later one failing on arrays of another shape (said in a warning). Their
        entries are not known, so no row of their kind (their group's launch tag, a write's or a
        verify's) gets a step or a request: any of them may be theirs, and fit another launch's
        entries too. Counted until a poll completes (``_changed_launches``, ``_changed_kinds``),
        so that a poll after an interrupted one knows its log is not whole."""
        dropped, judged = 0, {}  # by batch (a forward's launches share it): whether it is as checked
        for group in self.groups:
            kept = []
            for launch in group.log:
                if launch.kind == "move":  # its own copy of its slots, no batch
                    kept.append(launch)
                    continue
                write, batch = launch.kind == "write", id(launch.batch)
                if batch not in judged:
                    judged[batch] = _still_as_checked(launch.batch, self._plans_expect_tokens)
                if judged[batch] and (launch.write_loc is None or _entries_as_checked(launch)):
                    kept.append(launch)
                else:
                    self._changed_kinds.setdefault(group.name, set()).add((launch.tag, write))
            dropped += len(group.log) - len(kept)
            group.log[:] = kept
        self._changed_launches += dropped
        if dropped:
            self._warn(
                f"kv-canary: {dropped} launch(es) since the last poll() read batch arrays that have been reshaped "
                f"or re-typed in place since: violations of their kind (their launch tag) since the last poll(), "
                f"theirs or not, get no step and name no request (keep a batch's arrays as they are until the "
                f"poll after its forward)")

    def stats(self) -> dict[str, dict[str, int]]:
        """Each group's health counters (synchronises): its launches (``kernel_run_counter``) and the
        entries they checked or wrote (``slot_run_counter``) since the canary was built, and
        ``violations``, the rows recorded since the last poll (a poll empties the rings; past 2^31
        rows the ring's int32 write index reads negative, and the count goes on as its unsigned
        value, as ``violations().total`` does)."""
        return {group.name: group.ctx.counters() for group in self.groups}

    # --- static forwards' runs, counted on the device ---------------------------------------------
    def _run_counter(self) -> tuple[Any, tuple[int, int]]:
        """A new static forward's run count: a cell of one of the canary's count arrays (its address
        never moves: a captured graph holds it), and where it lies, so that a poll reads every count
        in one copy an array. A cell serves one forward only: a closed forward's graph may still be
        replayed by mistake, and must not count as a later forward's runs."""
        index = self._static_forward_count % _RUN_COUNTS_PER_ARRAY
        if index == 0:
            self._run_counts.append(filled((_RUN_COUNTS_PER_ARRAY,), np.int64, self.device))
            self._live_run_counts.append(0)
            settle(self.device)
        self._static_forward_count += 1
        array = len(self._run_counts) - 1
        self._live_run_counts[array] += 1
        return self._run_counts[array][index:index + 1], (array, index)

    def _drop_closed_static_forwards(self) -> None:
        """Forget the closed static forwards, their runs counted and mapped by this poll; a count
        array none of whose forwards is left is read by no later poll."""
        closed = {record.run_count_at for record in self._closed_static_records()}
        self._forget_static_forwards(closed)
        for array, _ in closed:
            self._live_run_counts[array] -= 1
        while self._let_go:  # each taken out before it is subtracted: interrupted, a count stays high, never low
            array, cells = self._let_go.popitem()
            self._live_run_counts[array] -= bin(cells).count("1")

    def _hold_closed_static_forwards(self) -> None:
        """When a static forward is built or closed: keep at most ``max_logged_forwards`` closed
        ones (each holds its arrays) for the next poll, as the log keeps forwards, letting go of
        the oldest. Polls let go of them all, but not while the canary is off (they return at
        once, bar the first), nor when they are rare: an engine that rebuilds its forwards
        meanwhile would pile them up. A forward let go of keeps its run count cell, so the next
        poll still counts its runs as forwards; its logged runs keep their steps and names (the log
        holds their batches), but a row only its unlogged runs explain (a graph's replays) names no
        request (said once a poll)."""
        closed = self._closed_static_records()
        excess = len(closed) - self._max_logged_forwards
        if excess <= 0:
            return
        if not self._let_go and self.enabled:
            self._warn(
                f"kv-canary: more than {self._max_logged_forwards} closed static forwards since the last poll(): "
                f"the canary lets go of the oldest, so the violations only their graph replays explain name no "
                f"request (poll more often, or raise max_logged_forwards)")
        let_go = {record.run_count_at for record in closed[:excess]}
        for array, index in let_go:
            self._let_go[array] = self._let_go.get(array, 0) | 1 << index
        self._forget_static_forwards(let_go)

    def _closed_static_records(self) -> list:
        """The closed static forwards still held, oldest first (one record each in every group)."""
        return [record for record in self.groups[0].static_log if record.closed]

    def _forget_static_forwards(self, run_counts_at: set) -> None:
        """Drop the records, in every group, of the static forwards whose run counts lie there."""
        for group in self.groups:
            group.static_log[:] = [record for record in group.static_log
                                   if record.run_count_at not in run_counts_at]

    def _static_forwards_ran(self) -> tuple[set, int, int, list]:
        """The static forwards (by where their run counts lie) that ran since the previous poll,
        their runs, the runs counted in the cells of forwards let go (run by mistake), and the
        count arrays read, which the poll zeroes once its report is made (:meth:`_zero_run_counts`)."""
        live = [index for index, forwards in enumerate(self._live_run_counts) if forwards]
        if not live:
            return set(), 0, 0, []
        self.context._wait_for_device()  # the counts are added on the streams the forwards ran on
        counts = {index: np.array(to_host(self._run_counts[index])) for index in live}  # copies: zeroed later
        ran, runs = set(), 0
        for group in self.groups:
            for record in group.static_log:
                array, index = record.run_count_at
                if counts[array][index] and record.run_count_at not in ran:
                    ran.add(record.run_count_at)
                    runs += int(counts[array][index])
        for array, cells in self._let_go.items():
            runs += sum(int(count) for index, count in enumerate(counts[array]) if cells >> index & 1)
        return ran, runs, int(sum(int(count.sum()) for count in counts.values())) - runs, live

    def _zero_run_counts(self, arrays: list) -> None:
        """Zero the run count arrays a poll read (indices into ``_run_counts``)."""
        for index in arrays:
            assign(self._run_counts[index], 0, self.device)
        if arrays:
            settle(self.device)


class StaticForward:
    """The canary's part of every forward over one :class:`ForwardBatch`'s arrays, validated and
    prepared once (:meth:`Canary.static_forward`).

    The arrays are bound here: the engine refills them in place before each forward (``req_ids``
    too, when given: the list is read at poll). ``before`` plans the batch and verifies every prefix
    slot it reads (HEAD), ``after`` fingerprints its new tokens and verifies the prefix again
    (TAIL), exactly as :meth:`Canary.before_forward` and :meth:`Canary.after_forward` would for the
    arrays' contents at that moment. On a GPU both are packed kernel launches and nothing else (a
    run count included), so they can be captured in a CUDA graph with the forward and replayed; on
    the CPU they run the ops. The canary's ``mode`` is read when they are called: a captured graph
    replays what was captured. :meth:`close` lets go of it: the next poll still counts and maps
    its runs, later ones do not.
    """

    def __init__(self, canary: Canary, batch: ForwardBatch):
        self.batch = batch
        self._canary = canary
        plans = canary._batch_plans(batch)
        stream = canary._stream(None)
        writes = canary._writes(batch, stream)  # the SWA group's slots, when translated, in a buffer kept here
        settle(canary.device)  # that buffer's fill and translation, queued on the current stream, done before any run
        groups = canary.groups
        translates = len(groups) > 1 and batch.swa_out_cache_loc is None
        # its runs since the last poll, counted where they run
        self.runs, self.run_count_at = canary._run_counter()
        self._translate = None
        self._geometries: tuple = ()
        if canary.device.is_cuda:
            with on_device(canary.device, stream):
                canary._prepare_checks()
                self._plans = canary._pack_plans(plans)
                self._writes = canary._pack_writes(writes)
                self._count = canary._bookkeeping.prepare_count_run(self.runs, packed=True)
                if translates:
                    self._translate = canary._pack_translate(writes)
            self._geometries = (canary._geometry(batch, canary._plan_fields),
                                canary._geometry(batch, canary._write_fields))
        else:
            # launched as they are at every run: over views of their own, which in-place changes to
            # the engine's array objects (a.shape = ..., a.dtype = ...) do not reach
            plans, writes = [owning(bundle) for bundle in plans], [owning(bundle) for bundle in writes]
            self._plans = tuple(functools.partial(_run_plan, canary, group, bundle) for group, bundle in zip(groups, plans))
            self._writes = tuple(functools.partial(_run_write, canary, group, bundle)
                                 for group, bundle in zip(groups, writes))
            self._count = functools.partial(_run_count, canary, self.runs)
            if translates:
                self._translate = functools.partial(_run_translate, canary, writes)
        self.closed = False
        self._logged_step: Optional[int] = None  # the step of the logged before() of the current run
        # poll reads the arrays as they are then, through views of their own, as the launches do: an
        # array object reshaped or re-typed in place later is read as it was validated
        logged = dataclasses.replace(batch, **{field.name: own_view(getattr(batch, field.name))
                                               for field in dataclasses.fields(batch)
                                               if field.name != "req_ids" and getattr(batch, field.name) is not None})
        self._logged = [(group, [_Launch("head", group.head_tag, 0, logged),
                                 _Launch("write", group.tail_tag, 0, logged, write_loc=own_view(bundle.out_cache_loc)),
                                 _Launch("tail", group.tail_tag, 0, logged)])
                        for group, bundle in zip(groups, writes)]
        self._records = [_StaticRecord(weakref.ref(self), self.run_count_at, launches) for _, launches in self._logged]
        canary._hold_closed_static_forwards()
        for (group, _), record in zip(self._logged, self._records):
            group.static_log.append(record)

    @contextlib.contextmanager
    def _launching(self, stream: Any) -> Iterator[Any]:
        """``stream`` resolved and current on the canary's device, after torch's stream where the
        batch's arrays are torch tensors (outside a graph capture)."""
        canary = self._canary
        stream = canary._stream(stream)
        with on_device(canary.device, stream):
            canary._order_after_torch(*self._geometries)
            yield stream

    def before(self, *, stream: Any = None) -> None:
        """Plan the batch and verify every prefix slot it is about to read (HEAD)."""
        self._refuse_if_closed("before")
        canary = self._canary
        if not canary.enabled:
            canary._planned = None
            return
        with self._launching(stream) as stream:  # the stream checked before anything changes
            canary._warn_if_unfinished("StaticForward.before")
            canary._note_where_the_log_stops(stream, 1)
            self._count(stream)
            for group, plan in zip(canary.groups, self._plans):
                plan(stream)
                canary._forward_check(group, group.head_tag, stream)
            self._log(stream, 0, 1, new_forward=True)
        # the plans are this batch's now (an eager after_forward plans its own, in the same forward),
        # unless this run is captured (a replay's place among the forwards is told at the poll)
        canary._planned = None if stream_capturing(stream) else self

    def after(self, *, stream: Any = None) -> None:
        """Fingerprint the batch's new tokens (their KV written by now), then verify the prefix
        again (TAIL). Run eagerly with no ``before()`` of its own last (none, or one made while the
        canary was off), it plans the batch first, a forward of its own, as an ``after_forward``
        with no ``before_forward`` does; a captured one writes with the plans the replay finds, so
        capture ``before()`` with it."""
        self._refuse_if_closed("after")
        canary = self._canary
        if not canary.enabled:
            canary._planned = None
            return
        with self._launching(stream) as stream:
            if canary._planned is not self and not stream_capturing(stream):
                # its before() did not run eagerly last (it came while off, or not at all): the plans
                # are another forward's, so this batch is planned here, a forward of its own, as an
                # after_forward with no before_forward is
                canary._note_where_the_log_stops(stream, 1)
                self._count(stream)
                for plan in self._plans:
                    plan(stream)
                self._log(stream, 0, 0, new_forward=True)
            if self._translate is not None:
                self._translate(stream)
            for group, write in zip(canary.groups, self._writes):
                write(stream)
                canary._forward_check(group, group.tail_tag, stream)
            self._log(stream, 1, 3)
        canary._planned = None

    def _log(self, stream, first: int, end: int, new_forward: bool = False) -> None:
        """Log a run's launches ``[first, end)`` (head, counted as a forward; write and tail) as an
        eager forward's are, so that poll places its rows in order among theirs; not while a graph
        is captured, whose replays leave no trace (poll matches their rows against the static
        forward itself)."""
        if stream_capturing(stream):
            for record in self._records:
                record.captured = self
            return
        canary = self._canary
        if new_forward:
            canary._numbered += 1
            canary._logged_runs += 1
            self._logged_step = canary._numbered
        # after() takes the step of this forward's logged before(), when no forward came between;
        # without it, its launches belong to no counted forward
        step = canary._numbered if new_forward or self._logged_step == canary._numbered else None
        if not new_forward:
            self._logged_step = None
        for group, launches in self._logged:
            canary._log(group, *(dataclasses.replace(launch, step=step) for launch in launches[first:end]))

    def _refuse_if_closed(self, method: str) -> None:
        """Raise before anything runs where :meth:`close` has been called: its runs would belong to
        no forward (a graph captured before may still be replayed; poll counts those runs apart)."""
        if self.closed:
            raise ValueError(f"{check.PREFIX}StaticForward.{method}: the forward must be open, got one closed "
                             "by close(); build another with Canary.static_forward")

    def close(self) -> None:
        """For a forward, or a captured graph of it, that will not run again: the next poll still
        counts and maps its runs since the previous one, then lets go of its arrays. Its run count
        cell is never handed to another forward, so a replay of its graph after that poll is
        simply not counted; its ``before()`` and ``after()`` refuse to run from now on. At most
        ``max_logged_forwards`` closed forwards wait for that poll: past them the oldest are let go
        of, their runs still counted, but the rows only their graph replays explain named to no
        request."""
        if not self.closed:
            self.closed = True
            self._canary._hold_closed_static_forwards()


# A StaticForward's launches on the CPU, where the ops run (and validate nothing again: the bundles
# were built from the batch once).
def _run_plan(canary: Canary, group: _Group, plan: PlanBatch, stream) -> None:
    canary._plan_op(group.vplan, group.wplan, plan, stream=stream)


def _run_write(canary: Canary, group: _Group, write: WriteBatch, stream) -> None:
    canary._write_op(group.ctx, group.wplan, write, stream=stream)


def _run_count(canary: Canary, runs, stream) -> None:
    canary._bookkeeping.count_run(runs, stream=stream)


def _run_translate(canary: Canary, writes: list, stream) -> None:
    canary._bookkeeping.translate_slots(writes[0].out_cache_loc, canary.groups[1].lut, writes[1].out_cache_loc,
                                        stream=stream)

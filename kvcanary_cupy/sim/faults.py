"""Named fault classes the simulator injects into its engine, each recording whom it hurts.

State faults (``kv_bitflip``, ``slot_alias``, ``use_after_free``, ``canary_overwrite``,
``offload_bitflip``) corrupt the engine's memory between steps (``offload_bitflip`` the KV of a
request while it waits in the host tier); batch faults (``stale_position``, ``token_swap``) corrupt the metadata
of the tokens a step writes, as a buggy batch builder would. Each fault names its victim requests and
slots, so a violation can be attributed to it (or counted as a false positive).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from .._dlpack import from_host
from .engine import Engine, StepBatch, _FREED

STATE_FAULTS = ("kv_bitflip", "slot_alias", "use_after_free", "canary_overwrite", "offload_bitflip")
BATCH_FAULTS = ("stale_position", "token_swap")
FAULT_CLASSES = STATE_FAULTS + BATCH_FAULTS
# the classes that leave their slots' KV or records corrupt (a slot_alias and a use_after_free corrupt
# their victim's table or page list instead: whoever else holds their slots reads them intact)
CORRUPTS_SLOTS = ("kv_bitflip", "canary_overwrite", "stale_position", "token_swap")
_MIN_REMAINING = 8


@dataclasses.dataclass
class Fault:
    fid: int
    cls: str
    step: int
    victims: set
    slots: set
    detail: dict
    detected_step: Optional[int] = None
    first_event: Optional[object] = None
    closed: bool = False
    # whether the fault changed what its victims read: a use_after_free does only once its page is
    # handed out again while its request still holds it (until then the slots keep its own records)
    took_effect: bool = True
    # a use_after_free's step at which its page was handed out again while its request held it: the
    # steps before it are the allocator's delay, not the canary's
    reused_step: Optional[int] = None

    @property
    def detected(self) -> bool:
        return self.detected_step is not None

    @property
    def latency(self) -> Optional[int]:
        return None if self.detected_step is None else self.detected_step - self.step


def _cannot_host(engine: Engine, cls: str) -> Optional[str]:
    """Why ``engine`` can never host a fault of ``cls`` (``None`` when it can)."""
    if cls == "slot_alias" and engine.config.max_running < 2:
        return "needs two running requests (max_running >= 2)"
    if cls == "offload_bitflip" and engine.tier is None:
        return "needs a host tier (host_slots > 0)"
    return None


class FaultInjector:
    """Injects ``classes`` in turn, one every ``every`` steps from ``start``.

    ``bitflip_offset`` pins the byte a ``kv_bitflip`` flips (counted inside the canary source's token
    bytes); ``None`` picks it uniformly.
    """

    def __init__(self, engine: Engine, classes, *, every: int = 10, start: int = 10, seed: int = 0,
                 bitflip_offset: Optional[int] = None):
        unknown = [c for c in classes if c not in FAULT_CLASSES]
        if unknown:
            raise ValueError(f"kv-canary: unknown fault class(es) {unknown}; known: {', '.join(FAULT_CLASSES)}")
        self.engine = engine
        # a class the engine's shape can never host would hold up every class after it in turn
        self.not_injectable = {cls: why for cls in classes if (why := _cannot_host(engine, cls))}
        self.classes = [cls for cls in classes if cls not in self.not_injectable]
        self.every = max(1, int(every))
        self.start = int(start)
        self.rng = np.random.default_rng(seed + 7)
        self.bitflip_offset = bitflip_offset
        self.faults: list[Fault] = []
        self._turn = 0
        self._waiting: Optional[str] = None  # the class whose turn came, until it is injected
        self._pending_batch: Optional[str] = None

    def why_not_injected(self) -> dict:
        """Why each class asked for has no fault, at the end of a run: the engine's shape cannot host
        it, or it waited for a place the engine never offered (the classes after it wait their turn
        behind it), or its turn did not come."""
        injected = {fault.cls for fault in self.faults}
        waiting = self._waiting
        why = dict(self.not_injectable)
        for cls in self.classes:
            if cls in injected or cls in why:
                continue
            if cls == waiting:
                why[cls] = "its turn came, but the engine never offered it a place (e.g. too few requests running)"
            elif waiting is not None and waiting not in injected:
                why[cls] = f"its turn did not come: {waiting} waited for a place before it"
            else:
                why[cls] = f"its turn did not come (one fault every {self.every} steps from step {self.start})"
        return why

    def _due(self, step: int) -> Optional[str]:
        if not self.classes or step < self.start or (step - self.start) % self.every:
            return None
        self._waiting = self.classes[self._turn % len(self.classes)]
        return self._waiting

    def _record(self, cls: str, step: int, victims, slots, **detail) -> Fault:
        fault = Fault(len(self.faults), cls, step, set(victims), set(slots), detail)
        self.faults.append(fault)
        self._turn += 1
        self._waiting = None
        return fault

    def undetected_victims(self) -> set:
        """The requests hurt by a fault the canary has not reported yet: offloading one would carry
        its fault out of sight (a corrupted table entry is rewritten when it comes back)."""
        return {rid for fault in self.faults if not fault.detected for rid in fault.victims}

    def after_admissions(self) -> None:
        """Make victims of the requests just admitted onto a prefix holding a slot that an unreported
        fault corrupted: its victim published the prefix before the fault was reported, and they
        read the corruption as it does (and go on reading it once the victim is aborted). Only while
        the fault is open and unreported: its victim then still holds those pages, so whoever holds
        them reads what the fault left."""
        ps = self.engine.page_size
        for fault in self.faults:
            if fault.detected or fault.closed or fault.cls not in CORRUPTS_SLOTS:
                continue
            pages = {slot // ps for slot in fault.slots}
            fault.victims |= {r.rid for r in self.engine.running if pages.intersection(r.pages)}

    def _victims(self, exclude=()) -> list:
        """Running requests a fault may hurt: none already hurt by one not reported yet, whose report
        a second fault would take (and offloading it would carry its fault out of sight)."""
        exclude = set(exclude) | self.undetected_victims()
        running = [r for r in self.engine.running if r.rid not in exclude and r.remaining >= _MIN_REMAINING
                   and r.seq_len > 0]
        decoding = [r for r in running if r.decoding]
        return decoding or running

    # --- state faults -----------------------------------------------------------------------------
    def before_step(self, step: int) -> Optional[Fault]:
        cls = self._due(step)
        if cls is None:
            return None
        if cls in BATCH_FAULTS:
            self._pending_batch = cls
            return None
        return getattr(self, f"_{cls}")(step)

    def _pick(self, full_pages_only: bool = False, exclude=()):
        """A random live request and one of the positions only it references, or (None, None)."""
        candidates = []
        for request in self._victims(exclude):
            positions = self.engine.exclusive_positions(request, full_pages_only=full_pages_only)
            if positions:
                candidates.append((request, positions))
        if not candidates:
            return None, None
        request, positions = candidates[int(self.rng.integers(len(candidates)))]
        return request, int(self.rng.choice(positions))

    def _flip_a_bit(self, targets: list, source_bytes: list, row: int) -> dict:
        """Flip one bit of ``row`` in one of ``targets`` (at ``bitflip_offset`` inside its canary
        source's token bytes when that is pinned); what was flipped, for the fault's detail."""
        target_index = int(self.rng.integers(len(targets)))
        target, token_bytes = targets[target_index], source_bytes[target_index]
        if self.bitflip_offset is None:
            offset = int(self.rng.integers(target.shape[1]))
        else:
            half = int(self.rng.integers(target.shape[1] // token_bytes)) * token_bytes
            offset = half + min(int(self.bitflip_offset), token_bytes - 1)
        bit = int(self.rng.integers(8))
        target[row, offset] ^= np.uint8(1 << bit)
        return dict(byte=offset, source_offset=offset % token_bytes, bit=bit)

    def _kv_bitflip(self, step: int) -> Optional[Fault]:
        eng = self.engine
        request, position = self._pick()
        if request is None:
            return None
        slot = eng.slot_of(request, position)
        flipped = self._flip_a_bit(eng.targets, eng.target_source_bytes, slot)
        return self._record("kv_bitflip", step, [request.rid], [slot], position=position, **flipped)

    def _offload_bitflip(self, step: int) -> Optional[Fault]:
        """Offload a request to the host tier and flip a bit of one of its tokens' KV there: its
        records, carried with it, still hold the hash of the KV as written."""
        eng = self.engine
        candidates = [r for r in self._victims() if eng.can_offload(r)]
        if not candidates:
            return None
        request = candidates[int(self.rng.integers(len(candidates)))]
        position = int(self.rng.integers(request.seq_len))
        host_slot = int(eng.offload(request)[position])
        kv = eng.tier.groups["full"].kv
        flipped = self._flip_a_bit(kv.targets, kv.target_source_bytes, host_slot)
        return self._record("offload_bitflip", step, [request.rid], [], position=position, host_slot=host_slot,
                            **flipped)

    def _slot_alias(self, step: int) -> Optional[Fault]:
        eng = self.engine
        request, position = self._pick()
        if request is None:
            return None
        other, other_position = self._pick(exclude=(request.rid,))
        if other is None:
            return None
        alias = eng.slot_of(other, other_position)
        eng.table_host[request.row, position] = alias
        return self._record("slot_alias", step, [request.rid], [alias], position=position,
                            alias_of=(other.rid, other_position))

    def _use_after_free(self, step: int) -> Optional[Fault]:
        eng = self.engine
        request, position = self._pick(full_pages_only=True)
        if request is None:
            return None
        k = position // eng.page_size
        page = request.pages[k]
        request.pages[k] = _FREED
        eng.release_page(page, front=True)  # the next page allocation reuses it
        slots = range(page * eng.page_size, (page + 1) * eng.page_size)
        fault = self._record("use_after_free", step, [request.rid], slots, position=k * eng.page_size, page=page)
        fault.took_effect = False

        def retaken() -> None:  # a page handed out once its request is done harms nobody
            if any(r is request for r in eng.running):
                fault.took_effect, fault.reused_step = True, eng.step_index
        eng.on_retake[page] = retaken
        return fault

    def _canary_overwrite(self, step: int) -> Optional[Fault]:
        eng = self.engine
        request, position = self._pick()
        if request is None:
            return None
        slot = eng.slot_of(request, position)
        junk = np.frombuffer(self.rng.bytes(32), np.uint8).copy()
        eng.canary.context.canary_buf[slot, :32] = from_host(junk, eng.device)
        return self._record("canary_overwrite", step, [request.rid], [slot], position=position)

    # --- batch faults -----------------------------------------------------------------------------
    def tamper(self, step: int, batch: StepBatch) -> Optional[Fault]:
        """Corrupt this step's host batch if a batch fault is due (the expected values stay right)."""
        cls, self._pending_batch = self._pending_batch, None
        if cls is None:
            return None
        hurt = self.undetected_victims()
        choices = [i for i, r in enumerate(batch.requests)
                   if r.remaining - batch.extend_lens[i] >= _MIN_REMAINING and r.rid not in hurt]
        if not choices:
            self._pending_batch = cls  # try again next step
            return None
        index = choices[int(self.rng.integers(len(choices)))]
        request = batch.requests[index]
        lo, _ = batch.entry_range(index)
        # among the tokens the request keeps: a rejected draft's record is never written
        entry = int(self.rng.integers(lo, lo + int(batch.kept_counts[index])))
        slot = int(batch.out_cache_loc[entry])
        position = int(batch.expected_positions[entry])
        if cls == "stale_position":
            deltas = [d for d in (-3, -2, -1, 1, 2, 3) if position + d >= 0]
            batch.positions[entry] = position + int(self.rng.choice(deltas))
            detail = {"written_position": int(batch.positions[entry])}
        else:
            token = int(batch.input_ids[entry])
            batch.input_ids[entry] = token % (self.engine.config.vocab - 1) + 1
            detail = {"written_token": int(batch.input_ids[entry]), "token": token}
        return self._record(cls, step, [request.rid], [slot], position=position, **detail)

"""Run the simulated engine with its canary, inject faults, attribute every violation, summarise."""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

from .._dlpack import parse_device
from ..precompile import compile_kernels
from ..session import CanaryEvent
from .engine import Engine, SimConfig
from .faults import FAULT_CLASSES, Fault, FaultInjector
from .static_decode import StaticDecode

_QUIET = logging.getLogger("kvcanary_cupy.sim")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


class Progress:
    """A minimal progress bar on a terminal stream (a no-op when disabled)."""

    def __init__(self, total: int, *, enabled: bool = True, stream=None, width: int = 30, label: str = "steps"):
        self.total, self.enabled, self.width, self.label = max(1, total), enabled, width, label
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self._last = -1.0

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < self.total and now - self._last < 0.1:
            return
        self._last = now
        filled = int(self.width * done / self.total)
        rate = done / max(now - self.start, 1e-9)
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {self.label} "
                          f"{rate:6.1f}/s {note}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


@dataclasses.dataclass
class SimResult:
    config: SimConfig
    steps: int
    tokens: int
    verified_entries: int
    requests_finished: int
    requests_aborted: int
    shared_tokens: int
    reused_pages: int
    wall_s: float
    canary_s: float
    faults: list
    false_positives: list
    violations_per_step: list
    kernels_s: float = 0.0  # compiling or loading the kernels before the first step
    decode_forwards: int = 0  # forwards whose requests are all past their prompts (a token each, or drafts)
    decode_canary_s: float = 0.0  # the canary's host time in those forwards
    static_decode: Optional[dict] = None  # StaticDecode.to_json() when decode ran through static forwards
    not_injectable: dict = dataclasses.field(default_factory=dict)  # fault classes asked for: why none was injected
    host_tier: Optional[dict] = None  # the host tier's slots, moves and copy times (None: no tier)
    speculative: Optional[dict] = None  # drafts a decode verifies, drafts verified and accepted (None: off)
    injection: dict = dataclasses.field(default_factory=dict)  # the fault classes asked for and their cadence

    @property
    def canary_ms_per_step(self) -> float:
        return 1e3 * self.canary_s / max(1, self.steps)

    @property
    def canary_us_per_decode_forward(self) -> float:
        return 1e6 * self.decode_canary_s / max(1, self.decode_forwards)

    def per_class(self) -> dict:
        out = {}
        for cls in FAULT_CLASSES:
            faults = [f for f in self.faults if f.cls == cls]
            if not faults:
                continue
            detected = [f for f in faults if f.detected]
            latencies = [f.latency for f in detected]
            out[cls] = {
                "injected": len(faults),
                "detected": len(detected),
                "in_flight": sum(not f.detected and not f.closed for f in faults),
                "no_effect": sum(not f.detected and f.closed and not f.took_effect for f in faults),
                "detection_rate": len(detected) / len(faults),
                "median_steps_to_detection": statistics.median(latencies) if latencies else None,
                "max_steps_to_detection": max(latencies) if latencies else None,
            }
        return out

    @property
    def missed(self) -> list:
        """The faults not reported although their requests were done with (finished or aborted)
        before the run ended: not those still in flight, whose requests a later verify would read
        (``closed`` is updated at each poll, and the run's last step polls), nor those that changed
        nothing their requests read (a use_after_free whose page was not handed out again before
        its request was done)."""
        return [f for f in self.faults if not f.detected and f.closed and f.took_effect]

    def uncaught(self, classes: Sequence[str]) -> dict:
        """Of ``classes``, each that no report of the canary's caught, with why: none was injected
        (and why not), or each one injected was missed, still in flight at the end or without
        effect. A run that caught none of a class has not shown that the canary catches it."""
        per_class = self.per_class()
        why = {}
        for cls in dict.fromkeys(classes):
            row = per_class.get(cls)
            if row is None:
                why[cls] = "not injected" + (f": {self.not_injectable[cls]}" if cls in self.not_injectable else "")
            elif not row["detected"]:
                missed = row["injected"] - row["in_flight"] - row["no_effect"]
                fates = ((missed, "missed"), (row["in_flight"], "still in flight at the end"),
                         (row["no_effect"], "without effect"))
                why[cls] = (f"{_counted(row['injected'], 'fault')} injected, none caught: "
                            + ", ".join(f"{count} {fate}" for count, fate in fates if count))
        return why

    def to_json(self) -> dict:
        c = self.config
        return {
            "steps": self.steps,
            "device": str(c.device),
            "hash_mode": c.hash_mode.name,
            "layout": c.layout,
            "seed": c.seed,
            "pool_slots": c.pool_slot_count,  # the slots the engine uses: whole pages
            "pool_slots_asked": c.pool_slots,
            "page_size": c.page_size,
            "max_running": c.max_running,
            "swa_window": c.swa_window,
            "split_batches": c.splits_batches,
            "tokens": self.tokens,
            "verified_entries": self.verified_entries,
            "requests_finished": self.requests_finished,
            "requests_aborted": self.requests_aborted,
            "shared_prefix_tokens": self.shared_tokens,
            "reused_pages": self.reused_pages,
            "wall_s": round(self.wall_s, 3),
            "kernels_s": round(self.kernels_s, 3),
            "canary_ms_per_step": round(self.canary_ms_per_step, 4),
            "false_positives": len(self.false_positives),
            "decode_forwards": self.decode_forwards,
            "canary_us_per_decode_forward": round(self.canary_us_per_decode_forward, 2),
            "static_decode": self.static_decode,
            "not_injectable": self.not_injectable,
            "host_tier": self.host_tier,
            "speculative": self.speculative,
            "faults": self.per_class(),
            "fault_log": [{"class": f.cls, "step": f.step, "victims": sorted(f.victims),
                           "detected_step": f.detected_step, "took_effect": f.took_effect,
                           "detail": {k: (list(v) if isinstance(v, tuple) else v) for k, v in f.detail.items()}}
                          for f in self.faults],
            "violations_per_step": self.violations_per_step,
            # every setting of the run, so that its JSON alone says how to run it again
            "settings": {**{k: (v.name if hasattr(v, "name") else list(v) if isinstance(v, tuple) else v)
                            for k, v in dataclasses.asdict(c).items()}, **self.injection},
        }

    def summary(self) -> str:
        c = self.config
        lines = [
            f"kv-canary demo: device={c.device} hash_mode={c.hash_mode.name} layout={c.layout} seed={c.seed}"
            + (f" swa_window={c.swa_window}" if c.swa_window else ""),
            f"  steps {self.steps:>10}    tokens written {self.tokens:>9}    verified entries {self.verified_entries:>10}",
            f"  requests finished {self.requests_finished}, aborted on detection {self.requests_aborted}; "
            f"prefix-shared tokens {self.shared_tokens}; reused pages {self.reused_pages}",
            f"  wall {self.wall_s:.2f} s; canary {self.canary_ms_per_step:.3f} ms/step "
            f"({100 * self.canary_s / max(self.wall_s, 1e-9):.0f}% of the step loop)"
            + (f"; kernels ready in {self.kernels_s:.2f} s before it (compiled once a machine, then loaded "
               f"from {'CuPy' if parse_device(c.device).is_cuda else 'numba'}'s cache)"),
        ]
        if self.host_tier is not None:
            tier = self.host_tier
            lines.extend([f"  host tier of {tier['slots']} slots: {_counted(tier['offloads'], 'request')} offloaded, {tier['reloads']} "
                         f"loaded back; {_counted(tier['prefix_stores'], 'evicted prefix', 'evicted prefixes')} kept, {tier['prefix_loads']} loaded back",
                         f"    copies {tier['kv_copy_ms']:.1f} ms of KV bytes, {tier['records_copy_ms']:.1f} ms of their records "
                         f"(canary.copy_records)"])
        if self.speculative is not None:
            spec = self.speculative
            lines.append(f"  speculative decoding, {_counted(spec['drafts'], 'draft')} a decoding request: {spec['accepted']} of "
                         f"{spec['verified']} drafts accepted; each forward fingerprints the tokens it keeps")
        if c.splits_batches:
            sd = self.static_decode
            how = "eager" if sd is None else (
                f"static forwards of batch sizes {sd['batch_sizes_used']}"
                + (f", {sd['graph_replays']} as CUDA-graph replays" if sd["graph_replays"] else ""))
            lines.append(f"  decode forwards {self.decode_forwards}: canary {self.canary_us_per_decode_forward:.1f} "
                         f"us each ({how}); prefill forwards apart, eager")
        lines += [
            "",
            f"  {'fault class':<18}{'injected':>9}{'detected':>9}{'rate':>8}{'median steps':>14}",
        ]
        per_class = self.per_class()
        for cls, row in per_class.items():
            median = "-" if row["median_steps_to_detection"] is None else f"{row['median_steps_to_detection']:g}"
            lines.append(f"  {cls:<18}{row['injected']:>9}{row['detected']:>9}{row['detection_rate']:>8.0%}"
                         f"{median:>14}")
        if not self.faults:
            lines.append("  (none injected)")
        in_flight = sum(row["in_flight"] for row in per_class.values())
        if in_flight:
            lines.append(f"  {_counted(in_flight, 'undetected fault')} still in flight at the end "
                         f"(their requests still ran, so a later verify may yet see them)")
        for cls, row in per_class.items():
            if row["no_effect"]:
                lines.append(f"  {cls:<18} {_counted(row['no_effect'], 'fault')} without effect: the freed page was "
                             f"not handed out again before its request was done (nothing to catch)")
        for cls, why in self.not_injectable.items():
            lines.append(f"  {cls:<18} not injected: {why}")
        lines.append(f"  {'false positives':<18}{len(self.false_positives):>9}")
        return "\n".join(lines)


def _counted(count: int, noun: str, plural: Optional[str] = None) -> str:
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def _attribute(events: Sequence[CanaryEvent], faults: Sequence[Fault], step: int):
    """Mark the faults the events reveal; return the events no fault explains and the victims hit.

    An event belongs to the latest fault whose victim it names; failing that, to an open fault
    (one whose victims still run) that touched its slot."""
    unexplained, hit = [], set()
    for event in events:
        owner = next((f for f in reversed(faults) if event.request in f.victims), None)
        if owner is None and event.group == "full":
            owner = next((f for f in reversed(faults) if not f.closed and event.slot in f.slots), None)
        if owner is None:
            unexplained.append(event)
            continue
        if owner.detected_step is None:
            owner.detected_step = step
            owner.first_event = event
            owner.took_effect = True  # e.g. a freed page's SWA slots handed out before the page itself
        hit |= owner.victims
    return unexplained, hit


def run(config: SimConfig, faults: Sequence[str] = (), *, fault_every: int = 10, fault_start: int = 10,
        bitflip_offset: Optional[int] = None, progress: bool = False, graphs: bool = True,
        on_step: Optional[Callable[[int], None]] = None) -> SimResult:
    """Simulate ``config.steps`` forward passes with the canary on, injecting ``faults`` in turn.
    With ``config.static_decode``, decode forwards run through static forwards, replayed as CUDA
    graphs on a GPU unless ``graphs`` is false."""
    # As an engine warms up before traffic: a first compile would otherwise land in the first steps.
    engine = Engine(config, logger=_QUIET)
    contexts = [engine.canary.context, engine.canary.swa_context]
    if progress:  # a first run on a machine is silent for seconds otherwise
        sys.stderr.write("readying the kernels (compiled on a machine's first run, then loaded from its cache)...\n")
        sys.stderr.flush()
    started = time.perf_counter()
    compile_kernels(device=config.device,
                    source_counts=[len(ctx.source_words) for ctx in contexts if ctx is not None])
    if engine.tier is not None and engine.device.is_cuda:
        # the host side of the records' copies to and from the tier: numba's, else the first
        # offload would wait a second or two for it
        compile_kernels(device="cpu", source_counts=[])
    kernels_s = time.perf_counter() - started
    injector = FaultInjector(engine, faults, every=fault_every, start=fault_start, seed=config.seed,
                             bitflip_offset=bitflip_offset)
    canary = engine.canary
    static = StaticDecode(engine, graphs=graphs) if config.static_decode else None
    bar = Progress(config.steps, enabled=progress)
    false_positives: list = []
    violations_per_step: list = []
    canary_s = decode_canary_s = 0.0
    decode_forwards = 0
    start = time.perf_counter()
    for step in range(config.steps):
        engine.step_index = step
        engine.tier_turn(protected=injector.undetected_victims())
        engine.admit_arrivals()
        injector.after_admissions()
        injector.before_step(step)
        host_batch = engine.schedule()
        injector.tamper(step, host_batch)
        engine._push_tables()
        decodes_only = host_batch.decodes_only
        if static is not None and decodes_only:
            static.prepare(host_batch)
            batch, before, after = static.batch, static.before, static.after
        else:
            batch = engine.forward_batch(host_batch)
            # a speculative forward fingerprints what it keeps: each request's accepted path
            kept = batch if host_batch.keeps_all else engine.forward_batch(host_batch.kept())
            before, after = functools.partial(canary.before_forward, batch), functools.partial(canary.after_forward, kept)
        t0 = time.perf_counter()
        before()
        t1 = time.perf_counter()
        engine.model_forward(batch, host_batch)
        t2 = time.perf_counter()
        after()
        spent = (t1 - t0) + (time.perf_counter() - t2)
        canary_s += spent
        if decodes_only:
            decode_forwards += 1
            decode_canary_s += spent
        engine.advance(host_batch)
        t3 = time.perf_counter()
        if config.sweep_every and step % config.sweep_every == config.sweep_every - 1:
            canary.sweep(engine.live_requests())
        count = 0
        if step % config.poll_every == config.poll_every - 1 or step == config.steps - 1:
            report = canary.poll()
            count = report.total
            unexplained, hit = _attribute(report.events, injector.faults, step)
            false_positives.extend((step, e) for e in unexplained)
            for rid in hit:
                engine.abort(rid)
            live = {r.rid for r in engine.running} | set(engine.offloaded)
            for fault in injector.faults:
                fault.closed = fault.closed or not (fault.victims & live)
        canary_s += time.perf_counter() - t3
        violations_per_step.append(count)
        if on_step is not None:
            on_step(step)
        bar.update(step + 1, f"faults {sum(f.detected for f in injector.faults)}/{len(injector.faults)} detected")
    bar.close()
    wall = time.perf_counter() - start
    stats = canary.stats()
    slot_runs = sum(s["slot_run_counter"] for s in stats.values())
    writes = engine.tokens_written * len(stats)
    return SimResult(config, config.steps, engine.tokens_written, max(0, slot_runs - writes), engine.finished,
                     engine.aborted, engine.shared_tokens, engine.reused_pages, wall, canary_s, injector.faults,
                     false_positives, violations_per_step, kernels_s,
                     decode_forwards, decode_canary_s, None if static is None else static.to_json(),
                     injector.why_not_injected(), None if engine.tier is None else engine.tier.to_json(),
                     None if not config.speculative else {"drafts": config.speculative,
                                                          "verified": engine.drafts_verified,
                                                          "accepted": engine.drafts_accepted},
                     {"faults": list(faults), "fault_every": fault_every, "fault_start": fault_start,
                      "bitflip_offset": bitflip_offset})


__all__ = ["Progress", "SimResult", "run"]

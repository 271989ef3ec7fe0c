"""The probes in tools/ import on a machine without a GPU (they need one only to run): a helper
renamed or moved in the package or in tools/_probe.py breaks them here, not in the next GPU session.
The kc.Canary fuzz (tools/canary_fuzz.py) also runs a few seeds on the CPU, and fails a canary
made wrong on purpose (blind, noisy, miscounting, misnaming, crashing)."""

from __future__ import annotations

import dataclasses
import json
import lzma
import os
import weakref

import pytest

import kvcanary_cupy as kc
from _tools import ROOT, TOOLS, import_tools


@pytest.mark.parametrize("name", TOOLS)
def test_tool_imports(name):
    (module,) = import_tools(name)
    assert module.__doc__, f"tools/{name}.py says what it is for"


def run_fuzz(tmp_path, capsys, start: int, seeds: int, forwards: int) -> tuple[str, list, dict]:
    """Seeds of tools/canary_fuzz.py on the CPU: what it printed, its rows and its totals, once
    its clean runs reported nothing and their counters matched what the engine did (all zero with
    the canary off), every injected fault was reported and named on the request it harms, and
    nothing crashed."""
    (fuzz,) = import_tools("canary_fuzz")
    out = tmp_path / "fuzz.json"
    status = fuzz.main(["--device", "cpu", "--start", str(start), "--seeds", str(seeds), "--forwards", str(forwards),
                        "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    total = result["total"]
    assert status == 0, printed
    assert total["runs"] == seeds
    assert total["false_positives"] == total["counter_errors"] == total["missed"] == total["crashes"] == 0
    assert total["misnamed"] == 0
    return printed, result["rows"], total


def test_canary_fuzz_on_the_cpu_finds_no_false_positive_and_misses_no_fault(tmp_path, capsys):
    """Prefix sharing and a draft model's canary among them."""
    # seeds 84-95 hold a canary that is off, prefix sharing and faults on shared slots, a draft
    # model's canary and both of its faults
    printed, _, total = run_fuzz(tmp_path, capsys, start=84, seeds=12, forwards=16)
    assert total["injected"] >= 10
    assert "layout=paged" in printed and "fault=" in printed  # the table by feature
    for feature in ("mode=off", "prefix_sharing=on", "prefix_cache=on", "fault=slot_steal@shared",
                    "fault=draft_token", "fault=draft_kv_flip"):
        assert feature in printed


def test_canary_fuzz_writes_brief_rows_compressed_and_keeps_a_failing_row_whole(tmp_path, capsys):
    """``--brief-rows`` into a ``.json.xz``: each clean seed as its outcome and work, the totals and
    table as the full rows give them; a failing row keeps its configuration and findings."""
    (fuzz,) = import_tools("canary_fuzz")
    argv = ["--device", "cpu", "--start", "84", "--seeds", "4", "--forwards", "16"]
    assert fuzz.main(argv + ["--json", str(tmp_path / "full.json")]) == 0
    assert fuzz.main(argv + ["--json", str(tmp_path / "brief.json.xz"), "--brief-rows"]) == 0
    capsys.readouterr()
    full = json.loads((tmp_path / "full.json").read_text())
    with lzma.open(tmp_path / "brief.json.xz", "rt", encoding="utf-8") as handle:
        brief = json.load(handle)
    assert brief["by_feature"] == full["by_feature"]
    assert {key: value for key, value in brief["total"].items() if key != "wall_s"} == \
        {key: value for key, value in full["total"].items() if key != "wall_s"}
    assert [row["seed"] for row in brief["rows"]] == [84, 85, 86, 87]
    for short, whole in zip(brief["rows"], full["rows"]):
        assert set(short) <= set(fuzz.BRIEF_FIELDS) and "config" not in short
        assert {key: short[key] for key in short if key != "wall_s"} == \
            {key: whole[key] for key in short if key != "wall_s"}
        assert short["work"]["forwards"] == 16
    failing = dict(full["rows"][0], missed=True)
    assert fuzz.brief(failing) == failing


def test_canary_fuzz_on_the_cpu_keeps_prefixes_in_the_host_tier_and_runs_the_draft_canary_static(tmp_path, capsys):
    """Evicted prefixes kept in the host tier and loaded back for a later sharer, a KV byte flipped
    in one there and reported to that sharer, and the draft model's canary through static forwards."""
    # seeds 116-131 hold both features, and seed 131 the flip in a host-tier prefix
    printed, rows, total = run_fuzz(tmp_path, capsys, start=116, seeds=16, forwards=30)
    assert total["injected"] >= 14
    for feature in ("prefix_tier=on", "draft_static=on", "fault=prefix_flip"):
        assert feature in printed
    flips = [row for row in rows if row["fault"] == "prefix_flip" and row["injected"]]
    assert any("host-tier" in row["fault_where"] and row["detected"] for row in flips)
    assert any(row["work"].get("prefix_loads") for row in rows)


def test_canary_fuzz_on_the_cpu_switches_the_canary_off_and_on_again(tmp_path, capsys):
    """Seeds that switch the canary off for a few forwards, drain the requests that ran meanwhile
    and switch it on again: from then on the clean run reports nothing and its counters match the
    forwards run while on, and the fault, injected after, is reported and named."""
    # seeds 225-233 hold five such seeds, one of them with static forwards
    printed, rows, total = run_fuzz(tmp_path, capsys, start=225, seeds=9, forwards=40)
    assert "pause=on" in printed
    paused = [row for row in rows if row["config"]["pause_at"]]
    assert len(paused) == 5 and any(row["config"]["static"] != "off" for row in paused)
    for row in paused:
        work = row["work"]
        assert work["forwards_off"] >= row["config"]["pause_len"] and work["resumed_at"] > row["config"]["pause_at"]
        assert row["injected"] and row["detected"] and row["fault_at"] >= work["resumed_at"]


def test_canary_fuzz_on_the_cpu_sends_finished_prompts_again_into_the_slots_they_left(tmp_path, capsys):
    """Seeds that share no prefix send a finished request's tokens again, handed its freed slots
    first: tokens written into a slot that held the very same record (only the KV bytes new) are
    no corruption, and a fault among them is still reported and named."""
    # seeds 300-329 hold five such seeds, three of which write records alike
    printed, rows, total = run_fuzz(tmp_path, capsys, start=300, seeds=30, forwards=30)
    assert "repeated_prompts=on" in printed and total["injected"] >= 25
    alike = [row["work"].get("records_alike", 0) for row in rows if row["config"]["repeated_prompts"]]
    assert len(alike) == 5 and sum(count > 0 for count in alike) == 3 and sum(alike) >= 10


def test_canary_fuzz_on_the_cpu_loads_back_a_tier_prefix_whose_tokens_another_kept_prefix_shares(tmp_path, capsys):
    """Seed 12369 keeps two prefixes with the same tokens in the host tier and loads one back: the
    fuzz takes that very one out of the tier, not one equal to it (a comparison of their arrays
    crashed the seed)."""
    _, rows, _ = run_fuzz(tmp_path, capsys, start=12369, seeds=1, forwards=60)
    assert rows[0]["work"].get("prefix_loads")


def test_canary_fuzz_on_the_cpu_places_rows_logged_before_the_canary_went_off_in_the_poll_after(tmp_path, capsys):
    """Seed 62560 switches its canary off 12 forwards in, with launches not yet polled: the first
    poll after the switch maps them, and an event naming a forward run before the switch is within
    that poll's window; the later polls while off return at once and move no window."""
    _, rows, _ = run_fuzz(tmp_path, capsys, start=62560, seeds=1, forwards=60)
    assert rows[0]["config"]["pause_at"] and rows[0]["detected"]


def test_canary_fuzz_on_the_cpu_reports_a_kv_byte_flipped_in_the_host_tier(tmp_path, capsys):
    """Seed 41 flips a hashed byte of an offloaded request's KV in the host tier: reported once it
    is loaded back, and named on that request (the seeds above draw no such fault)."""
    _, rows, _ = run_fuzz(tmp_path, capsys, start=41, seeds=1, forwards=16)
    assert rows[0]["fault"] == "host_flip" and "offloaded position" in rows[0]["fault_where"]
    assert rows[0]["injected"] and rows[0]["detected"]


def test_canary_fuzz_takes_a_record_written_over_whole_named_at_the_next_position(tmp_path, capsys):
    """A slot of position 0 written over by another request, unhashed and with a ring of one row:
    the record agrees with itself, and only position 1's chain link, which reads it, is reported.
    That names the victim rightly."""
    _, rows, _ = run_fuzz(tmp_path, capsys, start=398496, seeds=1, forwards=60)
    assert rows[0]["fault"] == "slot_steal" and rows[0]["config"]["hash_mode"] == "NONE"
    assert rows[0]["fault_where"].endswith("position 0 slot 20") and rows[0]["detected"]


def test_canary_fuzz_names_no_later_reader_of_a_slot_whose_record_a_compaction_replaced(tmp_path, capsys):
    """Seed 2295335 steals a shared slot; a copy of its bad record is read, and that slot is freed
    before the poll, a compaction then moving a new request's record into it: the rows of the old
    record name none of the new request's forwards (the fuzz fails a seed whose events name anyone
    but the victims and the thief)."""
    _, rows, _ = run_fuzz(tmp_path, capsys, start=2295335, seeds=1, forwards=60)
    assert rows[0]["fault"] == "slot_steal@shared" and rows[0]["config"]["compaction"]
    assert rows[0]["detected"] and not rows[0]["misnamed"]


def test_canary_fuzz_names_no_earlier_reader_of_a_slot_a_steal_wrote_after_it(tmp_path, capsys):
    """Seed 2976979 steals slot 6, which requests 14, 18 and 19 share at position 2: request 14 reads
    it, is offloaded, and the thief 18 writes its next token there, its TAIL recording slot 6 and
    slot 9 (whose chain link reads slot 6). Request 18 finishes and its pool row goes to a new
    request before the poll: the rows of slot 9 are not given to request 14, whose pool row still
    holds the cells but whose forward read slot 6 before the steal."""
    _, rows, _ = run_fuzz(tmp_path, capsys, start=2976979, seeds=1, forwards=60)
    assert rows[0]["fault"] == "slot_steal" and rows[0]["fault_where"] == "request 19 position 2 slot 6"
    assert rows[0]["detected"] and not rows[0]["misnamed"] and "14" not in rows[0]["named"]


def test_canary_fuzz_takes_a_table_alias_whose_slot_was_written_again_with_the_victims_record(tmp_path, capsys):
    """Seed 2620018 points request 5's cell of position 0 at request 0's slot 55. Request 0
    finishes, and a request sharing request 5's first token is loaded back from the host tier into
    slot 55: the cell then reads the very record request 5's own slot holds. What read the alias
    before is reported, its rows unnamed (slot 55 was written again before the poll), and the
    final sweeps find nothing: the fuzz takes that alias as healed, not misnamed."""
    (fuzz,) = import_tools("canary_fuzz")
    _, rows, _ = run_fuzz(tmp_path, capsys, start=2620018, seeds=1, forwards=40)
    assert rows[0]["fault"] == "table_alias" and rows[0]["fault_where"] == "request 5 position 0 -> slot 55 of 0"
    assert rows[0]["detected"] and rows[0]["named"] == ["None"] and not rows[0]["misnamed"]
    config = fuzz.draw_config(2620018, "cpu")
    healed = fuzz.FuzzEngine(config, fuzz.Device("cpu"), fuzz.draw_fault(config, 40)).run(40)
    assert healed.alias_healed()


def run_broken_fuzz(tmp_path, capsys, start: int = 84, seeds: int = 12,
                    forwards: int = 16) -> tuple[str, list, dict, dict]:
    """Seeds of tools/canary_fuzz.py, by default 84-95 (the canary off in one, both faults of a
    draft model), on the CPU against a canary made wrong on purpose: what it printed, its rows, its
    totals and its table by feature, once it failed (exit status 1) and printed a failing seed."""
    (fuzz,) = import_tools("canary_fuzz")
    out = tmp_path / "fuzz.json"
    status = fuzz.main(["--device", "cpu", "--start", str(start), "--seeds", str(seeds), "--forwards", str(forwards),
                        "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert status == 1, printed[-3000:]
    assert "FAILED (alone: --start" in printed
    return printed, result["rows"], result["total"], result["by_feature"]


def polls_changed(monkeypatch, change, *, of_canary: bool = False) -> None:
    """kc.Canary.poll returning ``change(report)`` (``change(report, canary)`` with ``of_canary``)
    for its report, raising nothing in mode "raise"."""
    original = kc.Canary.poll

    def poll(self):
        try:
            report = original(self)
        except kc.CanaryViolation as caught:
            report = caught.report
        return change(report, self) if of_canary else change(report)

    monkeypatch.setattr(kc.Canary, "poll", poll)


def test_canary_fuzz_fails_a_canary_that_reports_nothing(tmp_path, capsys, monkeypatch):
    """A canary blind to every corruption: each injected fault is missed, and the table counts
    each miss once under every feature kind."""
    polls_changed(monkeypatch, lambda report: dataclasses.replace(report, events=(), total=0, dropped=0))
    printed, rows, total, by_feature = run_broken_fuzz(tmp_path, capsys)
    injected = [row for row in rows if row["injected"]]
    assert len(injected) >= 10 and all(row["missed"] and not row["detected"] for row in injected)
    assert total["missed"] == total["injected"] and "missed " in printed
    assert total["false_positives"] == total["counter_errors"] == total["crashes"] == 0
    layouts = [counts for feature, counts in by_feature.items() if feature.startswith("layout=")]
    assert sum(counts["missed"] for counts in layouts) == total["missed"]
    assert sum(counts["runs"] for counts in layouts) == total["runs"] == 12


def test_canary_fuzz_fails_a_canary_that_reports_a_clean_run(tmp_path, capsys, monkeypatch):
    """Every poll with one more row recorded (and dropped by the ring) than the canary found: each
    clean run has false positives."""
    polls_changed(monkeypatch, lambda report: dataclasses.replace(report, total=report.total + 1,
                                                                  dropped=report.dropped + 1))
    printed, rows, total, _ = run_broken_fuzz(tmp_path, capsys)
    assert all(row["false_positives"] for row in rows) and total["false_positives"] == 12
    assert "false positive(s)" in printed


def _counted_twice(monkeypatch, counter):
    original = kc.Canary.stats
    monkeypatch.setattr(kc.Canary, "stats", lambda self: {group: dict(counts, **{counter: 2 * counts[counter] + 1})
                                                          for group, counts in original(self).items()})


def _forwards_counted_twice(monkeypatch):
    original = kc.Canary.before_forward

    def before_forward(self, batch, *, stream=None):
        original(self, batch, stream=stream)
        self.forwards += 1

    monkeypatch.setattr(kc.Canary, "before_forward", before_forward)


COUNTER_BUGS = {
    "kernel runs": (lambda mp: _counted_twice(mp, "kernel_run_counter"), "['kernel_run_counter']"),
    "slot runs": (lambda mp: _counted_twice(mp, "slot_run_counter"), "['slot_run_counter']"),
    "eager forwards": (_forwards_counted_twice, "Canary.forwards"),
    "forwards reported": (lambda mp: polls_changed(mp, lambda r: dataclasses.replace(r, forwards=r.forwards + 1)),
                          "CanaryReport.forwards"),
    "violations": (lambda mp: _counted_twice(mp, "violations"), "['violations']"),
    "overflows reported": (lambda mp: polls_changed(
        mp, lambda r: dataclasses.replace(r, capacity_overflows=r.capacity_overflows + 1)), "capacity_overflows"),
}


@pytest.mark.parametrize("bug", COUNTER_BUGS)
def test_canary_fuzz_fails_a_canary_whose_counters_disagree_with_the_engine(tmp_path, capsys, monkeypatch, bug):
    make, said = COUNTER_BUGS[bug]
    make(monkeypatch)
    printed, rows, total, _ = run_broken_fuzz(tmp_path, capsys)
    assert total["counter_errors"] >= 10 and "counters: " in printed
    assert sum(any(said in error for error in row["counter_errors"]) for row in rows) >= 10


def test_canary_fuzz_fails_a_canary_whose_forwards_go_back_after_reading_right(tmp_path, capsys, monkeypatch):
    """A poll with no forward since the previous one reporting a forward fewer: the final polls
    after each sweep read the count right first, then one less, and the last one read is judged."""
    polled = weakref.WeakKeyDictionary()

    def going_back(report, canary):
        again, polled[canary] = report.forwards == polled.get(canary), report.forwards
        return dataclasses.replace(report, forwards=report.forwards - 1) if again and report.forwards else report

    polls_changed(monkeypatch, going_back, of_canary=True)
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    assert sum(any("CanaryReport.forwards" in error for error in row["counter_errors"]) for row in rows) >= 10


def test_canary_fuzz_judges_the_counters_of_every_group(tmp_path, capsys, monkeypatch):
    """A kernel run counted twice in an SWA group's counters only is a counter mismatch."""
    stats = kc.Canary.stats

    def swa_counted_twice(canary):
        counted = stats(canary)
        return {group: dict(counts, kernel_run_counter=2 * counts["kernel_run_counter"] + 1) if i else counts
                for i, (group, counts) in enumerate(counted.items())}

    monkeypatch.setattr(kc.Canary, "stats", swa_counted_twice)
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    with_swa = [row for row in rows if row["config"]["swa_window"]]
    assert with_swa and all(any("['kernel_run_counter']" in error for error in row["counter_errors"])
                            for row in with_swa)


def test_canary_fuzz_fails_victims_named_off_the_position_beside_a_stranger_named_on_it(tmp_path, capsys,
                                                                                         monkeypatch):
    """Each event given twice: naming its request two positions on, and naming a request the fault
    did not harm at its own position. Where strays are let pass (polled every few forwards), the
    victims' positions alone are judged, not the stranger's."""
    polls_changed(monkeypatch, lambda report: dataclasses.replace(
        report, events=tuple(event if event.position is None else dataclasses.replace(event, position=event.position + 2)
                             for event in report.events)
        + tuple(dataclasses.replace(event, request="stranger") for event in report.events),
        total=report.total + len(report.events)))
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    assert any("no event named a victim at position" in row["misnamed"] for row in rows
               if row["config"]["poll_every"] > 1)


def _canaries_of_fault_runs(monkeypatch) -> weakref.WeakSet:
    """The canaries the session fuzz builds for its runs with a fault, as they are built (the clean
    run of a seed builds its own)."""
    (fuzz,) = import_tools("canary_fuzz")
    faulty = weakref.WeakSet()
    build = fuzz.FuzzEngine.build_canary

    def build_canary(engine):
        canary = build(engine)
        if engine.fault is not None:
            faulty.add(canary)
        return canary

    monkeypatch.setattr(fuzz.FuzzEngine, "build_canary", build_canary)
    return faulty


def test_canary_fuzz_fails_a_canary_that_miscounts_only_in_the_run_with_a_fault(tmp_path, capsys, monkeypatch):
    """The counters of the run with a fault are judged too (a dropped write's entry counted as
    stored would be wrong there only)."""
    faulty = _canaries_of_fault_runs(monkeypatch)
    stats = kc.Canary.stats

    def slot_runs_plus_one(canary):
        counted = stats(canary)
        return {group: dict(counts, slot_run_counter=counts["slot_run_counter"] + (canary in faulty))
                for group, counts in counted.items()}

    monkeypatch.setattr(kc.Canary, "stats", slot_runs_plus_one)
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    faulted = [row for row in rows if row["fault"] != "none"]
    assert faulted and all(row["counter_errors"] for row in faulted)
    assert all(error.startswith("fault run: ") for row in rows for error in row["counter_errors"])


def test_canary_fuzz_records_a_crash_of_the_run_with_a_fault(tmp_path, capsys, monkeypatch):
    """A canary that fails only once a fault is injected is a crash of that seed, not a pass."""
    faulty = _canaries_of_fault_runs(monkeypatch)
    poll = kc.Canary.poll

    def failing_poll(canary):
        if canary in faulty:
            raise RuntimeError("a poll that fails")
        return poll(canary)

    monkeypatch.setattr(kc.Canary, "poll", failing_poll)
    printed, rows, total, _ = run_broken_fuzz(tmp_path, capsys)
    faulted = [row for row in rows if row["fault"] != "none"]
    assert faulted and all(row["crash"].startswith("fault run: ") for row in faulted)
    assert total["crashes"] == len(faulted) and "crash: RuntimeError: a poll that fails" in printed


@pytest.mark.parametrize("swa_kept", [True, False])
def test_canary_fuzz_fails_a_canary_that_writes_records_while_off(tmp_path, capsys, monkeypatch, swa_kept):
    """Records written while off into every group's buffer are seen, and so are records written
    by a canary with an SWA group into its full group's buffer alone (the SWA group's wiped)."""
    original = kc.Canary.after_forward

    def after_forward(self, batch, *, stream=None):
        if self.mode != "off" or not swa_kept and self.swa_context is None:
            return original(self, batch, stream=stream)
        self.mode = "log"
        try:
            original(self, batch, stream=stream)
        finally:
            self.mode = "off"
        if not swa_kept and self.swa_context is not None:
            self.swa_context.canary_buf[...] = 0

    monkeypatch.setattr(kc.Canary, "after_forward", after_forward)
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    off = [row for row in rows if row["config"]["mode"] == "off"]
    off = [row for row in off if swa_kept or row["config"]["swa_window"]]
    assert off and all(any("yet a canary buffer holds records" in error for error in row["counter_errors"])
                       for row in off)


def test_canary_fuzz_fails_reports_that_do_not_add_up(tmp_path, capsys, monkeypatch):
    """A report whose total is more than its events and dropped rows."""
    polls_changed(monkeypatch, lambda report: dataclasses.replace(report, total=report.total + 1))
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    assert any("dropped != total" in error for row in rows for error in row["counter_errors"])


def test_canary_fuzz_fails_reports_that_drop_more_rows_than_they_count(tmp_path, capsys, monkeypatch):
    """A report whose events and dropped rows come to more than its total."""
    polls_changed(monkeypatch, lambda report: dataclasses.replace(report, dropped=report.dropped + 1))
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    assert any("dropped != total" in error for row in rows for error in row["counter_errors"])


def test_canary_fuzz_fails_a_report_holding_one_row_of_a_group_more_than_its_ring(tmp_path, capsys, monkeypatch):
    """The first event given twice (the total counted to match): one row more than a ring of one
    keeps."""
    polls_changed(monkeypatch, lambda report: dataclasses.replace(report, events=report.events + report.events[:1],
                                                                  total=report.total + len(report.events[:1])))
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    assert any("past the ring's" in error for row in rows for error in row["counter_errors"]
               if row["config"]["ring_capacity"] == 1)


def test_canary_fuzz_fails_a_report_holding_more_rows_of_a_group_than_its_ring(tmp_path, capsys, monkeypatch):
    """Each event given five times over (the total counted to match): more rows of a group than a
    ring of one or four keeps."""
    polls_changed(monkeypatch, lambda report: dataclasses.replace(report, events=report.events * 5,
                                                                  total=report.total + 4 * len(report.events)))
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    assert any("past the ring's" in error for row in rows for error in row["counter_errors"]
               if row["config"]["ring_capacity"] in (1, 4))


def test_canary_fuzz_fails_a_report_holding_more_rows_of_one_group_than_its_ring_beside_another_group(
        tmp_path, capsys, monkeypatch):
    """Each report of a canary with an SWA group replaced by five rows of the full group and one of
    the SWA group (the total counted to match): the ring bounds each group, so the full group's
    rows are past a ring of one or four though the SWA group's one row is within it."""
    def one_group_flooded(report, canary):
        if canary.swa_context is None or not report.events:
            return report
        first = report.events[0]
        events = (dataclasses.replace(first, group="full"),) * 5 + (dataclasses.replace(first, group="swa"),)
        return dataclasses.replace(report, events=events, total=report.total - len(report.events) + len(events))

    polls_changed(monkeypatch, one_group_flooded, of_canary=True)
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    assert any("past the ring's" in error for row in rows for error in row["counter_errors"]
               if row["config"]["swa_window"] and row["config"]["ring_capacity"] in (1, 4))


def _events_changed(monkeypatch, change) -> None:
    """Every CanaryEvent the canary makes passed through ``change(event)`` (fields set in place)."""
    from kvcanary_cupy import session

    class Changed(session.CanaryEvent):
        def __init__(self, *fields):
            super().__init__(*fields)
            for name, value in change(self).items():
                object.__setattr__(self, name, value)

    monkeypatch.setattr(session, "CanaryEvent", Changed)


def test_canary_fuzz_fails_events_that_name_another_request(tmp_path, capsys, monkeypatch):
    """Judged in every seed whose ring keeps rows, a wrong token only the write input assert sees
    among them (seed 88), where neither a static forward refilled since nor a capped log excuses it."""
    _events_changed(monkeypatch, lambda event: {"request": "stranger"})
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    judged = [row for row in rows if row["detected"] and row["config"]["ring_capacity"]
              and row["config"]["static"] == "off" and row["config"]["max_logged"] == 1024]
    assert len(judged) >= 4 and any(row["seed"] == 88 for row in judged)
    assert all(row["misnamed"].startswith("no event named a victim") for row in judged)


def test_canary_fuzz_fails_events_that_name_a_bystander_beside_the_victim(tmp_path, capsys, monkeypatch):
    """Where every forward is polled, each event given twice, once naming a request the fault did
    not harm, is misnamed."""
    polls_changed(monkeypatch, lambda report: dataclasses.replace(
        report, events=report.events + tuple(dataclasses.replace(event, request="stranger") for event in report.events),
        total=report.total + len(report.events)))
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    assert any("nor thieves" in row["misnamed"] for row in rows if row["config"]["poll_every"] == 1)


def test_canary_fuzz_fails_a_slot_steal_whose_events_name_only_the_thief(tmp_path, capsys, monkeypatch):
    """Once a slot is stolen, every event naming the request it was handed to (the thief): the
    thief may be named beside a holder of the slot, never instead of one."""
    (fuzz,) = import_tools("canary_fuzz")
    engines = weakref.WeakKeyDictionary()
    for name in ("build_canary", "build_draft_canary"):
        def build(engine, build=getattr(fuzz.FuzzEngine, name)):
            canary = build(engine)
            engines[canary] = weakref.ref(engine)
            return canary

        monkeypatch.setattr(fuzz.FuzzEngine, name, build)

    def naming_the_thief(report, canary):
        fault = engines[canary]().fault
        if fault is None or fault.kind != "slot_steal" or not fault.bystanders:
            return report
        (thief,) = fault.bystanders
        return dataclasses.replace(report, events=tuple(dataclasses.replace(event, request=thief)
                                                        for event in report.events))

    polls_changed(monkeypatch, naming_the_thief, of_canary=True)
    # seed 398496 hands the slot of its request 19 to request 20, which held none of it
    _, (row,), _, _ = run_broken_fuzz(tmp_path, capsys, start=398496, seeds=1, forwards=60)
    assert row["fault"] == "slot_steal" and row["victims"] == [19] and row["named"] == ["20"]
    assert row["misnamed"].startswith("no event named a victim")


@pytest.mark.parametrize("shift", [1, -1])
def test_canary_fuzz_fails_events_whose_step_is_no_forward_since_the_previous_poll(tmp_path, capsys, monkeypatch,
                                                                                   shift):
    """Steps one forward off: past the last forward polled, or a forward's launch (not a sweep's,
    which takes the number of the forward before it) numbered as the forward the previous poll saw."""
    _events_changed(monkeypatch, lambda event: {} if event.step is None or shift < 0 and event.phase == "sweep"
                    else {"step": event.step + shift})
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    assert any("event steps outside forwards" in error for row in rows for error in row["counter_errors"])


def test_canary_fuzz_records_a_crash_of_the_clean_run_and_runs_the_next_seed(tmp_path, capsys, monkeypatch):
    def sweep(self, live_requests, *, stream=None):
        raise RuntimeError("a sweep that fails")

    monkeypatch.setattr(kc.Canary, "sweep", sweep)
    printed, rows, total, _ = run_broken_fuzz(tmp_path, capsys)
    assert len(rows) == 12 and total["crashes"] == 12 and "crash: RuntimeError: a sweep that fails" in printed
    assert all(row["crash"].startswith("clean run: ") for row in rows)


@pytest.mark.parametrize(("shift", "said"), [(1, "events named victims at positions"),
                                             (-1, "events named victims at positions"),
                                             (2, "no event named a victim at position")])
def test_canary_fuzz_on_the_cpu_finds_events_that_name_the_wrong_position(tmp_path, capsys, monkeypatch, shift, said):
    """Events naming the harmed request a position or two off are misnamed: the request alone
    would pass them. One position off is told where every forward is polled (the record at the
    harmed position may agree with itself, and only the next position's chain link tells); two
    off, wherever the events are judged."""
    _events_changed(monkeypatch, lambda event: {} if event.position is None else {"position": event.position + shift})
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    assert any(said in row["misnamed"] for row in rows)


def test_canary_fuzz_fails_events_that_name_the_victim_only_at_one_wrong_position(tmp_path, capsys, monkeypatch):
    """Every event that names a position naming one far past any the fault harms: the one position
    named is judged as several would be."""
    _events_changed(monkeypatch, lambda event: {} if event.position is None else {"position": 1 << 20})
    _, rows, _, _ = run_broken_fuzz(tmp_path, capsys)
    assert any("no event named a victim at position" in row["misnamed"] for row in rows)


def test_canary_fuzz_table_and_totals_count_each_column_from_its_own_field(tmp_path, capsys, monkeypatch):
    """Seeds' rows of known outcomes (a pass, a false positive, a counter mismatch, a missed, a
    misnamed, a crash, a fault that found no place): each failing seed is described by what
    failed, and each column of the table and the totals counts its own field."""
    (fuzz,) = import_tools("canary_fuzz")
    passed = {"config": {}, "examples": [], "fault": "kv_flip", "fault_where": "slot 3", "false_positives": 0,
              "counter_errors": [], "injected": True, "detected": True, "missed": False, "misnamed": "", "crash": None}
    outcomes = [({}, {"injected": 1}),
                ({"false_positives": 1}, {"false+": 1, "injected": 1}),
                ({"counter_errors": ["stats() off by one"]}, {"counters": 1, "injected": 1}),
                ({"detected": False, "missed": True}, {"injected": 1, "missed": 1}),
                ({"misnamed": "no event named a victim"}, {"injected": 1, "misnamed": 1}),
                ({"injected": False, "detected": False, "crash": "clean run: Traceback\nRuntimeError: boom\n"},
                 {"crashes": 1}),
                ({"injected": False, "detected": False}, {})]
    monkeypatch.setattr(fuzz, "run_seed", lambda seed, dev, forwards: dict(
        passed, **outcomes[seed][0], seed=seed, features=["layout=paged", f"outcome={seed}"]))
    out = tmp_path / "fuzz.json"
    status = fuzz.main(["--device", "cpu", "--seeds", str(len(outcomes)), "--forwards", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert status == 1
    for seed, (_, counted) in enumerate(outcomes):
        assert result["by_feature"][f"outcome={seed}"] == {column: counted.get(column, int(column == "runs"))
                                                             for column in fuzz.TABLE_COLUMNS}
    assert result["by_feature"]["layout=paged"] == {"runs": 7, "false+": 1, "counters": 1, "injected": 5,
                                                    "missed": 1, "misnamed": 1, "crashes": 1}
    total = result["total"]
    assert (total["false_positives"], total["counter_errors"], total["injected"], total["not_injected"],
            total["missed"], total["misnamed"], total["crashes"]) == (1, 1, 5, 2, 1, 1, 1)
    failures = [line for line in printed.splitlines() if "FAILED" in line]
    assert [line.split()[1] for line in failures] == ["1", "2", "3", "4", "5"]
    for line, said in zip(failures, ("1 false positive(s)", "counters: stats() off by one", "missed kv_flip (slot 3)",
                                     "misnamed kv_flip (slot 3): no event named a victim", "crash: RuntimeError: boom")):
        assert line.endswith(said)


def test_detection_seeds_tells_a_cell_that_holds_on_the_tables_seed_from_one_another_seed_breaks():
    """tools/detection_seeds.py holds a cell to its bound on every seed: use_after_free's 4 holds on
    the table's own seed and not on seed 19, where the allocator takes 5 steps to hand the freed
    page out again and the canary reports it in that step."""
    (seeds,) = import_tools("detection_seeds")
    own = seeds.cell_runs("use_after_free", "NONE", range(11, 12), "cpu")
    assert own["holds"] and own["cell"] == "≤ 4" and own["faults"] == 10 and own["worst"] <= 4
    other = seeds.cell_runs("use_after_free", "NONE", range(19, 20), "cpu")
    assert not other["holds"] and other["worst"] == 5 and other["unreported"] == other["false_positives"] == 0
    assert max(other["reuse_waits"]) == 5 and sum(other["reuse_waits"].values()) == other["faults"]
    missed = seeds.cell_runs("kv_bitflip@40", "PARTIAL", range(19, 20), "cpu")
    assert missed["holds"] and missed["cell"] == "missed" and missed["unreported"] == missed["faults"] == 10


def test_kernel_mutants_change_one_line_of_a_copy_that_the_package_then_reads(tmp_path):
    """tools/kernel_mutants.py: every CUDA source has changes to draw, each one line's; a change is
    made in a worker's copy of the sources, which a check's package reads in place of its own, and
    undone once the check has judged it."""
    import sys
    import time

    (mutants,) = import_tools("kernel_mutants")
    drawn = mutants.candidates()
    assert {m.filename for m in drawn} == set(mutants.OPS_BY_FILE)
    for m in drawn:
        source = (mutants.REPO / mutants.KERNELS / m.filename).read_text().splitlines()
        assert source[m.line - 1] == m.before != m.after
    change = next(m for m in drawn if m.filename == "verify.cu" and m.operator == "<")
    worker = mutants.Worker(tmp_path / "w0")
    pristine = (worker.kernels / "verify.cu").read_text()
    probe = tmp_path / "probe.py"
    probe.write_text("from kvcanary_cupy.rawkernels import _loader\n"
                     f"assert {change.after!r} in _loader._read('verify.cu').splitlines()\n")

    class ReadsTheChange(mutants.Checks):
        def commands(self, mutant, seed):
            return [("fuzz", "reads the change", [sys.executable, str(probe)])]

    row = worker.judge(change, ReadsTheChange(cases=1, memcheck=False, tests=False), 0, 120, time.perf_counter() + 120)
    assert row["verdict"] == "survived", row["tail"]  # the probe passed: it read the changed line
    assert (worker.kernels / "verify.cu").read_text() == pristine


def test_kernel_mutants_checks_run_the_sanitizers_asked_for_after_the_fuzz_and_before_the_tests():
    (mutants,) = import_tools("kernel_mutants")
    change = next(m for m in mutants.candidates() if m.filename == "batch_plan.cuh")
    every = mutants.Checks(cases=8, memcheck=True, tests=True, racecheck=True, synccheck=True).commands(change, 3)
    assert [name for _, name, _ in every] == ["fuzz plan step", "memcheck fuzz plan step", "racecheck fuzz plan step",
                                              "synccheck fuzz plan step", "tests"]
    assert [caught for caught, _, _ in every] == ["fuzz", "memcheck", "racecheck", "synccheck", "tests"]
    for (tool, _, argv) in every[1:4]:
        assert argv[:3] == ["compute-sanitizer", "--tool", tool]
        assert argv[argv.index("--launch-timeout") + 1] == "300"  # a slow first touch of CUDA still checked
        assert argv[argv.index("--ops") + 1:][:2] == ["plan", "step"]
        assert "--exact-allocations" in argv
    plain = mutants.Checks(cases=8, memcheck=False, tests=False).commands(change, 3)
    assert [name for _, name, _ in plain] == ["fuzz plan step"]
    # the write's forced forms each draw cases of their own, not the first cases of the plain fuzz again
    write = next(m for m in mutants.candidates() if m.filename == "write.cu")
    fuzzes = mutants.Checks(cases=8, memcheck=False, tests=False).commands(write, 3)
    assert [name for _, name, _ in fuzzes] == ["fuzz write", "fuzz write thread", "fuzz write one", "fuzz write two"]
    assert len({argv[argv.index("--seed") + 1] for _, _, argv in fuzzes}) == 4
    assert not any("--stale-shared" in argv for _, _, argv in fuzzes + every)
    # asked for, every fuzz (under the sanitizers too) runs over stale shared memory; the tests do not
    stale = mutants.Checks(cases=8, memcheck=True, tests=True, stale_shared=True).commands(change, 3)
    assert ["--stale-shared" in argv for _, _, argv in stale] == [True, True, False]


def test_kernel_mutants_replay_takes_each_survivor_of_several_runs_once(tmp_path):
    """``--replay`` of several runs: their survivors and the changes ``--limit`` cut short, a change
    two runs share judged once and by the later run's verdict, a survivor whose line moved found by
    its text, and the changes another verdict met left out unless named by their place; each subset
    that ``--crashed``, ``--unfinished`` and ``--survived`` take."""
    import json

    (mutants,) = import_tools("kernel_mutants")
    drawn = mutants.candidates()
    first, second, third, fourth = [m for m in drawn if m.filename == "verify.cu"][:4]

    def row(m, verdict, line=None):
        return {"ident": m.ident, "filename": m.filename, "line": line or m.line, "before": m.before,
                "after": m.after, "operator": m.operator, "verdict": verdict}

    runs = []
    for k, rows in enumerate([[row(first, "survived"), row(second, "fuzz")],
                              [row(first, "survived"), row(third, "survived", line=third.line + 3),
                               row(fourth, "unfinished")]]):
        runs.append(tmp_path / f"run{k}.json")
        runs[-1].write_text(json.dumps({"summary": {}, "rows": rows}))
    again = mutants.replayed([str(p) for p in runs])
    assert [(m.filename, m.line, m.after) for m in again] == [(first.filename, first.line, first.after),
                                                               (third.filename, third.line, third.after),
                                                               (fourth.filename, fourth.line, fourth.after)]
    assert mutants.replayed([str(p) for p in runs], only="crashed") == []
    # a change another verdict met, named by where that run had it, is judged again
    named = frozenset({f"{second.filename}:{second.line}"})
    assert [m.ident for m in mutants.replayed([str(runs[0])], named=named)] == [first.ident, second.ident]
    assert [m.ident for m in mutants.replayed([str(runs[0])], only="crashed", named=named)] == [second.ident]
    # the changes left unfinished alone; a change a later run judged goes by that run's verdict
    assert [m.ident for m in mutants.replayed([str(p) for p in runs], only="unfinished")] == [fourth.ident]
    runs.append(tmp_path / "run2.json")
    runs[-1].write_text(json.dumps({"summary": {}, "rows": [row(fourth, "fuzz"), row(second, "survived")]}))
    assert [m.ident for m in mutants.replayed([str(p) for p in runs])] == [first.ident, third.ident, second.ident]
    assert mutants.replayed([str(p) for p in runs], only="unfinished") == []
    # the survivors alone, but those whose kernel images are the unchanged ones
    runs.append(tmp_path / "run3.json")
    runs[-1].write_text(json.dumps({"summary": {}, "rows": [dict(row(first, "survived"), images="same"),
                                                            dict(row(second, "survived"), images="changed")]}))
    assert [m.ident for m in mutants.replayed([str(p) for p in runs], only="survived")] == [third.ident, second.ident]


def _checks_running(mutants, probe, check: str):
    """kernel_mutants' checks made of one command, the script ``probe`` given an argument, standing
    for the check named ``check`` ("tests", "memcheck")."""
    import sys

    def checks(when: str):
        class Probe(mutants.Checks):
            def commands(self, mutant, seed):
                return [(check, check, [sys.executable, str(probe), when])]
        return Probe(cases=1, memcheck=check == "memcheck", tests=check == "tests")
    return checks


def test_kernel_mutants_count_a_crashed_check_only_where_the_unchanged_sources_pass_it(tmp_path):
    """A check whose process dies of a signal catches the change only if the same check passes on
    the unchanged sources; a check that crashes either way leaves the change unjudged. Rows that
    earlier runs took from crashed checks, and rows left unjudged, are found again by ``--replay --crashed``."""
    import json
    import time

    (mutants,) = import_tools("kernel_mutants")
    change = next(m for m in mutants.candidates() if m.filename == "verify.cu")
    worker = mutants.Worker(tmp_path / "w0")
    # aborts (faulthandler on, as under pytest) when the copy holds the change, or always
    probe = tmp_path / "probe.py"
    probe.write_text("import faulthandler, os, sys\nfrom kvcanary_cupy.rawkernels import _loader\n"
                     "faulthandler.enable()\n"
                     f"if sys.argv[1] == 'always' or {change.after!r} in _loader._read('verify.cu').splitlines():\n"
                     "    os.abort()\n")

    checks = _checks_running(mutants, probe, "tests")

    caught = worker.judge(change, checks("changed"), 0, 120, time.perf_counter() + 120)
    assert caught["verdict"] == "tests" and caught["crash"].startswith("[exit status -6, SIGABRT, ")
    assert mutants.FATAL in caught["crash"]
    broken = worker.judge(change, checks("always"), 0, 120, time.perf_counter() + 120)
    assert broken["verdict"] == "unjudged" and "unchanged sources too" in broken["by"]

    others = [m for m in mutants.candidates() if m.filename == "verify.cu"][1:5]
    listed = "numpy._core._multiarray_umath, numpy.linalg._umath_linalg (total: 2)\n"
    rows = [dict(mutants.dataclasses.asdict(m), verdict=verdict, tail=tail) for m, verdict, tail in
            zip(others, ("tests", "tests", "survived", "unjudged"), (listed, "1 failed, 3 passed", "4 passed", ""))]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"rows": rows}))
    assert [m.ident for m in mutants.replayed([str(run)], only="crashed")] == [others[0].ident, others[3].ident]
    assert [m.ident for m in mutants.replayed([str(run)])] == [others[0].ident, others[2].ident, others[3].ident]


def test_kernel_mutants_count_a_check_past_its_timeout_only_where_the_unchanged_sources_end_in_time(tmp_path):
    """A check that runs past ``--timeout`` catches the change (a hang) only where the same check
    ends within it on the unchanged sources; one that runs past it either way (the GPU tests of a
    header every kernel includes, on a card many workers share) leaves the change unfinished, for
    ``--replay`` to take again, and so does one that ``--limit`` cuts short on the unchanged sources,
    which the row then says instead of a timeout."""
    import time

    (mutants,) = import_tools("kernel_mutants")
    change = next(m for m in mutants.candidates() if m.filename == "verify.cu")
    worker = mutants.Worker(tmp_path / "w0")
    probe = tmp_path / "probe.py"
    probe.write_text("import sys, time\nfrom kvcanary_cupy.rawkernels import _loader\n"
                     f"if sys.argv[1] == 'always' or {change.after!r} in _loader._read('verify.cu').splitlines():\n"
                     "    time.sleep(60)\n")
    checks = _checks_running(mutants, probe, "tests")

    hung = worker.judge(change, checks("changed"), 0, 8, time.perf_counter() + 60)
    assert hung["verdict"] == "hang" and hung["by"] == "tests" and "crash" not in hung
    slow = worker.judge(change, checks("always"), 0, 8, time.perf_counter() + 60)
    assert slow["verdict"] == "unfinished"
    assert slow["by"] == "tests: runs past the timeout on the unchanged sources too (hang)"
    # the same check on the unchanged sources stopped by --limit before its timeout: no more is known
    cut = worker.judge(change, checks("always"), 0, 3, time.perf_counter() + 4)
    assert cut["verdict"] == "unfinished" and cut["by"] == "tests: cut short by --limit on the unchanged sources"
    assert (tmp_path / "w0" / "rawkernels" / "verify.cu").exists() and \
        change.after not in (tmp_path / "w0" / "rawkernels" / "verify.cu").read_text().splitlines()


def test_kernel_mutants_judge_a_change_once_more_after_its_check_crashed_either_way(tmp_path):
    """A check that crashes on the changed and on the unchanged sources alike leaves the change
    unjudged; while the deadline allows, the change is judged once more after a wait (such crashes
    came in windows of a few seconds), and the row keeps the first try."""
    import time

    (mutants,) = import_tools("kernel_mutants")
    change = next(m for m in mutants.candidates() if m.filename == "verify.cu")
    worker = mutants.Worker(tmp_path / "w0")
    runs = tmp_path / "runs"
    # its first two runs (the change's, then the unchanged sources') abort; later runs fail on the
    # change alone
    probe = tmp_path / "probe.py"
    probe.write_text("import faulthandler, os, pathlib, sys\nfrom kvcanary_cupy.rawkernels import _loader\n"
                     "faulthandler.enable()\n"
                     f"runs = pathlib.Path({str(runs)!r})\n"
                     "before = len(runs.read_text()) if runs.exists() else 0\n"
                     "runs.write_text('x' * (before + 1))\n"
                     "if before < 2:\n    os.abort()\n"
                     f"sys.exit(1 if {change.after!r} in _loader._read('verify.cu').splitlines() else 0)\n")
    checks = _checks_running(mutants, probe, "tests")("changed")

    def judge():
        return worker.judge(change, checks, 0, 120, time.perf_counter() + 120)

    row = mutants.judged_once_more_if_unjudged(judge, 0.0, lambda: 100.0)
    assert row["verdict"] == "tests" and "crash" not in row
    assert row["first_try"]["verdict"] == "unjudged" and "unchanged sources too" in row["first_try"]["by"]
    assert row["first_try"]["crash"].startswith("[exit status -6, SIGABRT, ")
    assert len(runs.read_text()) == 3  # changed (crash), unchanged (crash), changed again (fails)

    runs.unlink()  # a first try that crashes either way, with no time left for a second
    row = mutants.judged_once_more_if_unjudged(judge, 30.0, lambda: 10.0)
    assert row["verdict"] == "unjudged" and "first_try" not in row and len(runs.read_text()) == 2


def test_kernel_mutants_tell_a_compiler_that_crashed_and_a_sanitizer_that_found_nothing(tmp_path):
    """A process that dies inside CuPy's compiler (NVRTC crashed compiling the change) leaves the
    change stillborn, not caught. A sanitizer's check that fails while the sanitizer reports no
    error of its own is a crash of the process under it: it catches the change only where the
    unchanged sources pass the same check."""
    import time

    (mutants,) = import_tools("kernel_mutants")
    change = next(m for m in mutants.candidates() if m.filename == "verify.cu")
    worker = mutants.Worker(tmp_path / "w0")
    compiler = tmp_path / "fake" / "cupy" / "cuda"
    compiler.mkdir(parents=True)
    (compiler / "compiler.py").write_text("import os\n\ndef compile():\n    os.abort()\n")
    probe = tmp_path / "probe.py"
    probe.write_text("import faulthandler, importlib.util, sys\nfrom kvcanary_cupy.rawkernels import _loader\n"
                     "faulthandler.enable()\n"
                     f"changed = {change.after!r} in _loader._read('verify.cu').splitlines()\n"
                     "if sys.argv[1] == 'compiler' and changed:\n"
                     f"    spec = importlib.util.spec_from_file_location('compiler', {str(compiler / 'compiler.py')!r})\n"
                     "    module = importlib.util.module_from_spec(spec)\n"
                     "    spec.loader.exec_module(module)\n"
                     "    module.compile()\n"
                     "if sys.argv[1] == 'always' or sys.argv[1] == 'sanitizer' and changed:\n"
                     "    print('========= Error: process did not terminate successfully')\n"
                     "    print('========= ERROR SUMMARY: 0 errors')\n"
                     "    sys.exit(1)\n")

    checks = _checks_running(mutants, probe, "memcheck")

    stillborn = worker.judge(change, checks("compiler"), 0, 120, time.perf_counter() + 120)
    assert stillborn["verdict"] == "stillborn" and "cupy/cuda/compiler.py" in stillborn["tail"]
    caught = worker.judge(change, checks("sanitizer"), 0, 120, time.perf_counter() + 120)
    assert caught["verdict"] == "memcheck" and caught["crash"].startswith("[exit status 1, ")
    assert "GiB of memory available after it]" in caught["crash"] or not os.path.exists("/proc/meminfo")
    broken = worker.judge(change, checks("always"), 0, 120, time.perf_counter() + 120)
    assert broken["verdict"] == "unjudged" and "unchanged sources too" in broken["by"]
    row = dict(mutants.dataclasses.asdict(change), verdict="memcheck", tail="========= ERROR SUMMARY: 0 errors\n")
    assert mutants.crashed(row)  # an earlier run's row of this kind is judged again by --replay --crashed


def test_kernel_mutants_skip_leaves_out_the_first_changes_of_a_seed_drawn():
    """``--skip K`` goes on where a run of the same seed stopped: the changes it lists are those the
    seed draws past its first K."""
    import subprocess
    import sys

    def listed(*extra):
        run = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_mutants.py"), "--seed", "2", "--mutants", "30",
                              "--list", *extra], capture_output=True, text=True, check=True)
        return set(run.stdout.splitlines()[:-1])

    every, rest = listed(), listed("--skip", "12")
    assert len(every) == 30 and len(rest) == 18 and rest < every


def test_kernel_mutants_cubins_tell_a_change_the_compiler_drops_from_one_it_keeps():
    """``--cubins``: the store loop of scatter's copy ahead run one past its local array (an extra
    store that is never made) leaves every image as it was; the row store one column past the
    request's alters scatter's image, and only scatter's (no other source includes scatter.cu). A
    header belongs to every source that includes it."""
    pytest.importorskip("cuda.bindings.nvrtc")
    (mutants,) = import_tools("kernel_mutants")
    scatter = [m for m in mutants.candidates() if m.filename == "scatter.cu" and m.operator == "<"]
    store_loop = next(m for m in scatter if m.after.strip() == "for (int u = 0; u <= kCopyAhead; ++u) {"
                      and "row[col]" in _line_after(m))
    store = next(m for m in scatter if m.after.strip() == "if (col <= j_hi) row[col] = v[u];")
    assert mutants.compiled_differences(store_loop) == []
    assert mutants.compiled_differences(store) == ["sm_80:scatter.cu", "sm_90:scatter.cu"]
    assert (mutants.images_of(store_loop), mutants.images_of(store)) == ("same", "changed")  # a survivor's row
    sources = {p.name: p.read_text() for p in (ROOT / "kvcanary_cupy" / "rawkernels").glob("*.cu*")}
    assert "canary_common.cuh" in mutants._included("verify.cu", sources)
    assert "scatter.cu" not in mutants._included("verify.cu", sources)


def _line_after(mutant, lines: int = 3) -> str:
    """The source lines just after a change's line."""
    text = (ROOT / "kvcanary_cupy" / "rawkernels" / mutant.filename).read_text().splitlines()
    return "\n".join(text[mutant.line:mutant.line + lines])


def test_host_mutants_change_one_operator_or_statement_and_keep_every_line_in_place():
    """tools/host_mutants.py: each change of a Python source replaces one operator (two words for
    ``not in`` and ``is not``), one ``not`` (a parenthesised operand keeps its parenthesis) or one
    ``raise`` (its lines kept, empty); every change compiles and leaves every line where it was."""
    (mutants,) = import_tools("host_mutants")
    source = (b"def f(a, b):\n"
              b"    if a < b and not (a in b or a is not None):\n"
              b"        raise ValueError(\n"
              b"            'x')\n"
              b"    return not a == b\n")
    changes = mutants.candidates("f.py", source)
    after = {(c.line, c.operator): mutants.line_text(c.apply(source), c.line) for c in changes}
    assert after == {
        (2, "<"): "if a <= b and not (a in b or a is not None):",
        (2, "and"): "if a < b or not (a in b or a is not None):",
        (2, "not"): "if a < b and (a in b or a is not None):",
        (2, "in"): "if a < b and not (a not in b or a is not None):",
        (2, "or"): "if a < b and not (a in b and a is not None):",
        (2, "is not"): "if a < b and not (a in b or a is None):",
        (3, "raise"): "pass",
        (5, "not"): "return a == b",
        (5, "=="): "return not a != b",
    }
    for change in changes:
        changed = change.apply(source)
        compile(changed, "f.py", "exec")
        assert changed.count(b"\n") == source.count(b"\n")


def test_host_mutants_find_operators_beside_parentheses_and_arithmetic_only_when_asked():
    """An operator between parenthesised operands is a candidate like any other (its gap holds
    unbalanced parentheses and may hold a comment). ``--arithmetic``'s changes turn one arithmetic
    or bitwise operator, in an expression or an augmented assignment, and leave out annotations and
    the operators of strings and sequences."""
    (mutants,) = import_tools("host_mutants")
    source = (b"def f(a: int | None, b) -> int | None:\n"
              b"    c = (a + 1) - (b << 2)  # x\n"
              b"    c += a % 3 if (a) is not (b) else 0\n"
              b"    s = 'ab' * 2 + f'{a}'\n"
              b"    t = [a] * 2\n"
              b"    return (c  # why\n"
              b"            < b) or (a & b) == (a ^ b)\n")
    logic = {(c.line, c.operator): mutants.changed_line(c.apply(source), c.line)
             for c in mutants.candidates("f.py", source)}
    assert logic == {
        (3, "is not"): "c += a % 3 if (a) is (b) else 0",
        (6, "<"): "return (c  # why",
        (7, "or"): "< b) and (a & b) == (a ^ b)",
        (7, "=="): "< b) or (a & b) != (a ^ b)",
    }
    arithmetic = {(c.line, c.operator, mutants.changed_line(c.apply(source), c.line))
                  for c in mutants.candidates("f.py", source, kinds=("arithmetic",))}
    assert arithmetic == {
        (2, "+", "c = (a - 1) - (b << 2)  # x"), (2, "-", "c = (a + 1) + (b << 2)  # x"),
        (2, "<<", "c = (a + 1) - (b >> 2)  # x"), (3, "+=", "c -= a % 3 if (a) is not (b) else 0"),
        (3, "%", "c += a // 3 if (a) is not (b) else 0"), (7, "&", "< b) or (a | b) == (a ^ b)"),
        (7, "^", "< b) or (a & b) == (a | b)"),
    }
    for change in mutants.candidates("f.py", source, kinds=("logic", "arithmetic")):
        changed = change.apply(source)
        compile(changed, "f.py", "exec")
        assert changed.count(b"\n") == source.count(b"\n")


def test_host_mutants_find_an_earlier_runs_changes_after_the_file_has_moved():
    """Rows of an earlier run name changes by line and text: where lines were added above them,
    the change of the same text is found (of two alike lines, the nearer one to the row's line);
    two runs' rows of one change take it once; a row whose text is gone takes nothing."""
    (mutants,) = import_tools("host_mutants")
    earlier = (b"def f(a, b):\n"
               b"    if a is None:\n"
               b"        return 0\n"
               b"    if a < b:\n"
               b"        return 1\n"
               b"    if a is None:\n"
               b"        return 2\n"
               b"    return a == b\n")
    now = earlier.replace(b"def f(a, b):\n", b"def f(a, b):\n    b = b + 1\n")
    now = now.replace(b"return a == b", b"return a != b")

    def rows_of(source, wanted):
        found = []
        for change in mutants.candidates("f.py", source):
            if (change.line, change.operator) in wanted:
                found.append({"filename": "f.py", "line": change.line, "operator": change.operator,
                              "before": mutants.line_text(source, change.line),
                              "after": mutants.changed_line(change.apply(source), change.line)})
        return found

    rows = rows_of(earlier, {(6, "is"), (4, "<"), (8, "==")})
    changes = mutants.candidates("f.py", now)
    found = mutants.matching(changes, {"f.py": now}, rows + rows[:1])
    assert [(change.line, change.operator) for change in found] == [(5, "<"), (7, "is")]
    unmoved = mutants.candidates("f.py", earlier)
    assert [(c.line, c.operator) for c in mutants.matching(unmoved, {"f.py": earlier}, rows)] == \
        [(4, "<"), (6, "is"), (8, "==")]


def test_host_mutants_judge_a_change_in_a_copy_by_its_tests(tmp_path):
    """A change is made in a worker's copy of the package, which the tests run there import in
    place of the repository's: a dropped rule that a test pins is caught, a change of a rule no
    selected test reaches survives; the repository's file is never touched. ``--replay`` takes the
    survivors and the unjudged; a failure for want of device memory judges nothing."""
    (mutants,) = import_tools("host_mutants")
    rules = "kvcanary_cupy/validate/rules.py"
    pristine = (ROOT / rules).read_bytes()
    changes = mutants.candidates(rules, pristine)
    caught = next(c for c in changes if c.operator == "raise"
                  and b"must be non-negative" in pristine[c.start:c.end])
    missed = next(c for c in changes if c.operator == "raise" and b"must be a bool" in pristine[c.start:c.end])
    survivors = tmp_path / "earlier.json"
    survivors.write_text(json.dumps({"rows": [
        {"filename": rules, "line": c.line, "operator": c.operator, "verdict": verdict,
         "after": mutants.line_text(c.apply(pristine), c.line) or "(empty)"}
        for c, verdict in ((caught, "survived"), (missed, "unjudged"))]}))
    out = tmp_path / "out.json"
    assert mutants.main(["--replay", str(survivors), "--workers", "1", "--json", str(out),
                         "--tests", "tests/test_validation.py::test_seed_message_verify_capacity"]) == 0
    verdicts = {row["line"]: row["verdict"] for row in json.loads(out.read_text())["rows"]}
    assert verdicts == {caught.line: "tests", missed.line: "survived"}
    assert (ROOT / rules).read_bytes() == pristine
    assert mutants.verdict_of(1, "E   cupy.cuda.memory.OutOfMemoryError: Out of memory allocating") == "unjudged"
    assert mutants.verdict_of(1, "E   torch.OutOfMemoryError: CUDA out of memory.") == "unjudged"
    assert mutants.verdict_of(1, "E   RuntimeError: CUDA error: out of memory") == "unjudged"
    assert mutants.verdict_of(1, "E   AssertionError") == "tests"
    assert mutants.verdict_of(0, "") == "survived"


def test_host_mutants_confirm_a_catch_only_where_its_test_fails_with_the_change_and_passes_without(tmp_path):
    """--confirm: the first failing test of a catch runs alone with the change and without it. A
    catch stands where it fails with and passes without; a test that passes when run again, or
    fails without the change too, leaves the change unjudged, saying which run disagreed."""
    (mutants,) = import_tools("host_mutants")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_probe.py").write_text(
        "import pathlib\n\n\ndef test_probe():\n"
        "    assert pathlib.Path(__file__).with_name('flag').read_text() != 'changed'\n")
    flag = tmp_path / "tests" / "flag"
    tail = "FAILED tests/test_probe.py::test_probe - AssertionError: assert 'changed' != 'changed'\n1 failed in 0.1s"
    flag.write_text("changed")
    assert mutants.confirmed(tmp_path, flag, b"kept", tail, 60) == (
        "tests", "tests/test_probe.py::test_probe failed again with the change and passed without it")
    assert flag.read_text() == "kept"
    flag.write_text("changed")
    verdict, seen = mutants.confirmed(tmp_path, flag, b"changed", tail, 60)
    assert (verdict, seen) == ("unjudged", "tests/test_probe.py::test_probe failed without the change")
    flag.write_text("kept")  # the first failure was not the change's: the test passes with it
    verdict, seen = mutants.confirmed(tmp_path, flag, b"kept", tail, 60)
    assert (verdict, seen) == ("unjudged", "tests/test_probe.py::test_probe passed when run again with the change")
    assert mutants.confirmed(tmp_path, flag, b"kept", "1 failed in 0.1s", 60) == ("tests", "no failing test named")
    named = mutants.FAILED_TEST.search("ERROR tests/test_a.py::test_b[swa slots given-cuda] - ValueError: x")
    assert named.group(1) == "tests/test_a.py::test_b[swa slots given-cuda]"

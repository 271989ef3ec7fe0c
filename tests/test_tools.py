"""The probes in tools/ import on a machine without a GPU (they need one only to run): a helper
renamed or moved in the package or in tools/_probe.py breaks them here, not in the next GPU session.
The kc.Canary fuzz (tools/canary_fuzz.py) also runs a few seeds on the CPU."""

from __future__ import annotations

import json

import pytest
from _tools import TOOLS, import_tools


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


@pytest.mark.parametrize("shift", [1, -1])
def test_canary_fuzz_on_the_cpu_finds_events_that_name_the_wrong_position(tmp_path, capsys, monkeypatch, shift):
    """Events naming the harmed request one position off are misnamed: the request alone would
    pass them."""
    from kvcanary_cupy import session

    (fuzz,) = import_tools("canary_fuzz")

    class Shifted(session.CanaryEvent):
        def __init__(self, *fields):
            super().__init__(*fields)
            if self.position is not None:
                object.__setattr__(self, "position", self.position + shift)

    monkeypatch.setattr(session, "CanaryEvent", Shifted)
    out = tmp_path / "fuzz.json"
    status = fuzz.main(["--device", "cpu", "--start", "84", "--seeds", "12", "--forwards", "16", "--json", str(out)])
    capsys.readouterr()
    rows = json.loads(out.read_text())["rows"]
    assert status == 1
    assert any("position" in row["misnamed"] for row in rows)

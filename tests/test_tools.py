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


def test_canary_fuzz_on_the_cpu_finds_no_false_positive_and_misses_no_fault(tmp_path, capsys):
    """A few seeds of tools/canary_fuzz.py: clean runs report nothing and their counters match what
    the engine did (all zero with the canary off), every injected fault is reported and named on
    the request it harms, and nothing crashes; prefix sharing and a draft model's canary among them."""
    (fuzz,) = import_tools("canary_fuzz")
    out = tmp_path / "fuzz.json"
    # seeds 84-95 hold a canary that is off, prefix sharing and faults on shared slots, a draft
    # model's canary and both of its faults
    status = fuzz.main(["--device", "cpu", "--start", "84", "--seeds", "12", "--forwards", "16", "--json", str(out)])
    printed = capsys.readouterr().out
    total = json.loads(out.read_text())["total"]
    assert status == 0, printed
    assert total["runs"] == 12 and total["injected"] >= 10
    assert total["false_positives"] == total["counter_errors"] == total["missed"] == total["crashes"] == 0
    assert total["misnamed"] == 0
    assert "layout=paged" in printed and "fault=" in printed  # the table by feature
    for feature in ("mode=off", "prefix_sharing=on", "prefix_cache=on", "fault=slot_steal@shared",
                    "fault=draft_token", "fault=draft_kv_flip"):
        assert feature in printed

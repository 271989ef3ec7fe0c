"""The serving simulator: a clean run stays clean, every fault class is caught as docs/detection.md says."""

from __future__ import annotations

import collections
import errno
import json
import os
import pathlib
import re
import sys
from typing import Optional

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.sim import FAULT_CLASSES, SimConfig, run
from kvcanary_cupy.sim.cli import main as demo_main
from kvcanary_cupy.sim.static_decode import batch_sizes

from _devices import BACKENDS, requires_gpu

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "detection.md"
MODES = {"NONE": kc.HashMode.NONE, "PARTIAL": kc.HashMode.PARTIAL, "ALL": kc.HashMode.ALL}


def _table() -> dict:
    text = DOC.read_text(encoding="utf-8")
    body = text.split("<!-- detection-table")[1].split("<!-- end detection-table -->")[0]
    rows = {}
    for line in body.splitlines():
        match = re.match(r"\|\s*`([^`]+)`\s*\|[^|]*\|(.*)\|\s*$", line)
        if match:
            cells = [c.strip() for c in match.group(2).split("|")]
            rows[match.group(1)] = dict(zip(MODES, cells))
    return rows


TABLE = _table() if DOC.exists() else {}


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(hash_mode=kc.HashMode.ALL, layout="interleaved", seed=3),
    dict(hash_mode=kc.HashMode.NONE, layout="mla", swa_window=24, seed=5),
], ids=["partial-paged", "all-interleaved", "none-mla-swa"])
def test_clean_run_has_no_violations(kwargs):
    result = run(SimConfig(steps=240, pool_slots=3072, **kwargs), [])
    assert sum(result.violations_per_step) == 0
    assert result.false_positives == []
    assert result.shared_tokens > 0, "prefix sharing must happen"
    assert result.reused_pages > 0, "freed slots must be reused"
    assert result.requests_finished > 10
    assert result.verified_entries > 0


def test_table_covers_every_class():
    assert {key.split("@")[0].split("/")[0] for key in TABLE} == set(FAULT_CLASSES)


TABLE_SEED = 11  # the run the table's cells were measured on


def table_run(scenario: str, mode: str, seed: int = TABLE_SEED, device: str = "cpu"):
    """The table's run of ``scenario`` (``class[/no-checks][@byte]``) in ``mode``: 110 steps, a
    fault every 10 from step 10, the simulator's defaults."""
    cls, _, variant = scenario.partition("@")
    cls, _, option = cls.partition("/")
    config = SimConfig(steps=110, seed=seed, device=device, hash_mode=MODES[mode],
                       expected_checks=option != "no-checks")
    return run(config, [cls], fault_every=10, bitflip_offset=int(variant) if variant else None)


def cell_bound(cell: str) -> Optional[int]:
    """The most steps a cell allows before the report (``None``: ``missed``, never reported)."""
    return None if cell == "missed" else int(cell.replace("≤", "").strip())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("scenario", sorted(TABLE))
def test_documented_detection(scenario, mode):
    cell = TABLE[scenario][mode]
    result = table_run(scenario, mode)
    assert len(result.faults) >= 8
    bound = cell_bound(cell)
    if bound is None:
        assert not any(f.detected for f in result.faults), [f.first_event for f in result.faults if f.detected]
    else:
        late = [(f.step, f.latency) for f in result.faults if not f.detected or f.latency > bound]
        assert not late, f"{scenario} in {mode}: undetected or later than {bound} steps: {late}"
    assert result.false_positives == []


# What each fault class breaks: the reasons its first event must give exactly (a KV byte, a write's
# position or token), or must include (a record read where another belongs: chain and token).
REASONS = {"kv_bitflip": ("==", {"REAL_KV_HASH"}), "offload_bitflip": ("==", {"REAL_KV_HASH"}),
           "stale_position": ("==", {"WRITE_POSITION"}), "token_swap": ("==", {"WRITE_TOKEN"}),
           "slot_alias": ("<=", {"CHAIN_HASH", "VERIFY_TOKEN"}), "use_after_free": ("<=", {"CHAIN_HASH", "VERIFY_TOKEN"}),
           "canary_overwrite": ("<=", {"CHAIN_HASH"})}


def test_reasons_cover_every_class():
    assert set(REASONS) == set(FAULT_CLASSES)


@pytest.mark.parametrize("cls", FAULT_CLASSES)
def test_report_names_request_and_position(cls):
    result = run(SimConfig(steps=110, seed=2, hash_mode=kc.HashMode.ALL), [cls], fault_every=10)
    how, reasons = REASONS[cls]
    detected = [f for f in result.faults if f.detected]
    assert detected
    for fault in detected:
        event = fault.first_event
        assert event.request in fault.victims
        if cls == "use_after_free":
            assert fault.detail["position"] <= event.position < fault.detail["position"] + 16
        else:
            assert event.position == fault.detail["position"]
        got = set(event.reasons)
        assert (got == reasons if how == "==" else reasons <= got), (cls, event.reasons)


def test_demo_cli_writes_json(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert demo_main(["--device", "cpu", "--steps", "60", "--seed", "1", "--json", str(path), "--no-progress"]) == 0
    data = json.loads(path.read_text())
    assert data["steps"] == 60
    assert data["false_positives"] == 0
    assert data["kernels_s"] >= 0
    assert len(data["violations_per_step"]) == 60 and sum(data["violations_per_step"]) > 0
    # a fault every 10 steps from step 10, each counted under its class; the run hashes ALL bytes, so
    # each is reported, at its step or later
    log = data["fault_log"]
    assert [fault["step"] for fault in log] == [10, 20, 30, 40, 50]
    assert all(fault["detected_step"] is not None and fault["detected_step"] >= fault["step"] for fault in log)
    assert data["hash_mode"] == "ALL"
    assert set(data["faults"]) <= set(FAULT_CLASSES)
    for cls, row in data["faults"].items():
        injected = sum(fault["class"] == cls for fault in log)
        assert (row["injected"], row["detected"], row["in_flight"]) == (injected, injected, 0), cls
    assert set(data["not_injectable"]) == set(FAULT_CLASSES) - set(data["faults"])
    out = capsys.readouterr().out
    assert "false positives" in out and "fault class" in out
    # the JSON alone says how the run was made: its settings rebuild the run's configuration
    settings = dict(data["settings"])
    injection = {k: settings.pop(k) for k in ("faults", "fault_every", "fault_start", "bitflip_offset")}
    assert injection == {"faults": list(FAULT_CLASSES), "fault_every": 10, "fault_start": 10, "bitflip_offset": None}
    rebuilt = SimConfig(**{k: (kc.HashMode[v] if k == "hash_mode" else tuple(v) if isinstance(v, list) else v)
                           for k, v in settings.items()})
    assert rebuilt.steps == 60 and rebuilt.seed == 1 and rebuilt.hash_mode == kc.HashMode.ALL
    assert run(rebuilt, injection["faults"], fault_every=10).to_json()["fault_log"] == log


def test_demo_default_run_catches_every_class_partial_mode_can_see():
    """The simulator's defaults (PARTIAL hashing): every fault of every class caught but the bit
    flips past the 16 bytes PARTIAL reads, which it cannot see."""
    result = run(SimConfig(), FAULT_CLASSES)
    assert result.false_positives == []
    assert set(result.per_class()) == set(FAULT_CLASSES)
    for fault in result.faults:
        assert fault.detected or (fault.cls in ("kv_bitflip", "offload_bitflip") and fault.detail["source_offset"] >= 16)


def test_demo_cli_writes_png_chart(tmp_path):
    """A default-length run, long enough to inject a fault of every class, each given a colour."""
    pytest.importorskip("matplotlib")
    path, summary = tmp_path / "demo.png", tmp_path / "demo.json"
    assert demo_main(["--device", "cpu", "--seed", "2", "--chart", str(path), "--json", str(summary),
                      "--no-progress"]) == 0
    assert {fault["class"] for fault in json.loads(summary.read_text())["fault_log"]} == set(FAULT_CLASSES)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_chart_names_each_fault_class_once_and_its_median_or_a_dash(tmp_path, monkeypatch):
    """The legend names each class injected once, however many of its faults there were, each in a
    colour of its own that its detection-rate bar shares; a class never caught shows a dash for its
    median steps to detection."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from kvcanary_cupy.sim.chart import write_chart

    result = run(SimConfig(steps=40, hash_mode=kc.HashMode.NONE, device="cpu"), ["kv_bitflip", "token_swap"])
    assert [fault.cls for fault in result.faults] == ["kv_bitflip", "token_swap", "kv_bitflip"]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert write_chart(result, str(tmp_path / "run.png"))
    top, bottom = figures[0].axes
    assert sorted(top.get_legend_handles_labels()[1]) == ["kv_bitflip", "token_swap", "violations reported"]
    colours = {label: to_hex(handle.get_color()) for handle, label in zip(*top.get_legend_handles_labels())
               if label != "violations reported"}
    assert len(set(colours.values())) == 2
    assert [to_hex(bar.get_facecolor()) for bar in bottom.patches] == [colours[name] for name in result.per_class()]
    medians = {name: row["median_steps_to_detection"] for name, row in result.per_class().items()}
    assert medians["kv_bitflip"] is None and medians["token_swap"] is not None
    assert [text.get_text() for text in bottom.texts] == ["-", f"median {medians['token_swap']:g} steps"]
    monkeypatch.undo()
    plt.close(figures[0])


def test_the_demo_help_states_the_smallest_pool_the_defaults_take(capsys):
    """``--help`` gives the smallest ``--pool-slots`` at the default page size and request length:
    the demo takes that pool and refuses one slot fewer, saying the same number."""
    with pytest.raises(SystemExit):
        demo_main(["--help"])
    said = re.search(r"beside\s+the\s+padding\s+page:\s+(\d+)\s+with\s+pages\s+of\s+16", capsys.readouterr().out)
    assert said, "the help names the smallest pool"
    smallest = int(said.group(1))
    assert SimConfig(pool_slots=smallest).pool_slots == smallest
    with pytest.raises(ValueError, match=rf"^kv-canary: pool_slots must be >= {smallest} "):
        SimConfig(pool_slots=smallest - 1)


@pytest.mark.parametrize("terminal,argv,shown", [(True, [], True), (True, ["--no-progress"], False),
                                                  (False, [], False)])
def test_demo_shows_progress_only_on_a_terminal_unless_told_not_to(terminal, argv, shown, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    assert demo_main(["--device", "cpu", "--steps", "3", "--faults", "none", *argv]) == 0
    err = capsys.readouterr().err
    assert ("readying the kernels" in err) is shown
    assert ("3/3 steps" in err) is shown


def test_demo_cli_on_cuda_without_cupy_says_why(capsys):
    """Asked for a GPU it cannot use, the demo says why in one line and exits 2 (no traceback)."""
    from kvcanary_cupy._dlpack import cupy_module

    if cupy_module() is not None:
        pytest.skip("CuPy is installed")
    assert demo_main(["--device", "cuda", "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kv-canary: ") and "cupy-cuda12x" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--page-size", "0"], "argument --page-size: must be >= 1, got 0"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--steps", "-1"], "argument --steps: must be >= 1, got -1"),
    (["--fault-every", "0"], "argument --fault-every: must be >= 1, got 0"),
    (["--max-running", "x"], "argument --max-running: must be an integer, got 'x'"),
    (["--pool-slots", "10"], "kv-canary: --pool-slots must be >= 528"),
    # past the canary's int32 capacities: refused before the engine allocates a pool of that size
    (["--pool-slots", "1000000000"], "kv-canary: pool_slot_count must be <= 715827882, as verify_capacity"),
    # each said with the options that set it
    (["--pool-slots", "1000000000"], "got 1000000000 (set by --pool-slots and --page-size)"),
    (["--max-running", "1000000000000"], "got 1000000000001 (set by --max-running)"),
    (["--max-running", "2147483640"], "got 2147483897 (set by --max-running and --speculative)"),
    (["--speculative", "100000000000"], "got 100000000001 (set by --speculative)"),
    (["--faults", ""], "argument --faults: a fault class name is empty in ''"),
    (["--faults", "kv_bitflip,,token_swap"], "argument --faults: a fault class name is empty in"),
    (["--faults", "nosuch"], "argument --faults: unknown fault class(es) ['nosuch']"),
    (["--faults", "all,token_swap"], "argument --faults: 'all' and 'none' stand alone, not among classes, got "
                                     "'all,token_swap'"),
    (["--faults", "kv_bitflip none"], "argument --faults: 'all' and 'none' stand alone"),
    (["--json", "/nonexistent-folder/run.json"], "argument --json: no folder '/nonexistent-folder'"),
    # a trailing separator names a file in a folder of that name: refused before the run, not after it
    (["--json", "/nonexistent-folder/"], "argument --json: no folder '/nonexistent-folder' to write"),
    (["--json", "/nonexistent-folder/."], "argument --json: no folder '/nonexistent-folder' to write"),
    (["--chart", "."], "argument --chart: cannot write '.'"),
    (["--host-slots", "-1"], "argument --host-slots: must be >= 0, got -1"),
    (["--offload-prob", "2"], "argument --offload-prob: must be within [0, 1], got 2"),
    (["--offload-prob", "x"], "argument --offload-prob: must be a number, got 'x'"),
    # offloads asked for with nowhere to offload to (the default chance is not asked for)
    (["--offload-prob", "0.5", "--host-slots", "0"],
     "kv-canary: --offload-prob needs a host tier (--host-slots > 0), got --offload-prob=0.5 with --host-slots=0"),
    (["--host-slots", "64"], "kv-canary: --host-slots must be 0 (no host tier) or more than a request's up to 512 "
                             "tokens, got 64"),
    (["--device", "gpu"], "argument --device: must be cpu, cuda or cuda:N, got 'gpu'"),
    (["--device", ""], "argument --device: must be cpu, cuda or cuda:N, got ''"),
    (["--json", ""], "argument --json: must name a file, got ''"),
    (["--chart", "/tmp/demo.txt"], "argument --chart: must end in .png (the chart is a PNG), got '/tmp/demo.txt'"),
    (["--speculative", "2", "--static-decode"],
     "kv-canary: --speculative and --static-decode are not run together, got --speculative=2 with --static-decode"),
])
def test_demo_cli_refuses_a_shape_it_cannot_run(argv, message, capsys):
    """A demo option that would crash the simulator, or let it report a clean pass of nothing, is
    refused in one line with exit status 2."""
    try:
        status = demo_main(["--device", "cpu", "--no-progress", *argv])
    except SystemExit as exit_:  # argparse's refusal
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and "Traceback" not in err


def test_demo_cli_exit_status_tells_a_failed_run(tmp_path, capsys, monkeypatch):
    """0 for a clean run; 1 for a false positive; with --strict 1 also for a fault left unreported
    though its requests were done with; JSON to standard output with ``--json -``."""
    from kvcanary_cupy.sim import runner

    argv = ["--device", "cpu", "--no-progress", "--steps", "40", "--hash-mode", "none", "--faults", "kv_bitflip"]
    assert demo_main([*argv, "--json", "-"]) == 0  # unseen without hashing, yet no false positive
    out, err = capsys.readouterr()
    log = json.loads(out)["fault_log"]
    assert log and all(fault["detected_step"] is None for fault in log) and "fault class" in err
    assert demo_main([*argv, "--strict"]) == 1
    assert re.search(r"kv-canary: demo failed: 0 false positive\(s\), [1-9]\d* missed fault\(s\)", capsys.readouterr().err)
    if pathlib.Path("/dev/full").exists():  # a write that fails after the run: said in one line, status 2
        assert demo_main([*argv, "--json", "/dev/full"]) == 2
        assert "kv-canary: cannot write /dev/full: " in capsys.readouterr().err
    explain_nothing = lambda events, faults, step: (list(events), set())  # noqa: E731
    monkeypatch.setattr(runner, "_attribute", explain_nothing)
    assert demo_main(["--device", "cpu", "--no-progress", "--steps", "30", "--faults", "kv_bitflip",
                      "--hash-mode", "all"]) == 1
    assert "kv-canary: demo failed: " in capsys.readouterr().err


@pytest.mark.parametrize("entry", ["demo", "python -m kvcanary_cupy demo"])
def test_demo_help_states_each_exit_status(entry, capsys):
    """Both ways in to the demo (its own parser, the package's ``demo`` command) print the exit
    statuses ``run_from_args`` returns, once, after the options."""
    from kvcanary_cupy.__main__ import main as package_main

    with pytest.raises(SystemExit) as done:
        demo_main(["--help"]) if entry == "demo" else package_main(["demo", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("Exit status:") == 1 and text.index("--strict") < text.index("Exit status:")
    for status in ("0 a clean run", "1 a false positive", "2 a refused option"):
        assert status in text


def test_demo_cli_strict_fails_on_a_class_named_and_never_caught(capsys):
    """--strict fails a run that never caught a class named in --faults, whatever kept it from being
    injected, and says why on standard error: such a run has not shown that the canary catches it.
    Classes only implied (the default, or 'all') are injected where the engine's shape can host them
    and demanded by none."""
    one_request = ["--device", "cpu", "--no-progress", "--steps", "1", "--max-running", "1"]
    assert demo_main([*one_request, "--faults", "slot_alias,token_swap", "--strict"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kv-canary: demo failed: 0 false positive(s), 0 missed fault(s); ")
    assert "; slot_alias asked for, never caught (not injected: needs two running requests (max_running >= 2))" in err
    assert ("; token_swap asked for, never caught (not injected: its turn did not come (one fault every 10 steps "
            "from step 10))") in err
    assert demo_main([*one_request, "--faults", "slot_alias"]) == 0  # not strict: the summary says why
    assert "slot_alias         not injected: needs two running requests" in capsys.readouterr().out
    for implied in ([], ["--faults", "all"], ["--faults", "none"]):
        assert demo_main([*one_request, "--host-slots", "0", "--strict", *implied]) == 0, implied
        assert "demo failed" not in capsys.readouterr().err


def test_demo_cli_strict_fails_on_a_class_named_whose_faults_were_none_caught(monkeypatch, capsys):
    """A named class injected but never caught fails --strict too: its faults still in flight when
    the run ended, or without effect, show nothing of the canary either. One fault of it caught is
    enough."""
    from kvcanary_cupy.sim import runner
    from kvcanary_cupy.sim.faults import Fault

    fates = {"in flight": dict(closed=False), "no effect": dict(closed=True, took_effect=False),
             "caught": dict(detected_step=12, closed=True)}
    faults = []

    def fake_run(config, classes, **kwargs):
        return runner.SimResult(config, config.steps, 1, 1, 1, 0, 0, 0, 1.0, 0.5, list(faults), [],
                                [0] * config.steps)

    monkeypatch.setattr(runner, "run", fake_run)
    argv = ["--device", "cpu", "--no-progress", "--steps", "20", "--faults", "offload_bitflip,use_after_free"]
    faults[:] = [Fault(0, "offload_bitflip", 10, {1}, {5}, {}, **fates["in flight"]),
                 Fault(1, "use_after_free", 11, {2}, {6}, {}, **fates["no effect"])]
    assert demo_main(argv) == 0
    assert demo_main([*argv, "--strict"]) == 1
    err = capsys.readouterr().err
    assert ("0 missed fault(s); offload_bitflip asked for, never caught (1 fault injected, none caught: 1 still in "
            "flight at the end); use_after_free asked for, never caught (1 fault injected, none caught: 1 without "
            "effect)") in err
    faults.extend([Fault(2, "offload_bitflip", 12, {3}, {7}, {}, **fates["caught"]),
                   Fault(3, "use_after_free", 13, {4}, {8}, {}, **fates["caught"])])
    assert demo_main([*argv, "--strict"]) == 0
    assert "demo failed" not in capsys.readouterr().err


def test_demo_faults_do_not_stack_on_a_request_and_undetected_ones_in_flight_are_not_misses():
    """A fault is injected only into requests no unreported fault has hurt (a second would take the
    first's report), so even a fault every step is each caught; one whose request still runs when
    the run ends (an offloaded one, say, not yet loaded back) is in flight, not missed."""
    result = run(SimConfig(steps=120, max_running=4, hash_mode=kc.HashMode.ALL), FAULT_CLASSES, fault_every=1)
    assert result.false_positives == [] and len(result.faults) > 60
    # a batch fault beside a state fault still unreported a step or more (a freed page not yet reused)
    batch_faults = run(SimConfig(steps=120, max_running=2, hash_mode=kc.HashMode.ALL),
                       ["use_after_free", "stale_position", "token_swap"], fault_every=1)
    for faults in (result.faults, batch_faults.faults):
        for index, fault in enumerate(faults):  # each earlier fault on its requests reported before it
            for earlier in faults[:index]:
                if earlier.victims & fault.victims:
                    assert earlier.detected_step is not None and earlier.detected_step < fault.step, (earlier, fault)
    assert batch_faults.missed == [] and batch_faults.false_positives == []
    assert result.missed == []
    in_flight = [fault for fault in result.faults if not fault.detected]
    assert all(not fault.closed for fault in in_flight)
    assert sum(row["in_flight"] for row in result.per_class().values()) == len(in_flight)
    assert all(fault.detected for fault in result.faults if fault.step < 110)


def test_sim_config_refuses_what_cannot_run():
    with pytest.raises(ValueError, match=r"^kv-canary: static_decode needs poll_every == 1, got 2$"):
        SimConfig(static_decode=True, poll_every=2)
    with pytest.raises(ValueError, match=r"^kv-canary: max_running must be an integer >= 1, got 0$"):
        SimConfig(max_running=0)
    with pytest.raises(ValueError, match=r"^kv-canary: steps must be an integer >= 1, got 2\.5$"):
        SimConfig(steps=2.5)
    with pytest.raises(ValueError, match=r"^kv-canary: max_running must be an integer >= 1, got True$"):
        SimConfig(max_running=True)
    with pytest.raises(ValueError, match=r"^kv-canary: unknown fault class\(es\) \['kv_bitflop'\]; known: kv_bitflip, "):
        run(SimConfig(steps=1, device="cpu"), ["kv_bitflop"])
    with pytest.raises(ValueError, match=r"^kv-canary: pool_slots must be >= 288 .*got 100$"):
        SimConfig(pool_slots=100, max_len=256, page_size=32)
    with pytest.raises(ValueError, match=r"^kv-canary: host_slots must be 0 \(no host tier\) or more than a request's "
                                         r"up to 256 tokens, got 256$"):
        SimConfig(host_slots=256, max_len=256)
    with pytest.raises(ValueError, match=r"^kv-canary: offload_prob must be within \[0, 1\], got 1.5$"):
        SimConfig(offload_prob=1.5)
    # settings only the Python API gives: refused with the package's words, not NumPy's
    for setting, words in [(dict(chunk_tokens=0), r"chunk_tokens must be an integer >= 1, got 0$"),
                           (dict(layers=0), r"layers must be an integer >= 1, got 0$"),
                           (dict(vocab=1), r"vocab must be an integer >= 2, got 1$"),
                           (dict(templates=-1), r"templates must be an integer >= 0, got -1$"),
                           (dict(template_len=-3), r"template_len must be an integer >= 0, got -3$"),
                           (dict(share_prob=1.2), r"share_prob must be within \[0, 1\], got 1.2$"),
                           (dict(arrivals_per_step=-1.0), r"arrivals_per_step must be >= 0, got -1.0$"),
                           (dict(prompt_len=(0, 4)), r"prompt_len must be a pair \(low, high\) of integers with "
                                                     r"1 <= low <= high, got \(0, 4\)$"),
                           (dict(output_len=(9, 3)), r"output_len must be a pair .* got \(9, 3\)$"),
                           (dict(output_len=[4, 2.5]), r"output_len must be a pair .* got \[4, 2.5\]$"),
                           (dict(output_len=(2, 4, 8)), r"output_len must be a pair .* got \(2, 4, 8\)$"),
                           (dict(prompt_len=16), r"prompt_len must be a pair .* got 16$"),
                           (dict(max_len=65), r"max_len must be >= template_len \+ 2 = 66 where requests share "
                                              r"templates, got 65 \(templates=0 shares none\)$")]:
        with pytest.raises(ValueError, match="^kv-canary: " + words):
            SimConfig(**setting)
    assert SimConfig(max_len=65, templates=0).max_len == SimConfig(max_len=66).max_len - 1


def test_a_prompt_longer_than_max_len_is_cut_to_leave_a_token_to_decode():
    """Requests are drawn at most ``max_len`` tokens long, of which the prompt leaves at least one to
    decode, a shared template's whole; where prompts may be longer, the run finds its faults and
    nothing else."""
    from kvcanary_cupy.sim.engine import Engine

    config = SimConfig(steps=60, max_len=160, prompt_len=(120, 220), pool_slots=2048, hash_mode=kc.HashMode.ALL)
    engine = Engine(config)
    drawn = [engine._new_request() for _ in range(300)]
    assert all(r.prompt_len < r.total <= config.max_len for r in drawn)
    assert sum(r.prompt_len == config.max_len - 1 for r in drawn) > 100
    shared = [r for r in drawn if r.template >= 0]
    assert shared and all(r.prompt_len > config.template_len and
                          (r.tokens[:config.template_len] == engine.template_tokens[r.template]).all() for r in shared)
    result = run(config, list(FAULT_CLASSES))
    assert len(result.faults) >= 4 and result.missed == [] and result.false_positives == []


# What a run shows of the canary's findings: when each fault was caught and by which event, and how
# many rows each step's poll found.
_FINDINGS = ("fault_log", "violations_per_step", "verified_entries", "tokens", "false_positives", "faults")

STATIC_DECODE_CASES = [dict(hash_mode=kc.HashMode.ALL),
                       dict(hash_mode=kc.HashMode.PARTIAL, layout="mla", swa_window=24, seed=4)]


def _findings(result) -> dict:
    data = result.to_json()
    return {key: data[key] for key in _FINDINGS}


def test_batch_sizes_are_powers_of_two_up_to_max_running():
    assert batch_sizes(1) == [1]
    assert batch_sizes(16) == [1, 2, 4, 8, 16]
    assert batch_sizes(12) == [1, 2, 4, 8, 12]


@pytest.mark.parametrize("kwargs", STATIC_DECODE_CASES, ids=["all-paged", "partial-mla-swa"])
def test_static_decode_finds_what_eager_decode_finds(kwargs):
    """Decode forwards padded to a batch size and run through static forwards over arrays refilled in
    place catch every fault at the same step, by the same event, as the same forwards run eagerly,
    with no false positive; prefill and decode take turns in both runs."""
    eager = run(SimConfig(steps=200, split_batches=True, **kwargs), FAULT_CLASSES)
    static = run(SimConfig(steps=200, static_decode=True, **kwargs), FAULT_CLASSES)
    assert _findings(static) == _findings(eager)
    assert static.false_positives == [] and len(static.faults) >= 15
    assert all(fault.detected for fault in static.faults if fault.cls not in ("kv_bitflip", "offload_bitflip")
               or kwargs["hash_mode"] == kc.HashMode.ALL)
    assert static.decode_forwards == eager.decode_forwards == static.static_decode["forwards"] > 50
    assert len(static.static_decode["batch_sizes_used"]) > 1, "padding to several sizes must happen"
    assert static.static_decode["graph_replays"] == 0  # no graphs on the CPU


def _admitted_steps(engine, count: int):
    """Steps 0 to ``count - 1`` of ``engine``, each begun as the runner begins one (its index set,
    its arrivals admitted); the caller schedules and advances it."""
    for step in range(count):
        engine.step_index = step
        engine.admit_arrivals()
        yield step


# A prefill budget small beside the prompts: some steps leave a waiting prefill out entirely.
_TIGHT_BUDGET = dict(seed=5, chunk_tokens=48, prompt_len=(30, 120))


def test_split_batches_alternate_prefill_and_decode():
    """With split batches no forward mixes a prefill chunk with a decode, and while both have work
    they take turns."""
    from kvcanary_cupy.sim.engine import Engine

    engine = Engine(SimConfig(split_batches=True, seed=3))
    previous, turns = None, 0
    for step in _admitted_steps(engine, 80):
        waiting = [r for r in engine.running if r.remaining > 0]
        both = any(r.decoding for r in waiting) and any(not r.decoding for r in waiting)
        batch = engine.schedule()
        decoding = {r.decoding for r in batch.requests}
        assert len(decoding) == 1
        decoded = decoding.pop()
        if both:
            assert decoded != previous, f"step {step}: two {'decode' if decoded else 'prefill'} forwards in a row"
            turns += 1
        previous = decoded
        engine.advance(batch)
    assert turns > 10


def test_every_scheduled_request_writes_a_token_and_prefills_keep_to_the_budget():
    """A forward carries only requests with new tokens: a prefill that the step's token budget
    leaves nothing for waits for the next step (its prefix is not verified before it writes), and
    the prefill chunks of one forward stay within the budget."""
    from kvcanary_cupy.sim.engine import Engine

    config = SimConfig(**_TIGHT_BUDGET)
    engine = Engine(config)
    squeezed = 0
    for step in _admitted_steps(engine, 60):
        prefilling = [r for r in engine.running if r.remaining > 0 and not r.decoding]
        batch = engine.schedule()
        assert (batch.extend_lens > 0).all(), f"step {step}"
        prefills = [n for r, n in zip(batch.requests, batch.extend_lens.tolist()) if not r.decoding]
        assert sum(prefills) <= config.chunk_tokens
        squeezed += len(prefills) < len(prefilling)
        engine.advance(batch)
    assert squeezed > 10  # steps where the budget left a prefill out


def test_state_faults_hurt_a_decoding_request_while_one_can_be_hurt():
    """The requests a state fault may hurt: the decoding ones among those with tokens cached and
    enough work left, while there are any; the prefilling ones only when none decodes."""
    from kvcanary_cupy.sim.engine import Engine
    from kvcanary_cupy.sim.faults import _MIN_REMAINING, FaultInjector

    engine = Engine(SimConfig(**_TIGHT_BUDGET))
    injector = FaultInjector(engine, ["kv_bitflip"])
    beside_prefills = prefills_alone = 0
    for step in _admitted_steps(engine, 60):
        eligible = [r for r in engine.running if r.remaining >= _MIN_REMAINING and r.seq_len > 0]
        decoding = [r for r in eligible if r.decoding]
        victims = injector._victims()
        if decoding:
            assert victims == decoding, f"step {step}"
            beside_prefills += len(decoding) < len(eligible)
        else:
            assert victims == eligible, f"step {step}"
            prefills_alone += bool(eligible)
        engine.advance(engine.schedule())
    assert beside_prefills and prefills_alone


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("kwargs", [dict(speculative=3), dict(speculative=1, swa_window=24, layout="mla", seed=2)],
                         ids=["3-drafts-paged", "1-draft-mla-swa"])
def test_speculative_decoding_finds_every_fault_and_nothing_else(device, kwargs):
    """Decoding requests verify drafted tokens and keep those before the first miss; the canary
    fingerprints only what they keep. Every fault is found, nothing else is reported, and the
    drafts were both accepted and rejected."""
    result = run(SimConfig(steps=300, hash_mode=kc.HashMode.ALL, device=device, **kwargs), FAULT_CLASSES)
    assert result.false_positives == []
    assert set(result.per_class()) == set(FAULT_CLASSES)
    assert all(fault.detected for fault in result.faults)
    spec = result.to_json()["speculative"]
    assert spec["drafts"] == kwargs["speculative"] and 0 < spec["accepted"] < spec["verified"]


def test_speculative_decoding_refuses_static_decode():
    with pytest.raises(ValueError, match="^kv-canary: speculative and static_decode are not run together"):
        SimConfig(speculative=2, static_decode=True)


def test_demo_cli_static_decode(capsys):
    assert demo_main(["--device", "cpu", "--steps", "60", "--static-decode", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "static forwards of batch sizes" in out and "false positives           0" in out


@requires_gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager-launches"])
@pytest.mark.parametrize("kwargs", STATIC_DECODE_CASES, ids=["all-paged", "partial-mla-swa"])
def test_static_decode_on_the_gpu_finds_what_the_cpu_finds(kwargs, graphs):
    """On a GPU, decode forwards whose canary work is captured in CUDA graphs once per batch size and
    replayed (or launched as packed launches) find exactly what the CPU backend finds in the same
    run, fault by fault and step by step."""
    cpu = run(SimConfig(steps=200, static_decode=True, **kwargs), FAULT_CLASSES)
    gpu = run(SimConfig(steps=200, static_decode=True, device="cuda", **kwargs), FAULT_CLASSES, graphs=graphs)
    assert _findings(gpu) == _findings(cpu)
    replays = gpu.static_decode["graph_replays"]
    if graphs:
        # every forward but the first of each size is a replay
        assert replays == gpu.static_decode["forwards"] - len(gpu.static_decode["batch_sizes_used"]) > 50
    else:
        assert replays == 0


def test_a_class_the_engine_cannot_host_does_not_hold_up_the_others():
    """With one running request no slot can alias another request's: slot_alias is reported as not
    injectable, and the classes after it in turn are still injected. Two running requests are
    enough to host it."""
    result = run(SimConfig(steps=120, max_running=1, hash_mode=kc.HashMode.ALL), FAULT_CLASSES)
    assert set(result.not_injectable) == {"slot_alias"}
    assert "max_running" in result.not_injectable["slot_alias"]
    assert {f.cls for f in result.faults} == set(FAULT_CLASSES) - {"slot_alias"}
    two = run(SimConfig(steps=120, max_running=2, hash_mode=kc.HashMode.ALL), ["slot_alias"])
    assert not two.not_injectable and {f.cls for f in two.faults} == {"slot_alias"}
    assert result.false_positives == []
    assert "slot_alias         not injected" in result.summary()
    assert result.to_json()["not_injectable"] == result.not_injectable


def test_every_class_asked_for_is_injected_or_says_why_not():
    """Pages so large that one request runs at a time: slot_alias waits for a second request that
    never comes, and the classes after it wait behind it; a run too short for every turn says so."""
    crowded = run(SimConfig(steps=100, page_size=513, pool_slots=1026, hash_mode=kc.HashMode.ALL), FAULT_CLASSES)
    assert [f.cls for f in crowded.faults] == ["kv_bitflip"]
    assert crowded.not_injectable["slot_alias"] == ("its turn came, but the engine never offered it a place "
                                                    "(e.g. too few requests running)")
    assert all(crowded.not_injectable[cls] == "its turn did not come: slot_alias waited for a place before it"
               for cls in FAULT_CLASSES[2:])
    short = run(SimConfig(steps=25, hash_mode=kc.HashMode.ALL), FAULT_CLASSES)
    assert len(short.faults) + len(short.not_injectable) == len(FAULT_CLASSES)
    assert "its turn did not come (one fault every 10 steps from step 10)" in short.summary()


@pytest.mark.parametrize("kwargs", [dict(swa_window=64), dict(swa_window=32, split_batches=True)],
                         ids=["swa64", "swa32-split"])
def test_every_fault_class_with_an_swa_group_and_no_false_positive(kwargs):
    """Every class injected in turn into an engine with a sliding-window group: every event a
    poll reports is explained by a fault (a use-after-free page retaken for another request moves
    the victim's SWA slots under its reads)."""
    result = run(SimConfig(steps=300, device="cpu", **kwargs), FAULT_CLASSES)
    assert result.false_positives == []
    assert sum(f.detected for f in result.faults) >= 20


def test_static_decode_with_an_swa_group_as_replays_and_no_false_positive(monkeypatch):
    """The static decode forwards as CUDA-graph replays leave them, with no host log (their runs
    not logged): poll matches their rows against the static forwards, and every event is still
    explained by a fault."""
    from kvcanary_cupy import session

    monkeypatch.setattr(session.StaticForward, "_log", lambda *args, **kwargs: None)
    result = run(SimConfig(steps=300, device="cpu", swa_window=64, static_decode=True), FAULT_CLASSES)
    assert result.false_positives == []
    assert sum(f.detected for f in result.faults) >= 20


# --- the host tier ---------------------------------------------------------------------------------
HOST_TIER_CASES = [dict(hash_mode=kc.HashMode.ALL), dict(hash_mode=kc.HashMode.ALL, layout="interleaved", seed=3),
                   dict(hash_mode=kc.HashMode.PARTIAL, layout="mla", swa_window=24, seed=5),
                   dict(hash_mode=kc.HashMode.ALL, layout="per_layer", static_decode=True, swa_window=32, seed=7)]
HOST_TIER_IDS = ["all-paged", "all-interleaved", "partial-mla-swa", "all-per-layer-static-swa"]


@pytest.mark.parametrize("kwargs", HOST_TIER_CASES, ids=HOST_TIER_IDS)
def test_offloaded_requests_come_back_clean(kwargs):
    """Requests offloaded to the host tier often and loaded back into other slots (their SWA
    slots too), and evicted prefixes kept there and loaded back for a later request, verify clean
    at every forward after: their records came back with their KV."""
    result = run(SimConfig(steps=240, pool_slots=3072, offload_prob=0.3, evict_prob=0.3, **kwargs), [])
    tier = result.host_tier
    assert tier["offloads"] >= 30 and tier["offloads"] - tier["reloads"] <= 16, tier
    assert tier["prefix_stores"] >= tier["prefix_loads"] >= 1, tier
    assert tier["kv_copy_ms"] > 0 and tier["records_copy_ms"] > 0, tier
    assert sum(result.violations_per_step) == 0 and result.false_positives == []
    assert result.requests_finished > 10


def test_reloaded_slots_without_their_records_are_reported(monkeypatch):
    """The control: KV loaded back without its records is reported (the slots hold what their
    previous tenants left), so the clean runs above owe their silence to the records carried."""
    monkeypatch.setattr(kc.Canary, "copy_records", lambda self, **kwargs: None)
    result = run(SimConfig(steps=120, pool_slots=3072, offload_prob=0.3, hash_mode=kc.HashMode.ALL), [])
    assert result.host_tier["reloads"] > 5
    assert len(result.false_positives) > 0


def test_offload_bitflip_is_caught_when_the_request_is_back():
    """A bit flipped in host memory while its request is away is reported at the request's first
    forward after the reload, at the flipped token's position; a request that is never reloaded
    (the run ends first) holds the only undetected faults."""
    result = run(SimConfig(steps=200, hash_mode=kc.HashMode.ALL), ["offload_bitflip"], fault_every=6)
    faults = result.faults
    assert len(faults) >= 25
    for fault in faults:
        if fault.detected:
            assert fault.latency == result.config.offload_steps
            assert fault.first_event.position == fault.detail["position"]
            assert "REAL_KV_HASH" in fault.first_event.reasons
        else:
            assert fault.step > result.config.steps - result.config.offload_steps - 2
    assert result.false_positives == []


def test_demo_cli_host_tier(capsys):
    assert demo_main(["--device", "cpu", "--steps", "60", "--no-progress"]) == 0
    assert "host tier of 2048 slots:" in capsys.readouterr().out
    assert demo_main(["--device", "cpu", "--steps", "60", "--offload-prob", "0", "--faults", "none", "--no-progress"]) == 0
    assert "0 requests offloaded, 0 loaded back" in capsys.readouterr().out
    assert demo_main(["--device", "cpu", "--steps", "60", "--host-slots", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "host tier of" not in out and "offload_bitflip    not injected: needs a host tier (host_slots > 0)" in out


@requires_gpu
@pytest.mark.parametrize("kwargs", HOST_TIER_CASES, ids=HOST_TIER_IDS)
def test_host_tier_on_the_gpu_finds_what_the_cpu_finds(kwargs):
    """The serving pool on a GPU, the host tier in host memory: records cross between them, and the
    run finds exactly what the same run on the CPU finds, fault by fault and step by step."""
    config = dict(steps=200, offload_prob=0.2, evict_prob=0.3, **kwargs)
    cpu = run(SimConfig(**config), FAULT_CLASSES)
    gpu = run(SimConfig(device="cuda", **config), FAULT_CLASSES)
    assert _findings(gpu) == _findings(cpu)
    moves = {name: value for name, value in gpu.host_tier.items() if not name.endswith("_ms")}  # not the times
    assert moves == {name: cpu.host_tier[name] for name in moves} and moves["offloads"] >= 20
    assert gpu.false_positives == []


def test_a_prefix_published_by_a_corrupt_request_is_not_shared():
    """A request reloaded with a bit flipped in its prefix publishes that prefix in the forward
    that finds it corrupt; aborting the request drops the cached prefix too, so no later request
    shares the corruption (before, this run reported 12 rows of a later request as unexplained)."""
    result = run(SimConfig(steps=200, offload_prob=0.2, evict_prob=0.3, hash_mode=kc.HashMode.ALL, layout="per_layer",
                           static_decode=True, swa_window=32, seed=7), FAULT_CLASSES)
    assert any(f.cls == "offload_bitflip" and f.detail["position"] < result.config.template_len for f in result.faults)
    assert result.false_positives == []
    assert all(fault.detected for fault in result.faults)


@pytest.mark.parametrize("kwargs", [
    dict(seed=5067, steps=70, max_running=8, host_slots=0, hash_mode=kc.HashMode.ALL),
    dict(seed=798, steps=110, max_running=5, swa_window=64, hash_mode=kc.HashMode.NONE),
], ids=["full", "swa"])
def test_a_request_that_shares_a_prefix_corrupted_before_it_was_reported_is_a_victim(kwargs):
    """Without expected-token checks a stale_position in a prompt's prefix is reported only when the
    slot is next read, after its request published the prefix; a request admitted onto it in
    between reads the stale record too, and goes on reading it after the fault's victim is aborted.
    It is the fault's victim as well, not a false positive (before, these runs reported 5 and 2)."""
    result = run(SimConfig(expected_checks=False, layout="mla", page_size=1,
                           pool_slots=1024, speculative=1, **kwargs), FAULT_CLASSES, fault_every=1)
    shared = [fault for fault in result.faults if len(fault.victims) > 1]
    assert shared and all(fault.cls == "stale_position" and fault.detected for fault in shared)
    assert result.false_positives == []


def test_the_engine_keeps_its_books_through_offloads_reloads_and_aborts():
    """Pages, reservations and host slots add up at every step of a run that offloads often,
    keeps and loads prefixes, and aborts requests both running and offloaded, in a pool small
    enough that admissions wait for room (a prefix loaded back from the tier takes pages too)."""
    from kvcanary_cupy.sim.engine import Engine

    engine = Engine(SimConfig(seed=1, offload_prob=0.5, evict_prob=0.3, pool_slots=1536, hash_mode=kc.HashMode.ALL))
    tier = engine.tier
    aborted_away = 0
    for step in range(150):
        engine.step_index = step
        engine.tier_turn()
        engine.admit_arrivals()
        batch = engine.schedule()
        forward = engine.forward_batch(batch)
        engine.canary.before_forward(forward)
        engine.model_forward(forward, batch)
        engine.canary.after_forward(forward)
        engine.advance(batch)
        if step % 7 == 3 and engine.offloaded:
            aborted_away += engine.abort(next(iter(engine.offloaded)))
        elif step % 11 == 5 and engine.running:
            engine.abort(engine.running[0].rid)
        requests = engine.running + [entry.request for entry in engine.offloaded.values()]
        held = {page for request in requests for page in request.pages}
        for pages in engine.prefix_cache.values():
            held.update(pages)
        assert len(held) + len(engine.free_pages) == engine.num_pages - 1  # page 0 is the padding page
        assert all(engine.page_ref[page] > 0 for page in held)
        assert engine.reserved_pages == sum(r.own_pages_needed - r.own_taken for r in requests)
        assert all(0 <= r.own_taken <= r.own_pages_needed for r in requests)  # no page beyond its reservation
        assert engine.reserved_pages <= len(engine.free_pages)
        kept = [entry.host_slots for entry in engine.offloaded.values()] + list(engine.host_prefixes.values())
        used = np.concatenate(kept) if kept else np.zeros(0, np.int64)
        assert len(set(used.tolist())) == used.size and used.size + len(tier.free) == tier.num_slots - 1
        assert len(engine.running) + len(engine.offloaded) <= engine.config.max_running
    assert engine.canary.poll().total == 0
    assert aborted_away > 3 and tier.reloads > 20 and tier.prefix_loads >= 1, (aborted_away, tier.to_json())


@pytest.mark.parametrize("mode", ["NONE", "ALL"])
def test_a_use_after_free_is_reported_in_the_step_its_page_is_handed_out_again(mode):
    """A use_after_free's steps from injection to report are the allocator's (docs/detection.md):
    in every run the canary reports it in the very step its freed page goes to a new tenant, as
    the page's first writes land before that forward's verify. Over seeds whose allocator takes
    from 0 to 5 steps to hand a page out again."""
    waits = collections.Counter()
    for seed in range(24):
        result = run(SimConfig(steps=110, seed=seed, hash_mode=MODES[mode]), ["use_after_free"], fault_every=10)
        assert result.false_positives == [] and result.missed == []
        for fault in result.faults:
            assert fault.took_effect == (fault.reused_step is not None)
            if fault.took_effect:
                assert fault.detected_step == fault.reused_step, (seed, fault.step, fault.reused_step, fault.detected_step)
                waits[fault.reused_step - fault.step] += 1
    assert waits[0] and waits[1] and max(waits) >= 4, waits


def test_a_use_after_free_whose_page_is_not_handed_out_again_is_not_a_miss(capsys):
    """With one request running, a page freed under it may not be handed out again before the request
    is done: nothing it read changed, so the canary had nothing to catch. Such a fault is counted
    apart (without effect), not as missed, and ``--strict`` does not fail on it; every fault that
    did take effect is caught."""
    result = run(SimConfig(steps=300, max_running=1, hash_mode=kc.HashMode.ALL), ["use_after_free"])
    inert = [f for f in result.faults if not f.took_effect]
    assert inert and all(not f.detected and f.closed and f.reused_step is None for f in inert)
    assert all(f.took_effect for f in result.faults if f.detected)
    assert result.missed == [] and result.false_positives == []
    assert all(f.detected for f in result.faults if f.took_effect and f.closed)
    assert result.per_class()["use_after_free"]["no_effect"] == len(inert)
    assert "without effect" in result.summary()
    assert [entry["took_effect"] for entry in result.to_json()["fault_log"]] == [f.took_effect for f in result.faults]
    assert demo_main(["--device", "cpu", "--no-progress", "--steps", "300", "--max-running", "1", "--faults",
                      "use_after_free", "--hash-mode", "all", "--strict"]) == 0
    assert "missed" not in capsys.readouterr().err


def test_demo_cli_writes_an_existing_file_in_a_folder_it_cannot_create_files_in(tmp_path, monkeypatch, capsys):
    """An existing writable file is written in place whatever its folder allows (``/dev/null`` or
    ``/dev/stdout`` for a user who cannot create files in ``/dev``); a new file needs its folder
    writable. The folder's permission is faked, as a root user may write anywhere."""
    import os

    from kvcanary_cupy.sim import cli

    existing = tmp_path / "run.json"
    existing.write_text("")
    real_access = os.access

    def access(path, mode):  # the folder read-only for this user, the file in it writable
        if os.path.abspath(path) == str(tmp_path) and mode & os.W_OK:
            return False
        return real_access(path, mode)

    monkeypatch.setattr(cli.os, "access", access)
    assert demo_main(["--device", "cpu", "--no-progress", "--steps", "3", "--json", str(existing)]) == 0
    assert json.loads(existing.read_text())["steps"] == 3
    with pytest.raises(SystemExit) as refused:
        demo_main(["--device", "cpu", "--no-progress", "--steps", "3", "--json", str(tmp_path / "new.json")])
    assert refused.value.code == 2
    assert f"argument --json: cannot write '{tmp_path / 'new.json'}'" in capsys.readouterr().err


@pytest.mark.parametrize("option, name", [("--json", "run.json"), ("--chart", "run.png")])
def test_demo_cli_refuses_an_output_path_it_cannot_open_before_the_run(tmp_path, capsys, option, name):
    """A path open() would refuse after the run (a name longer than the file system takes, a loop
    of links) is refused before it, with the reason, as a missing folder is."""
    pytest.importorskip("matplotlib")  # the chart's path is checked only where it can be drawn
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    for path, reason in ((tmp_path / ("x" * 300 + name), errno.ENAMETOOLONG), (tmp_path / "loop-a", errno.ELOOP)):
        with pytest.raises(SystemExit) as refused:
            demo_main(["--device", "cpu", "--no-progress", "--steps", "3", option, str(path)])
        assert refused.value.code == 2
        assert f"argument {option}: cannot write '{path}': {os.strerror(reason)}" in capsys.readouterr().err
    assert not any(tmp_path.glob("*.json")) and not any(tmp_path.glob("*.png"))


def test_demo_names_its_device_however_it_was_spelt(tmp_path, capsys):
    """``--device CPU`` runs on the CPU and is named cpu in the summary and the JSON; a GPU spelt in
    capitals is still a GPU whose kernels come from CuPy's cache."""
    from kvcanary_cupy.sim.runner import SimResult

    path = tmp_path / "demo.json"
    assert demo_main(["--device", " CPU", "--no-progress", "--steps", "3", "--json", str(path)]) == 0
    assert "device=cpu " in capsys.readouterr().out and json.loads(path.read_text())["device"] == "cpu"
    for device, cache in (("CUDA:0", "CuPy"), ("cuda", "CuPy"), ("CPU", "numba")):
        result = SimResult(SimConfig(device=device), 1, 0, 0, 0, 0, 0, 0, 1.0, 0.5, [], [], [0])
        assert f"then loaded from {cache}'s cache" in result.summary(), device


def test_demo_cli_out_of_memory_names_every_option_that_sizes_the_engine(monkeypatch, capsys):
    from kvcanary_cupy.sim import runner

    def too_large(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(runner, "run", too_large)
    assert demo_main(["--device", "cpu", "--no-progress", "--host-slots", "10000000000000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kv-canary: the simulated engine does not fit") and "--host-slots" in err


def test_demo_refuses_request_tables_larger_than_the_memory_it_may_have(tmp_path):
    """``--max-running`` sizes two int32 tables of ``max_len`` a row: past the memory the process may
    have (here an address-space limit) it is refused before anything is built, in one line naming
    the option, not after seconds spent on the free-row list and a CPython SystemError when that list
    cannot grow."""
    import subprocess
    import sys

    limit = 6 * 2**30
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({0}, {0})); "
            "from kvcanary_cupy.sim.cli import main; sys.exit(main(sys.argv[1:]))").format(limit)
    argv = ["--device", "cpu", "--no-progress", "--max-running", "200000000"]
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])})
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"kv-canary: req_to_token_pool_size must be <= {limit // (2 * 512 * 4)}, ")
    assert "(ulimit -v), got 200000001 (set by --max-running)" in done.stderr


def test_the_request_tables_bound_is_the_memory_they_take(monkeypatch):
    """The bound is what the tables take, not a size picked to be small: rows that fit exactly are built."""
    from kvcanary_cupy.sim import engine as sim_engine

    # a machine of 100 rows, whose smallest pool (528 slots of 544 bytes) fits in it too
    monkeypatch.setattr(sim_engine, "memory_limit", lambda: (100 * 2 * 512 * 4, "a machine of 100 rows"))
    assert sim_engine.Engine(SimConfig(max_running=99, pool_slots=528, host_slots=0)).table_host.shape == (100, 512)
    with pytest.raises(ValueError, match=r"^kv-canary: req_to_token_pool_size must be <= 100, .* must fit in a machine "
                                         r"of 100 rows, got 101$"):
        sim_engine.Engine(SimConfig(max_running=100, pool_slots=528, host_slots=0))


@pytest.mark.parametrize("layout", ["paged", "per_layer", "interleaved", "mla"])
@pytest.mark.parametrize("swa_window", [0, 64])
def test_the_bytes_a_pool_slot_takes_are_those_the_pool_and_the_host_tier_allocate(layout, swa_window):
    """``slot_bytes`` (what the memory bounds of ``--pool-slots`` and ``--host-slots`` count) is what a
    slot of the engine's pool and of its host tier take: KV of every layout, the SWA group's beside it,
    and each group's canary record."""
    from kvcanary_cupy.sim.engine import Engine
    from kvcanary_cupy.sim.pools import slot_bytes

    config = SimConfig(layout=layout, swa_window=swa_window, pool_slots=1024, host_slots=1024)
    engine = Engine(config)
    contexts = [ctx for ctx in (engine.canary.context, engine.canary.swa_context) if ctx is not None]
    pool = (sum(b.nbytes for b in engine.kv_buffers) + sum(t.nbytes for t in getattr(engine, "swa_targets", []))
            + sum(ctx.canary_buf.nbytes for ctx in contexts))
    tier = sum(sum(b.nbytes for b in group.kv.buffers) + group.context.canary_buf.nbytes
               for group in engine.tier.groups.values())
    expected = slot_bytes(config, with_swa=swa_window > 0)
    assert pool == expected * engine.num_slots and tier == expected * engine.tier.num_slots
    assert expected == (704 if swa_window else 544) + (128 if layout == "mla" else 0)


def test_the_pool_and_host_tier_bounds_are_the_memory_they_take(monkeypatch):
    """The pool's and the host tier's bounds are what their KV and canary records take, each on its
    own: a size that fits exactly is built, a page more is refused before anything is allocated,
    naming the bound, the memory and the value. The tier's bound is in whole pages (it rounds up)."""
    from kvcanary_cupy.sim import engine as sim_engine

    monkeypatch.setattr(sim_engine, "memory_limit", lambda: (992 * 544, "a machine of 992 slots"))
    engine = sim_engine.Engine(SimConfig(pool_slots=1000, host_slots=992))
    assert (engine.num_slots, engine.tier.num_slots) == (992, 992)
    with pytest.raises(ValueError, match=r"^kv-canary: pool_slot_count must be <= 992, as the KV pool and its canary "
                                         r"records \(544 bytes a slot: 0\.0 GiB\) must fit in a machine of 992 "
                                         r"slots, got 1008$"):
        sim_engine.Engine(SimConfig(pool_slots=1008, host_slots=0))
    with pytest.raises(ValueError, match=r"^kv-canary: host_slots must be <= 992, as the host tier's KV and canary "
                                         r"records \(544 bytes a slot, in whole pages of 16: 0\.0 GiB\) must fit in "
                                         r"a machine of 992 slots, got 993$"):
        sim_engine.Engine(SimConfig(pool_slots=528, host_slots=993))
    # with a sliding-window group, each slot holds its KV and record too: 704 bytes
    with pytest.raises(ValueError, match=r"^kv-canary: pool_slot_count must be <= 766, .*\(704 bytes a slot"):
        sim_engine.Engine(SimConfig(pool_slots=1000, host_slots=0, swa_window=64))


def test_demo_refuses_a_pool_or_host_tier_larger_than_the_memory_it_may_have(tmp_path):
    """``--pool-slots`` and ``--host-slots`` past the memory the process may have (here an
    address-space limit) are refused before anything is built, in one line naming the option, not
    after seconds spent on the free-page list or gigabytes of KV filled before an allocation fails."""
    import subprocess
    import sys

    limit = 6 * 2**30
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({0}, {0})); "
            "from kvcanary_cupy.sim.cli import main; sys.exit(main(sys.argv[1:]))").format(limit)
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])}
    for option, value, start, end in (
            ("--pool-slots", "200000000", f"kv-canary: pool_slot_count must be <= {limit // 544}, ",
             "(ulimit -v), got 200000000 (set by --pool-slots and --page-size)"),
            ("--host-slots", "200000000", f"kv-canary: host_slots must be <= {limit // (544 * 16) * 16}, ",
             "(ulimit -v), got 200000000 (set by --host-slots)")):
        done = subprocess.run([sys.executable, "-c", code, "--device", "cpu", "--no-progress", option, value],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
        assert done.stderr.startswith(start) and done.stderr.rstrip("\n").endswith(end), done.stderr


def test_demo_cli_a_failed_run_whose_json_cannot_be_written_still_says_it_failed(tmp_path, capsys, monkeypatch):
    """A write that fails after the run is said in a line of its own, and the run's failure still is:
    status 1, as for any false positive (or, with --strict, missed fault), not the write's 2."""
    from kvcanary_cupy.sim import cli, runner

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli.json, "dump", disk_full)
    path = tmp_path / "run.json"
    unseen = ["--device", "cpu", "--no-progress", "--steps", "40", "--hash-mode", "none", "--faults", "kv_bitflip",
              "--json", str(path)]
    assert demo_main(unseen) == 2  # a clean run: the write's failure is the only one
    err = capsys.readouterr().err
    assert f"kv-canary: cannot write {path}: No space left on device" in err and "demo failed" not in err
    assert demo_main([*unseen, "--strict"]) == 1
    err = capsys.readouterr().err
    assert f"kv-canary: cannot write {path}: " in err
    assert re.search(r"kv-canary: demo failed: 0 false positive\(s\), [1-9]\d* missed fault\(s\)", err)
    monkeypatch.setattr(runner, "_attribute", lambda events, faults, step: (list(events), set()))
    assert demo_main(["--device", "cpu", "--no-progress", "--steps", "30", "--faults", "kv_bitflip",
                      "--hash-mode", "all", "--json", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"kv-canary: cannot write {path}: No space left on device" in err
    assert re.search(r"kv-canary: demo failed: [1-9]\d* false positive\(s\)", err)


def test_demo_json_reports_the_pool_slots_the_engine_uses(tmp_path):
    """``--pool-slots`` is rounded down to whole pages: the JSON's ``pool_slots`` is what the engine's
    pool has (992 of the 1000 asked for, with pages of 16), ``pool_slots_asked`` the option's value."""
    from kvcanary_cupy.sim.engine import Engine

    path = tmp_path / "demo.json"
    assert demo_main(["--device", "cpu", "--no-progress", "--steps", "3", "--pool-slots", "1000", "--faults", "none",
                      "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert (data["pool_slots"], data["pool_slots_asked"], data["page_size"]) == (992, 1000, 16)
    assert Engine(SimConfig(pool_slots=1000, host_slots=0)).num_slots == 992


@pytest.mark.parametrize("second", ["run.png", "./run.png"])
def test_demo_refuses_json_and_chart_in_one_file(tmp_path, capsys, monkeypatch, second):
    """Both outputs to one path would leave the chart where the JSON was: refused before the run."""
    monkeypatch.chdir(tmp_path)
    assert demo_main(["--device", "cpu", "--no-progress", "--steps", "5", "--json", "run.png", "--chart", second]) == 2
    assert "kv-canary: --json and --chart must name two files" in capsys.readouterr().err
    assert not (tmp_path / "run.png").exists()


def test_per_class_counts_a_detected_fault_only_as_detected():
    """A fault's requests still running after it was reported: detected, not in flight; in flight
    are only the undetected faults whose requests still run, missed only those done with that
    changed what they read."""
    from types import SimpleNamespace

    from kvcanary_cupy.sim.faults import Fault
    from kvcanary_cupy.sim.runner import SimResult

    def fault(fid, detected_step, closed, took_effect=True):
        return Fault(fid, "kv_bitflip", 10 * fid, {f"r{fid}"}, {fid + 1}, {}, detected_step=detected_step,
                     closed=closed, took_effect=took_effect)

    faults = [fault(0, 3, False), fault(1, None, False), fault(2, None, True), fault(3, None, True, False)]
    result = SimpleNamespace(faults=faults)
    row = SimResult.per_class(result)["kv_bitflip"]
    assert (row["injected"], row["detected"], row["in_flight"], row["no_effect"]) == (4, 1, 1, 1)
    assert SimResult.missed.fget(result) == [faults[2]]


# --- the demo's options reach the run ----------------------------------------------------------------
def _demo_json(argv, capsys) -> dict:
    """A short demo run's JSON, written to standard output."""
    assert demo_main(["--device", "cpu", "--no-progress", *argv, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_demo_options_are_the_settings_the_run_used(capsys):
    """Each option that shapes the engine reaches the run: its JSON settings are the options given."""
    settings = _demo_json(["--steps", "3", "--faults", "none", "--layout", "mla", "--swa-window", "24",
                           "--sweep-every", "5", "--no-expected-checks", "--split-batches"], capsys)["settings"]
    assert (settings["layout"], settings["swa_window"], settings["sweep_every"]) == ("mla", 24, 5)
    assert settings["expected_checks"] is False and settings["split_batches"] is True
    defaults = _demo_json(["--steps", "3", "--faults", "none"], capsys)["settings"]
    assert (defaults["layout"], defaults["swa_window"], defaults["sweep_every"]) == ("paged", 0, 16)
    assert defaults["expected_checks"] is True and defaults["split_batches"] is False


def test_demo_faults_all_names_every_class_and_none_names_none(capsys):
    assert _demo_json(["--steps", "3", "--faults", "all"], capsys)["settings"]["faults"] == list(FAULT_CLASSES)
    assert _demo_json(["--steps", "3", "--faults", "none"], capsys)["settings"]["faults"] == []


def test_demo_offload_chance_takes_both_ends_of_its_range(capsys):
    """0 and 1 are chances: 1 offloads a request every step it can, and 0 asks for no offload, so it
    runs beside --host-slots 0 (only a chance above 0 needs a host tier)."""
    data = _demo_json(["--steps", "12", "--faults", "none", "--offload-prob", "1"], capsys)
    assert data["settings"]["offload_prob"] == 1.0 and data["host_tier"]["offloads"] >= 3
    data = _demo_json(["--steps", "3", "--faults", "none", "--offload-prob", "0", "--host-slots", "0"], capsys)
    assert data["settings"]["offload_prob"] == 0.0 and data["host_tier"] is None


def test_demo_runs_on_a_gpu_by_default_where_one_is_seen(monkeypatch):
    from kvcanary_cupy.sim import cli

    parser = cli.argparse.ArgumentParser()
    cli.add_arguments(parser)
    for count, device in ((1, "cuda"), (0, "cpu")):
        monkeypatch.setattr(cli, "cuda_device_count", lambda count=count: count)
        assert cli.config_from_args(parser.parse_args([])).device == device
        assert cli.config_from_args(parser.parse_args(["--device", "cpu"])).device == "cpu"


def test_demo_json_to_standard_output_needs_no_file_named_dash(tmp_path, monkeypatch, capsys):
    """``--json -`` is standard output, not a file: a folder named ``-`` where the demo runs is no
    reason to refuse it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-").mkdir()
    assert _demo_json(["--steps", "3", "--faults", "none"], capsys)["steps"] == 3


def test_demo_refuses_json_and_chart_in_one_file_under_two_names(tmp_path, capsys):
    """Two names of one file (a link to it) are one file: refused before the run, the file untouched."""
    pytest.importorskip("matplotlib")
    chart = tmp_path / "run.png"
    chart.write_text("kept")
    (tmp_path / "link.png").symlink_to(chart)
    assert demo_main(["--device", "cpu", "--no-progress", "--steps", "3", "--json", str(tmp_path / "link.png"),
                      "--chart", str(chart)]) == 2
    assert "kv-canary: --json and --chart must name two files" in capsys.readouterr().err
    assert chart.read_text() == "kept"


def test_demo_chart_path_ends_in_png_in_any_case_and_needs_matplotlib(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from kvcanary_cupy.sim import cli

    path = tmp_path / "RUN.PNG"
    assert demo_main(["--device", "cpu", "--no-progress", "--steps", "3", "--faults", "none", "--chart",
                      str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    find_spec = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *args: None if name == "matplotlib" else find_spec(name, *args))
    with pytest.raises(SystemExit) as refused:
        demo_main(["--device", "cpu", "--no-progress", "--steps", "3", "--chart", str(tmp_path / "other.png")])
    assert refused.value.code == 2
    assert "argument --chart: needs matplotlib, not installed here" in capsys.readouterr().err
    assert not (tmp_path / "other.png").exists()


def test_demo_json_to_standard_output_with_a_chart_keeps_standard_output_json(tmp_path, capsys):
    """With ``--json -`` standard output is the JSON alone: the chart's line goes where the summary goes."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.png"
    assert demo_main(["--device", "cpu", "--no-progress", "--steps", "3", "--faults", "none", "--json", "-",
                      "--chart", str(path)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["steps"] == 3 and f"wrote {path}" in err and path.exists()


def test_demo_chart_that_cannot_be_written_is_named_and_exits_2(tmp_path, monkeypatch, capsys):
    """A chart not written after a clean run (matplotlib not importing, the disk full) is said with
    its own path, and the status is 2; the JSON written before it stays."""
    pytest.importorskip("matplotlib")
    from kvcanary_cupy.sim import chart

    summary, path = tmp_path / "run.json", tmp_path / "run.png"
    argv = ["--device", "cpu", "--no-progress", "--steps", "3", "--faults", "none", "--json", str(summary),
            "--chart", str(path)]
    monkeypatch.setattr(chart, "write_chart", lambda result, where: False)
    assert demo_main(argv) == 2
    assert "kv-canary: cannot write the chart: matplotlib does not import" in capsys.readouterr().err

    def disk_full(result, where):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(chart, "write_chart", disk_full)
    assert demo_main(argv) == 2
    assert f"kv-canary: cannot write {path}: No space left on device" in capsys.readouterr().err
    assert json.loads(summary.read_text())["steps"] == 3


def test_demo_failed_run_still_exits_1_when_its_reader_has_gone(monkeypatch):
    """Piped into a reader that stops early (a broken pipe), the status still tells a failed run."""
    import io
    import sys

    class GoneReader(io.StringIO):
        def write(self, text):
            raise BrokenPipeError

    argv = ["--device", "cpu", "--no-progress", "--steps", "40", "--hash-mode", "none", "--faults", "kv_bitflip"]
    for extra, status in (([], 0), (["--strict"], 1)):
        monkeypatch.setattr(sys, "stdout", GoneReader())
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        assert demo_main([*argv, *extra]) == status, extra


def test_demo_failed_run_without_strict_counts_no_missed_faults(monkeypatch, capsys):
    """Missed faults fail only --strict runs, so only those say how many were missed."""
    from kvcanary_cupy.sim import runner

    monkeypatch.setattr(runner, "_attribute", lambda events, faults, step: (list(events), set()))
    assert demo_main(["--device", "cpu", "--no-progress", "--steps", "30", "--faults", "kv_bitflip",
                      "--hash-mode", "all"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"kv-canary: demo failed: [1-9]\d* false positive\(s\)\n", err) and "missed" not in err


# --- the fault injector's cadence and victims ----------------------------------------------------------
def test_demo_injects_a_fault_every_fault_every_steps_from_step_10(capsys):
    """The cadence asked for, and said in the settings that run it again."""
    data = _demo_json(["--steps", "40", "--faults", "kv_bitflip", "--fault-every", "7", "--hash-mode", "all"], capsys)
    assert [fault["step"] for fault in data["fault_log"]] == [10, 17, 24, 31, 38]
    assert (data["settings"]["fault_every"], data["settings"]["fault_start"]) == (7, 10)
    faults = run(SimConfig(steps=30), ["kv_bitflip"], fault_every=7, fault_start=3).faults
    assert [fault.step for fault in faults] == [3, 10, 17, 24]


def test_a_batch_fault_with_no_request_to_hurt_waits_for_the_next_step_not_its_next_turn():
    """With one request running, a step may hold no request a batch fault can hurt (too near its
    end, or hurt already): the fault comes a step or more later, and no turn is lost."""
    for cls in ("token_swap", "stale_position"):
        steps = [f.step for f in run(SimConfig(steps=120, max_running=1, hash_mode=kc.HashMode.ALL), [cls]).faults]
        assert any(step % 10 for step in steps), steps  # some came late
        assert all(any(due <= step < due + 10 for step in steps) for due in range(10, 120, 10)), steps


def test_a_fault_that_leaves_its_slots_intact_hurts_only_its_own_request():
    """A slot_alias or a use_after_free corrupts its victim's table or page list, not the slots: the
    request whose slot is aliased, or that is handed the freed page, reads what it wrote and is no
    victim (nor aborted when the fault is reported)."""
    result = run(SimConfig(steps=120, max_running=4, hash_mode=kc.HashMode.NONE), ["slot_alias", "use_after_free"],
                 fault_every=2)
    assert len(result.faults) > 30 and result.false_positives == []
    assert all(len(fault.victims) == 1 for fault in result.faults), [f.victims for f in result.faults]


def test_per_class_rates_and_latencies_are_of_the_faults_injected_and_caught():
    """A class's detection rate is its faults caught over its faults injected; its median and its
    most steps to detection are those of the faults caught, as the summary's row shows them."""
    from kvcanary_cupy.sim.faults import Fault
    from kvcanary_cupy.sim.runner import SimResult

    faults = [Fault(fid, "token_swap", 10 * fid, {fid}, {fid + 1}, {}, detected_step=None if latency is None
                    else 10 * fid + latency, closed=True) for fid, latency in enumerate([0, 4, None, 1, 9])]
    result = SimResult(SimConfig(steps=60), 60, 1, 1, 1, 0, 0, 0, 1.0, 0.5, faults, [], [0] * 60)
    row = result.per_class()["token_swap"]
    assert (row["injected"], row["detected"], row["detection_rate"]) == (5, 4, 0.8)
    assert (row["median_steps_to_detection"], row["max_steps_to_detection"]) == (2.5, 9)
    assert re.search(r"\n  token_swap +5 +4 +80% +2\.5\n", result.summary())


def test_an_event_belongs_to_the_latest_fault_naming_its_request_else_an_open_one_on_its_slot():
    """The first event of a fault marks it caught at that step (later ones leave it so), and every
    victim of the fault is hit; an event naming no victim belongs to an open fault that touched its
    full-group slot (a closed fault's slots, or an SWA slot of the same number, explain nothing)."""
    from types import SimpleNamespace

    from kvcanary_cupy.sim.faults import Fault
    from kvcanary_cupy.sim.runner import _attribute

    def event(request, slot, group="full"):
        return SimpleNamespace(request=request, slot=slot, group=group)

    closed = Fault(0, "kv_bitflip", 5, {4}, {400}, {}, closed=True)
    older = Fault(1, "kv_bitflip", 10, {1}, {100}, {}, detected_step=12)
    newer = Fault(2, "stale_position", 20, {1, 2}, {200}, {})
    freed = Fault(3, "use_after_free", 21, {3}, {300, 301}, {}, took_effect=False)
    first, second, on_freed = event(1, 7), event(2, 8), event(9, 300)
    unexplained, hit = _attribute([first, second, on_freed, event(9, 400), event(9, 301, "swa")],
                                  [closed, older, newer, freed], 25)
    assert (older.detected_step, newer.detected_step, newer.first_event) == (12, 25, first)
    assert (freed.detected_step, freed.first_event, freed.took_effect) == (25, on_freed, True)
    assert [(e.slot, e.group) for e in unexplained] == [(400, "full"), (301, "swa")]
    assert hit == {1, 2, 3}


def test_demo_json_counts_are_the_runs_own():
    """Each count of the JSON and the summary is the run's count of that name."""
    from kvcanary_cupy.sim.faults import Fault
    from kvcanary_cupy.sim.runner import SimResult

    caught = Fault(0, "offload_bitflip", 10, {7}, set(), {"position": 3}, detected_step=13, closed=True)
    result = SimResult(SimConfig(steps=20, static_decode=True), 20, 101, 202, 3, 4, 5, 6, 1.0, 0.5, [caught],
                       [(11, None), (12, None)], [0] * 20)
    data = result.to_json()
    assert {key: data[key] for key in ("tokens", "verified_entries", "requests_finished", "requests_aborted",
                                       "shared_prefix_tokens", "reused_pages", "false_positives")} == dict(
        tokens=101, verified_entries=202, requests_finished=3, requests_aborted=4, shared_prefix_tokens=5,
        reused_pages=6, false_positives=2)
    assert data["split_batches"] is True  # implied by static decode
    assert data["fault_log"] == [{"class": "offload_bitflip", "step": 10, "victims": [7], "detected_step": 13,
                                  "took_effect": True, "detail": {"position": 3}}]
    assert re.search(r"\n  false positives +2$", result.summary())
    assert "requests finished 3, aborted on detection 4; prefix-shared tokens 5; reused pages 6" in result.summary()


def test_a_fault_whose_request_waits_in_the_host_tier_at_the_end_is_in_flight_not_missed():
    """An offloaded request still runs (it is loaded back later): a fault in its host KV left unreported
    at the end is in flight, not missed, and the summary says so."""
    result = run(SimConfig(steps=23, hash_mode=kc.HashMode.ALL), ["offload_bitflip"], fault_every=6)
    last = result.faults[-1]
    assert last.step == 22 and not last.detected and not last.closed
    assert result.missed == [] and result.per_class()["offload_bitflip"]["in_flight"] == 1
    assert "1 undetected fault still in flight at the end" in result.summary()


def test_the_last_step_polls_whatever_the_poll_interval():
    """Polled every 4 steps, a run of 11 still polls its last step: a fault injected there is caught."""
    result = run(SimConfig(steps=11, poll_every=4, hash_mode=kc.HashMode.ALL), ["kv_bitflip"])
    assert [(f.step, f.detected_step) for f in result.faults] == [(10, 10)]
    assert result.violations_per_step[-1] > 0 and sum(result.violations_per_step[:-1]) == 0


def test_sweeps_run_every_sweep_every_steps(monkeypatch):
    from kvcanary_cupy import session

    swept, sweep = [], session.Canary.sweep

    def counted(canary, live):
        swept.append(len(live.req_ids))
        return sweep(canary, live)

    monkeypatch.setattr(session.Canary, "sweep", counted)
    steps = []
    swept_run = run(SimConfig(steps=40, sweep_every=16), [], on_step=lambda step: steps.append(len(swept)))
    assert steps[14:17] == [0, 1, 1] and steps[30:33] == [1, 2, 2] and all(swept)
    unswept = run(SimConfig(steps=40, sweep_every=0), [])
    assert len(swept) == 2 and swept_run.verified_entries > unswept.verified_entries


@pytest.mark.parametrize("swa_window", [0, 8], ids=["full-only", "with-swa-group"])
def test_a_first_forward_verifies_nothing_it_only_writes(swa_window):
    """Verified entries count what the canary checked, not the tokens it fingerprinted: a run's first
    forward writes its prompts' tokens, in every group, and has nothing yet to verify."""
    result = run(SimConfig(steps=1, swa_window=swa_window), [])
    assert result.tokens > 0 and result.verified_entries == 0


def test_a_speculative_forward_fingerprints_only_the_tokens_it_keeps(monkeypatch):
    """The canary's ``after_forward`` is given each request's pending token and its accepted drafts:
    the tokens it fingerprints are the tokens the run wrote, not every draft it verified."""
    from kvcanary_cupy import session

    fingerprinted, after_forward = [], session.Canary.after_forward

    def counted(canary, batch, **kwargs):
        fingerprinted.append(int(batch.out_cache_loc.shape[0]))
        return after_forward(canary, batch, **kwargs)

    monkeypatch.setattr(session.Canary, "after_forward", counted)
    result = run(SimConfig(steps=40, speculative=3), [])
    spec = result.to_json()["speculative"]
    assert spec["accepted"] < spec["verified"] and sum(fingerprinted) == result.tokens


def test_the_host_tier_reports_each_move_by_its_own_count():
    """Offloads, reloads, prefixes kept and prefixes loaded back are four counts, each said apart."""
    from kvcanary_cupy.sim.host_tier import HostTier

    tier = HostTier(SimConfig(host_slots=1024), 1024, with_swa=False)
    tier.offloads, tier.reloads, tier.prefix_stores, tier.prefix_loads = 7, 5, 3, 2
    data = tier.to_json()
    assert (data["slots"], data["offloads"], data["reloads"], data["prefix_stores"], data["prefix_loads"]) == (
        1024, 7, 5, 3, 2)


def test_the_host_tier_hands_out_its_last_free_slots():
    """A take of exactly the slots left gets them all (slot 0 is never handed out); one more finds
    the tier full."""
    from kvcanary_cupy.sim.host_tier import HostTier

    tier = HostTier(SimConfig(host_slots=1024), 64, with_swa=False)
    assert tier.take(60).tolist() == list(range(1, 61))
    assert tier.take(4) is None
    assert tier.take(3).tolist() == [61, 62, 63]
    assert tier.take(1) is None


def test_an_evicted_prefix_takes_the_host_tiers_last_free_slots():
    """An evicted prefix is kept in the host tier when the tier has room for all its pages, its
    last free slots included; with no room left it is not kept."""
    from kvcanary_cupy.sim.engine import Engine

    engine = Engine(SimConfig(host_slots=1024, seed=1))
    ps = engine.page_size
    pages = [engine._take_page() for _ in range(2)]
    engine.tier.take(len(engine.tier.free) - 2 * ps)
    engine._store_prefix(7, pages)
    assert engine.host_prefixes[7].size == 2 * ps and len(engine.tier.free) == 0
    engine._store_prefix(8, pages[:1])
    assert 8 not in engine.host_prefixes and engine.tier.prefix_stores == 1


def test_a_shared_prefix_is_published_at_the_step_its_request_reaches_it():
    """A request of a template publishes the template's prefix (its whole pages) at the end of the
    step in which its length reaches the prefix's, so that the requests after it share it, also
    where a prefill chunk ends exactly there."""
    from kvcanary_cupy.sim.engine import Engine

    config = SimConfig(seed=2, chunk_tokens=32, templates=2, template_len=64, share_prob=1.0)
    engine = Engine(config)
    share_len = config.template_len // engine.page_size * engine.page_size
    exactly = 0
    for step in _admitted_steps(engine, 60):
        unpublished = {r.template for r in engine.running if r.template not in engine.prefix_cache}
        batch = engine.schedule()
        engine.advance(batch)
        for request in batch.requests:
            if request.template in unpublished and request.seq_len >= share_len:
                assert request.template in engine.prefix_cache, f"step {step}"
                exactly += request.seq_len == share_len
    assert exactly


def test_only_a_request_with_tokens_cached_may_move_to_a_host_tier():
    """A request that has cached nothing yet (a prefill the budget left out) stays in the pool, and
    without a host tier no request may move; one with tokens cached and room for them may."""
    from kvcanary_cupy.sim.engine import Engine

    for host_slots in (2048, 0):
        engine = Engine(SimConfig(**_TIGHT_BUDGET, host_slots=host_slots))
        seen = collections.Counter()
        for step in _admitted_steps(engine, 30):
            for request in engine.running:
                movable = engine.can_offload(request)
                seen[request.seq_len > 0, movable] += 1
                assert not movable or (host_slots and request.seq_len > 0), f"step {step}"
            engine.advance(engine.schedule())
        assert seen[False, False] and seen[True, bool(host_slots)]


def test_a_speculative_batch_keeps_all_only_where_every_request_keeps_every_token():
    """The tokens a speculative batch keeps (those the after_forward fingerprints): all of them only
    where every request keeps all it wrote; otherwise each request's first ``kept_lens`` entries,
    also where every request rejects a draft."""
    from kvcanary_cupy.sim.engine import StepBatch

    def batch(kept_lens):
        ids = np.arange(100, 107, dtype=np.int64)
        return StepBatch([object(), object()], np.array([1, 2]), np.array([5, 9]), np.array([3, 4]), ids,
                         np.arange(20, 27), np.arange(40, 47), ids.copy(), np.arange(20, 27),
                         None if kept_lens is None else np.array(kept_lens))

    assert batch(None).keeps_all and batch([3, 4]).keeps_all
    for kept_lens, entries in (([1, 4], [0, 3, 4, 5, 6]), ([2, 1], [0, 1, 3])):
        kept = batch(kept_lens)
        assert not kept.keeps_all
        kept = kept.kept()
        assert kept.input_ids.tolist() == [100 + e for e in entries]
        assert kept.out_cache_loc.tolist() == [40 + e for e in entries] and kept.extend_lens.tolist() == kept_lens


def test_demo_chart_draws_the_violations_and_marks_each_fault_caught_or_not(tmp_path, monkeypatch):
    """The chart's bars are the violations reported at each step; each fault is a line at its step,
    solid when it was caught and dotted when it was not."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from kvcanary_cupy.sim.chart import write_chart
    from kvcanary_cupy.sim.faults import Fault
    from kvcanary_cupy.sim.runner import SimResult

    lines, bars = {}, []
    axvline, bar = Axes.axvline, Axes.bar

    def record_line(axes, x=0, *args, **kwargs):
        lines[x] = kwargs.get("linestyle")
        return axvline(axes, x, *args, **kwargs)

    def record_bar(axes, x, height, *args, **kwargs):
        bars.append(list(height))
        return bar(axes, x, height, *args, **kwargs)

    monkeypatch.setattr(Axes, "axvline", record_line)
    monkeypatch.setattr(Axes, "bar", record_bar)
    faults = [Fault(0, "kv_bitflip", 1, {1}, {17}, {}, detected_step=1, closed=True),
              Fault(1, "kv_bitflip", 3, {2}, {18}, {}, closed=True)]
    result = SimResult(SimConfig(steps=5), 5, 1, 1, 1, 0, 0, 0, 1.0, 0.5, faults, [], [0, 2, 0, 1, 0])
    assert write_chart(result, str(tmp_path / "run.png"))
    assert lines == {1: "-", 3: ":"} and bars[0] == [0, 2, 0, 1, 0] and bars[1] == [0.5]


def test_reused_pages_count_only_pages_handed_out_again():
    assert run(SimConfig(steps=3), []).reused_pages == 0  # every page taken so far is a first use


def test_a_request_can_move_to_the_host_tier_when_the_tier_has_room_for_every_token_it_holds():
    """A tier with exactly as many free slots as the request's cached tokens takes it, one fewer does
    not; a request that lost a page (freed under it) cannot move, as it does not hold all it uses."""
    from kvcanary_cupy.sim.engine import _FREED, Engine

    engine = Engine(SimConfig(seed=1))
    engine.admit_arrivals()
    engine.advance(engine.schedule())
    request = engine.running[0]
    assert request.seq_len > 0
    while len(engine.tier.free) > request.seq_len:
        engine.tier.free.pop()
    assert engine.can_offload(request)
    engine.tier.free.pop()
    assert not engine.can_offload(request)
    engine.tier.free.append(0)
    request.pages[0] = _FREED
    assert not engine.can_offload(request)


def test_aborting_a_request_running_or_offloaded_counts_it_once():
    """Each request aborted is counted, whether it runs or waits in the host tier (whose slots it
    gives back); one already gone is not."""
    from kvcanary_cupy.sim.engine import Engine

    engine = Engine(SimConfig(seed=1))
    engine.admit_arrivals()
    engine.advance(engine.schedule())
    running, offloaded = engine.running[:2]
    free = len(engine.tier.free)
    engine.offload(offloaded)
    assert len(engine.tier.free) == free - offloaded.seq_len
    assert engine.abort(running.rid) and engine.aborted == 1 and running not in engine.running
    assert engine.abort(offloaded.rid) and engine.aborted == 2
    assert len(engine.tier.free) == free and offloaded.rid not in engine.offloaded
    assert not engine.abort(running.rid) and not engine.abort(offloaded.rid) and engine.aborted == 2


def test_demo_summary_says_no_fault_was_injected_and_where_its_json_went(tmp_path, capsys):
    path = tmp_path / "run.json"
    assert demo_main(["--device", "cpu", "--no-progress", "--steps", "3", "--faults", "none", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  (none injected)\n" in out and out.rstrip("\n").endswith(f"wrote {path}") and path.exists()


def test_a_full_host_tier_takes_no_more_slots_nor_an_evicted_prefix():
    """The tier hands out slots only while it has them all; an evicted prefix it has no room for is
    dropped rather than kept (a later request computes it again)."""
    from kvcanary_cupy.sim.engine import Engine

    engine = Engine(SimConfig(seed=1, host_slots=1024))
    tier = engine.tier
    assert tier.take(len(tier.free) + 1) is None and len(tier.free) == 1023
    held = tier.take(len(tier.free) - 15)
    assert len(held) == 1008 and len(tier.free) == 15
    engine._store_prefix(0, [1])  # a page of 16 slots: one more than the tier has
    assert engine.host_prefixes == {} and tier.prefix_stores == 0 and len(tier.free) == 15


def test_the_times_a_run_reports_are_its_own(ticking_clock):
    """Under a clock that ticks a millisecond at every reading, each time the run reports is the
    readings it spans: the canary's part of a decode forward is its before and after calls (one
    tick each), the whole canary's share lies inside the wall time, the host tier's copies and the
    kernels' readying take some ticks and no more than the run, and the summary's figures are
    those times'."""
    ticking_clock(1000.0, 0.001)
    result = run(SimConfig(steps=40, split_batches=True, offload_prob=0.3, hash_mode=kc.HashMode.ALL), [])
    assert result.decode_forwards > 5 and result.decode_canary_s == pytest.approx(0.002 * result.decode_forwards)
    assert 0.003 * result.steps <= result.canary_s < result.wall_s < 1000.0
    assert 0.0 < result.kernels_s < 1000.0
    tier = result.to_json()["host_tier"]
    assert tier["offloads"] > 0 and 0.0 < tier["kv_copy_ms"] and 0.0 < tier["records_copy_ms"]
    assert tier["kv_copy_ms"] + tier["records_copy_ms"] < 1e3 * result.wall_s
    assert result.to_json()["canary_ms_per_step"] == round(1e3 * result.canary_s / result.steps, 4)
    assert f"({100 * result.canary_s / result.wall_s:.0f}% of the step loop)" in result.summary()


def test_the_progress_bar_fills_in_proportion_and_says_its_rate(monkeypatch):
    """Half done, the bar is half filled and gives the steps a second since it began; it redraws at
    most ten times a second, but always at the last step."""
    import io
    import time

    from kvcanary_cupy.sim.runner import Progress

    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    out = io.StringIO()
    bar = Progress(8, stream=out, width=10)
    now[0] = 102.0
    bar.update(4, "note")
    assert out.getvalue() == "\r[#####.....] 4/8 steps    2.0/s note"
    now[0] = 102.05
    bar.update(5)
    assert out.getvalue().count("\r") == 1  # a twentieth of a second later: not redrawn
    bar.update(8)
    assert out.getvalue().endswith("\r[##########] 8/8 steps    3.9/s ")


@pytest.mark.parametrize("offset, mode, found", [(40, "PARTIAL", False), (40, "ALL", True), (0, "PARTIAL", True)])
def test_a_pinned_bit_flip_lands_at_its_offset_in_either_half_of_an_interleaved_row(offset, mode, found):
    """With ``bitflip_offset`` pinned, a kv_bitflip in an interleaved row (K then V, two sources) flips
    that byte of the K half or of the V half: PARTIAL misses byte 40 of either and sees byte 0,
    ALL sees byte 40."""
    from kvcanary_cupy.sim.pools import KV_DTYPE

    config = SimConfig(steps=200, layout="interleaved", hash_mode=MODES[mode])
    result = run(config, ["kv_bitflip"], bitflip_offset=offset)
    faults = result.faults
    token_bytes = config.heads * config.head_dim * np.dtype(KV_DTYPE).itemsize  # a half: K's or V's heads
    assert len(faults) >= 15 and all(f.detail["source_offset"] == offset for f in faults)
    assert {f.detail["byte"] // token_bytes for f in faults} == {0, 1}  # both halves are hit
    assert all(f.detected == found for f in faults) and result.false_positives == []

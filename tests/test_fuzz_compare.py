"""The differential fuzz's judge, ``_fuzzcases.compare``: the CPU backend run twice, one run's
outputs changed as a GPU bug would change them, must be told apart, each output by its name;
changes a GPU may make (the order of one launch's rows) must not. tools/differential_fuzz.py
around it, against a stand-in backend, fails one that differs, also where only a ring that keeps
every row shows it."""

from __future__ import annotations

import copy
import functools
import json
from collections import Counter

import numpy as np
import pytest

import _fuzzcases as F
from _tools import import_tools
import kvcanary_cupy as kc
from kvcanary_cupy import _layout as L


def _overflowing(op: str, seed: int) -> dict:
    """A small case of ``op`` whose ring keeps some of its rows but not all."""
    rng = np.random.default_rng(seed)
    for _ in range(400):
        case = F.MAKERS[op](rng, 300)
        out = F.RUNNERS[op](case, "cpu")
        if 1 < out["ring"].shape[0] < out["write_index"]:
            return case
    raise AssertionError(f"no overflowing {op} case")


def _copy(outputs: dict) -> dict:
    return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in outputs.items()}


@pytest.mark.parametrize("op", ["write", "step"])
def test_an_overflowing_ring_is_not_judged_without_every_row(op):
    """The kept rows of an overflowing ring are judged against every row the launch records; a
    caller that leaves those out is told, not passed whatever the ring holds."""
    case = _overflowing(op, 7)
    oracle = F.RUNNERS[op](case, "cpu")
    other = _copy(oracle)
    other["ring"][0, L.RING_COL_POSITION] += 1000
    with pytest.raises(ValueError, match="_full_rows"):
        F.compare(op, case, oracle, other)
    case["_full_rows"] = F.full_rows(op, case, oracle["write_index"])
    assert F.compare(op, case, oracle, _copy(oracle)) == []
    assert F.compare(op, case, oracle, other) == ["kept ring rows are not violations of this launch"]
    last = _copy(oracle)
    last["ring"][-1, L.RING_COL_POSITION] += 1000
    assert F.compare(op, case, oracle, last) == ["kept ring rows are not violations of this launch"]


@pytest.mark.parametrize("op", ["write", "step"])
def test_the_overflow_aware_compare_gathers_every_row_itself(op):
    """``compare_overflow_aware`` gives an overflowing case the launch's every row before it judges
    the kept ones, as the callers did by hand; it judges them as ``compare`` does."""
    case = _overflowing(op, 7)
    oracle = F.RUNNERS[op](case, "cpu")
    other = _copy(oracle)
    other["ring"][0, L.RING_COL_POSITION] += 1000
    assert F.compare_overflow_aware(op, case, oracle, other) == ["kept ring rows are not violations of this launch"]
    assert case["_full_rows"] == F.full_rows(op, case, oracle["write_index"])
    assert F.compare_overflow_aware(op, case, oracle, _copy(oracle)) == []


def test_the_overflow_aware_compare_takes_every_row_from_the_run_that_made_the_oracle():
    """A step launched twice over one context, whose ring keeps rows of both launches: every row
    comes from the same two launches (``run=``), not from one launch of the case."""
    rng = np.random.default_rng(7)
    twice = functools.partial(F.run_step_unfused, device="cpu", launches=2)
    for _ in range(2000):
        case = F.make_step_case(rng, 300)
        once = F.run_step(case, "cpu")
        if 0 < once["write_index"] < once["ring"].shape[0]:
            oracle = twice(case)
            if F.ring_overflowed(oracle):
                break
    else:
        raise AssertionError("no step case whose ring overflows in its second launch only")
    assert F.compare_overflow_aware("step", case, oracle, _copy(oracle), run=twice) == []
    assert case["_full_rows"] == F.full_rows("step", case, oracle["write_index"], run=twice)
    one_launch = dict(case)
    assert F.compare_overflow_aware("step", one_launch, oracle, _copy(oracle)) == \
        ["kept ring rows are not violations of this launch"]


@pytest.mark.parametrize("op", ["write", "step"])
def test_a_ring_one_row_short_is_judged_against_every_row(op):
    """A launch that records one row more than its ring keeps overflowed: the kept rows are judged
    against every row of the launch, each as often as it was recorded (a row kept twice that the
    launch recorded once is no row of it)."""
    case = F.with_ring(_overflowing(op, 7), 1)
    total = F.RUNNERS[op](case, "cpu")["write_index"]
    short = F.with_ring(case, total - 1)
    oracle = F.RUNNERS[op](short, "cpu")
    assert oracle["write_index"] == total == oracle["ring"].shape[0] + 1
    with pytest.raises(ValueError, match="_full_rows"):
        F.compare(op, short, oracle, _copy(oracle))
    short["_full_rows"] = F.full_rows(op, short, total)
    assert F.compare(op, short, oracle, _copy(oracle)) == []
    moved = _copy(oracle)
    moved["ring"][0, L.RING_COL_POSITION] += 1000
    assert F.compare(op, short, oracle, moved) == ["kept ring rows are not violations of this launch"]
    kept = list(map(tuple, oracle["ring"].tolist()))
    once = next(i for i, row in enumerate(kept) if short["_full_rows"][row] == 1)
    other = next(i for i, row in enumerate(kept) if row != kept[once] and row[0] == kept[once][0])  # same tag
    twice = _copy(oracle)
    twice["ring"][other] = oracle["ring"][once]
    assert F.compare(op, short, oracle, twice) == ["kept ring rows are not violations of this launch"]


@pytest.mark.parametrize("op", ["verify", "write", "step"])
def test_full_rows_are_every_row_of_the_launch_as_often_as_recorded(op):
    case = _overflowing(op, 7) if op != "verify" else _with_rows(op, 11)[0]
    total = F.RUNNERS[op](case, "cpu")["write_index"]
    roomy = F.RUNNERS[op](F.with_ring(case, 2 * total), "cpu")
    assert roomy["write_index"] == total
    every = F.full_rows(op, case, total)
    assert sum(every.values()) == total
    assert every == Counter(map(tuple, roomy["ring"][:total].tolist()))


def _step_with_both(seed: int, overflow: bool) -> tuple[dict, dict]:
    """A step case whose verify and write record rows under tags of their own, and its outputs;
    with ``overflow``, one whose ring keeps only some of the verify's rows."""
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        case = F.make_step_case(rng, 300)
        case["write_tag"] = (case["verify_tag"] + 1) % 12
        out = F.RUNNERS["step"](case, "cpu")
        every = F.run_step(F.with_ring(case, max(out["write_index"], 1)), "cpu")["ring"][:, L.RING_COL_KERNEL_KIND]
        verify_rows = int((every == case["verify_tag"]).sum())
        write_rows = int((every == case["write_tag"]).sum())
        fits = out["write_index"] <= out["ring"].shape[0]
        if write_rows and (1 < out["ring"].shape[0] < verify_rows if overflow else verify_rows and fits):
            return case, out
    raise AssertionError("no such step case")


def test_a_step_write_row_recorded_before_its_verify_rows_is_a_difference():
    """A GPU may order one launch's rows as it likes, but the step's write waits for its verify:
    a write row ahead of a verify row (a write that overtook the verify) is a difference, rows of
    the verify reordered among themselves are not."""
    case, oracle = _step_with_both(3, overflow=False)
    kinds = oracle["ring"][:oracle["write_index"], L.RING_COL_KERNEL_KIND]
    verify_rows = int((kinds == case["verify_tag"]).sum())
    assert list(kinds) == [case["verify_tag"]] * verify_rows + [case["write_tag"]] * (len(kinds) - verify_rows)
    shuffled = _copy(oracle)
    shuffled["ring"][:verify_rows] = oracle["ring"][:verify_rows][::-1]
    assert F.compare("step", case, oracle, shuffled) == []
    overtaken = _copy(oracle)
    overtaken["ring"][:oracle["write_index"]] = np.roll(oracle["ring"][:oracle["write_index"]], 1, axis=0)
    assert F.compare("step", case, oracle, overtaken) == ["ring rows' tags out of launch order"]


def test_an_overflowing_step_ring_keeps_the_verify_rows_first():
    """The rows a full ring keeps are the first recorded: a step's verify rows, not its write's,
    even though the write's are rows of the launch too."""
    case, oracle = _step_with_both(5, overflow=True)
    total = oracle["write_index"]
    case["_full_rows"] = F.full_rows("step", case, total)
    every = F.run_step(F.with_ring(case, total), "cpu")["ring"]
    write_row = every[every[:, L.RING_COL_KERNEL_KIND] == case["write_tag"]][0]
    for kept_row in (0, -1):
        overtaken = _copy(oracle)
        overtaken["ring"][kept_row] = write_row
        assert F.compare("step", case, oracle, overtaken) == ["ring rows' tags out of launch order"]


def _changed(outputs: dict, key: str) -> dict:
    """``outputs`` with one value of ``key`` changed: a count, or an array's last cell."""
    other = _copy(outputs)
    if isinstance(other[key], np.ndarray):
        other[key].reshape(-1)[-1] += 1
    else:
        other[key] += 1
    return other


def _with_rows(op: str, seed: int) -> tuple[dict, dict]:
    """A small case of ``op`` whose ring keeps every row, three or more, no two alike and all of
    one kind (a step's verify rows come before its write rows), with rows to spare, and its
    outputs."""
    rng = np.random.default_rng(seed)
    for _ in range(400):
        case = F.MAKERS[op](rng, 60)
        out = F.RUNNERS[op](case, "cpu")
        rows = out["ring"][:out["write_index"]]
        if (3 <= len(rows) < out["ring"].shape[0] and len(set(map(tuple, rows.tolist()))) == len(rows)
                and len(set(rows[:, L.RING_COL_KERNEL_KIND].tolist())) == 1):
            return case, out
    raise AssertionError(f"no such {op} case")


@pytest.mark.parametrize("op", ["verify", "write", "step"])
def test_each_output_of_a_launch_that_differs_is_told(op):
    """The canary buffer, the write index, either run counter, a kept ring row and a row past the
    write index: each changed alone is named, and nothing else is; a launch's rows in another order
    (of one tag) are no difference."""
    case, oracle = _with_rows(op, 11)
    n = oracle["write_index"]
    assert F.compare(op, case, oracle, _copy(oracle)) == []
    for key in ("canary", "write_index", "slot_run_counter", "kernel_run_counter"):
        assert F.compare(op, case, oracle, _changed(oracle, key)) == [key]
    rolled = _copy(oracle)
    rolled["ring"][:n] = np.roll(oracle["ring"][:n], 1, axis=0)
    assert F.compare(op, case, oracle, rolled) == []
    moved = _copy(oracle)
    moved["ring"][n - 1, L.RING_COL_POSITION] += 1
    assert F.compare(op, case, oracle, moved) == ["ring rows"]
    past = _copy(oracle)
    past["ring"][n, L.RING_COL_POSITION] += 1
    assert F.compare(op, case, oracle, past) == ["ring rows past the write index"]
    last = _copy(oracle)
    last["ring"][-1, L.RING_COL_POSITION] += 1
    assert F.compare(op, case, oracle, last) == ["ring rows past the write index"]
    # a launch may record one row twice (a slot in two entries): how often each row comes counts
    twice = _copy(oracle)
    twice["ring"][1] = oracle["ring"][0]
    swapped = _copy(twice)
    swapped["ring"][0] = oracle["ring"][2]
    assert F.compare(op, case, twice, swapped) == ["ring rows"]


@pytest.mark.parametrize("op", ["verify", "write", "step"])
def test_a_ring_full_to_its_last_row_is_compared_row_by_row(op):
    """A ring that keeps exactly the rows recorded overflowed nothing: its rows are compared as a
    multiset, as a roomier ring's are."""
    case, outputs = _with_rows(op, 11)
    full = F.with_ring(case, outputs["write_index"])
    oracle = F.RUNNERS[op](full, "cpu")
    assert oracle["write_index"] == oracle["ring"].shape[0]
    moved = _copy(oracle)
    moved["ring"][-1, L.RING_COL_POSITION] += 1
    assert F.compare(op, full, oracle, moved) == ["ring rows"]


@pytest.mark.parametrize(("op", "keys"), [
    ("plan", ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices", "num_valid", "enable",
              "offsets", "seed_slot_indices", "num_valid_reqs")),
    ("records", ("src", "dst")),
    ("scatter", ("pool_out",)),
])
def test_each_output_of_an_op_without_a_ring_that_differs_is_told(op, keys):
    case = F.MAKERS[op](np.random.default_rng(11), 60)
    oracle = F.RUNNERS[op](case, "cpu")
    assert sorted(oracle) == sorted(keys)
    assert F.compare(op, case, oracle, _copy(oracle)) == []
    for key in keys:
        assert F.compare(op, case, oracle, _changed(oracle, key)) == [key]


# a value of each op's outputs to change, standing in for a backend that computes it wrong
CHANGED_KEY = {"verify": "canary", "write": "slot_run_counter", "step": "write_index", "plan": "num_valid",
               "records": "dst", "scatter": "pool_out"}


def _differential_fuzz(tmp_path, monkeypatch, change, *ops: str, cases: int = 12) -> tuple[int, dict]:
    """tools/differential_fuzz.py over a few small cases of ``ops``, against a backend ("other")
    that is the CPU one with its outputs passed through ``change(op, case, outputs)``: its exit
    status and its summary by op."""
    (fuzz,) = import_tools("differential_fuzz")
    assert fuzz.F is F
    cpu = dict(F.RUNNERS)

    def other(op):
        def run(case, device):
            outputs = cpu[op](case, "cpu")
            return change(op, case, outputs) if device == "other" else outputs
        return run

    for op in cpu:
        monkeypatch.setitem(F.RUNNERS, op, other(op))
    out = tmp_path / "fuzz.json"
    status = fuzz.main(["--device", "other", "--cases", str(cases), "--small-entries", "64", "--max-entries", "64",
                        "--ops", *ops, "--json", str(out)])
    return status, json.loads(out.read_text())["ops"]


def test_the_differential_fuzz_passes_a_backend_that_agrees(tmp_path, monkeypatch):
    status, ops = _differential_fuzz(tmp_path, monkeypatch, lambda op, case, outputs: outputs, *F.MAKERS)
    assert status == 0 and sorted(ops) == sorted(F.MAKERS)
    assert all(summary["mismatches"] == 0 and summary["cases"] == 12 for summary in ops.values())


def test_the_differential_fuzz_fails_a_backend_that_differs(tmp_path, monkeypatch):
    """Every case of every op counted as a mismatch, and the exit status 1."""
    status, ops = _differential_fuzz(tmp_path, monkeypatch,
                                     lambda op, case, outputs: _changed(outputs, CHANGED_KEY[op]), *F.MAKERS)
    assert status == 1
    assert all(summary["mismatches"] == 12 and summary["examples"] for summary in ops.values())


def test_the_differential_fuzz_fails_a_backend_that_differs_only_where_the_ring_keeps_every_row(tmp_path,
                                                                                                monkeypatch):
    """A case whose ring overflows runs again with a ring that keeps every row: a backend wrong
    only there is caught too."""
    with_ring = F.with_ring
    monkeypatch.setattr(F, "with_ring", lambda case, capacity: dict(with_ring(case, capacity), _every_row=True))
    status, ops = _differential_fuzz(
        tmp_path, monkeypatch,
        lambda op, case, outputs: _changed(outputs, "canary") if case.get("_every_row") else outputs, "write",
        cases=80)  # enough that several rings overflow (a few in a hundred of these small cases)
    assert status == 1 and ops["write"]["mismatches"]
    assert all(problems == ["canary (every row kept)"] for problems in
               (example["problems"] for example in ops["write"]["examples"]))


def test_the_differential_fuzz_fails_a_backend_that_stores_past_an_output(tmp_path, monkeypatch):
    """Every array a case hands the package lies between guard bands: a backend that stores one
    byte past the last array it was given is a mismatch, which names the array, although every
    output it returns agrees. The bands are gone once the run ends."""

    def past_the_end(op, case, outputs):
        F._guarded[-1][0][-1] ^= 0xFF
        return outputs

    status, ops = _differential_fuzz(tmp_path, monkeypatch, past_the_end, *F.MAKERS)
    assert status == 1
    for summary in ops.values():
        assert summary["mismatches"] == 12
        assert all(any(problem.startswith("bytes after a cpu array of shape") for problem in example["problems"])
                   for example in summary["examples"])
    assert F._guarded is None


def test_guard_bands_see_a_store_on_either_side_and_nothing_inside():
    F.guard_arrays(True)
    try:
        rng = np.random.default_rng(5)
        values = rng.integers(1, 1 << 40, size=(3, 5), dtype=np.int64)
        inside, before, after = (F._to(values, "cpu") for _ in range(3))
        assert inside.shape == values.shape and np.array_equal(inside, values)
        inside[...] = rng.integers(1, 1 << 40, size=inside.shape)
        _next_to(before, "before")[0] ^= 1  # a store through the array's own memory, as a backend's
        _next_to(after, "after")[0] ^= 1
        assert F.guard_problems() == ["bytes before a cpu array of shape (3, 5) and dtype int64 were written",
                                      "bytes after a cpu array of shape (3, 5) and dtype int64 were written"]
        assert F.guard_problems() == []
    finally:
        F.guard_arrays(False)


CONTEXT_OUTPUTS = ("canary", "write_index", "slot_run_counter", "kernel_run_counter")


def _context_buffers(ctx) -> dict:
    return dict(zip(CONTEXT_OUTPUTS, (ctx.canary_buf, ctx.violation_write_index, ctx.slot_run_counter,
                                      ctx.kernel_run_counter)))


# each op's call in the package, and the buffers it stores to (by the name of the output that shows them)
_CALLS = {
    "verify": (kc, "verify", lambda args, kwargs: _context_buffers(args[0])),
    "write": (kc, "write", lambda args, kwargs: _context_buffers(args[0])),
    "step": (kc.CanaryStep, "launch", lambda args, kwargs: _context_buffers(args[0].ctx)),
    "plan": (kc, "plan", lambda args, kwargs: {
        **{name: getattr(args[0], name) for name in ("slot_indices", "expected_tokens", "expected_positions",
                                                      "prev_slot_indices", "num_valid", "enable")},
        **{name: getattr(args[1], name) for name in ("offsets", "seed_slot_indices", "num_valid_reqs")}}),
    "scatter": (kc, "scatter_req_token_ids", lambda args, kwargs: {"pool_out": kwargs["pool_out"]}),
    "records": (kc, "copy_records", lambda args, kwargs: {"src": kwargs["src"].canary_buf,
                                                          "dst": kwargs["dst"].canary_buf}),
}


def _case_with_buffers_apart(op: str) -> dict:
    """A small case whose outputs are buffers of their own, and whose ring has room for a row more
    than the oracle records (a write index one too high is then a difference, not an overflow that
    needs the launch's every row to judge)."""
    rng = np.random.default_rng(11)
    while True:
        case = F.MAKERS[op](rng, 60)
        if op == "records" and case["where"] == "one":
            continue
        if op in F.RING_OPS:
            outputs = F.RUNNERS[op](case, "cpu")
            if outputs["write_index"] >= outputs["ring"].shape[0]:
                continue
        return case


@pytest.mark.parametrize("op", list(F.MAKERS))
def test_each_runner_returns_what_its_call_stored(op, monkeypatch):
    """A backend whose call stores one wrong value into any buffer it writes is a difference, named
    by that buffer: each runner returns the buffers the call itself wrote, after it ran, not the
    case's inputs or copies made before."""
    case = _case_with_buffers_apart(op)
    oracle = F.RUNNERS[op](case, "cpu")
    owner, name, buffers_of = _CALLS[op]
    call = getattr(owner, name)
    changed = []

    def wrong(*args, **kwargs):
        call(*args, **kwargs)
        buffer = buffers_of(args, kwargs)[target]
        buffer.reshape(-1)[-1] += 1
        changed.append(target)

    monkeypatch.setattr(owner, name, wrong)
    for target in sorted(oracle) if op in ("plan", "scatter", "records") else CONTEXT_OUTPUTS:
        other = F.RUNNERS[op](case, "cpu")
        assert changed[-1:] == [target]
        assert target in F.compare(op, case, oracle, other)


@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.parametrize("op", list(F.MAKERS))
def test_a_runner_leaves_its_case_as_it_was(op, guarded):
    """The oracle runs first: had it stored into the case's own arrays (a canary it wrote records
    into), the backend judged after it would start from the oracle's results, and one that stores
    nothing would agree."""
    case = _case_with_buffers_apart(op)
    before = copy.deepcopy(case)
    F.guard_arrays(guarded)
    try:
        first = F.RUNNERS[op](case, "cpu")
        second = F.RUNNERS[op](case, "cpu")
    finally:
        F.guard_arrays(False)
    assert _same(case, before)
    assert F.compare(op, case, first, second) == []


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def test_plan_cells_past_the_entries_are_compared():
    """A plan leaves the cells past its entries as they were: the runner fills them with a value
    no plan writes, so that a backend storing zeros (or anything) there is a difference."""
    rng = np.random.default_rng(3)
    while True:
        case = F.make_plan_case(rng, 60)
        oracle = F.RUNNERS["plan"](case, "cpu")
        if 0 <= oracle["num_valid"][0] < case["verify_capacity"]:
            break
    left = slice(int(oracle["num_valid"][0]), None)
    for key in ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices"):
        zeroed = _copy(oracle)
        zeroed[key][left] = 0
        assert F.compare("plan", case, oracle, zeroed) == [key]


def _next_to(array: np.ndarray, side: str) -> np.ndarray:
    """The element just before or just after ``array``'s memory, as a view to store into."""
    flat = array.reshape(-1)
    if side == "before":
        return np.lib.stride_tricks.as_strided(flat, shape=(2,), strides=(-flat.itemsize,))[1:]
    return np.lib.stride_tricks.as_strided(flat, shape=(flat.size + 1,), strides=flat.strides)[-1:]


def test_the_cases_only_memcheck_can_judge_have_their_shapes_and_come_first_under_exact_allocations(tmp_path):
    """``_fuzzcases.memcheck_cases``: a full write plan of at least 256 requests with real-KV sources
    and more entries than requests (the warp forms), a scatter batch whose every request names
    one pool row (more later writers than the kernel remembers, the first request the longest) and
    one of long rows, a pool row each, the last to the input's end (the long-rows form), and a
    step that the step kernel's block 0 writes with threads to spare, some of its requests' seeds
    one past the pool; the fuzz runs them before its random cases only with ``--exact-allocations``,
    the CPU backend agreeing with itself."""
    from kvcanary_cupy.ops.backends._cuda.scatter import _BLOCK as SCATTER_THREADS, scatter_form
    from kvcanary_cupy.ops.backends._cuda.step import _BLOCK as STEP_THREADS, plan_block_write, tail_write

    for seed in range(3):
        (write,) = F.memcheck_cases("write", np.random.default_rng(seed))
        capacity = len(write["offsets"]) - 1
        assert min(max(write["num_valid_reqs"], 0), capacity) == capacity >= 256
        assert len(write["input_ids"]) > capacity and write["pool"]["sources"]
        assert write["pool"]["hash_mode"] != int(kc.HashMode.NONE)
        scatter, long_rows = F.memcheck_cases("scatter", np.random.default_rng(seed))
        assert len(scatter["req_pool_indices"]) > 64 and not scatter["req_pool_indices"].any()
        lengths = np.diff(scatter["offsets"])
        assert lengths[0] == scatter["pool_out"].shape[1] > lengths[1:].max()
        lengths, rows = np.diff(long_rows["offsets"]), long_rows["req_pool_indices"]
        assert scatter_form(len(rows), len(long_rows["flat_in"]), 132) == (False, True)
        assert sorted(rows) == list(range(len(rows))) and long_rows["offsets"][-1] == len(long_rows["flat_in"])
        assert lengths.max() < 8 * SCATTER_THREADS and long_rows["pool_out"].shape[1] > lengths.max()
        (step,) = F.memcheck_cases("step", np.random.default_rng(seed))
        bs, n = len(step["req_pool_indices"]), len(step["input_ids"])
        assert plan_block_write(bs, n) and not tail_write(bs, n) and bs < STEP_THREADS
        seeds = F.seed_slots(step["req_pool_indices"], step["prefix_lens"], step["req_to_token"],
                             step["full_to_swa_index_mapping"])
        assert step["pool"]["num_slots"] in seeds
    assert F.memcheck_cases("verify", np.random.default_rng(0)) == []
    (fuzz,) = import_tools("differential_fuzz")
    for exact, extra in ((["--exact-allocations"], 1), ([], 0)):
        out = tmp_path / f"fuzz{extra}.json"
        assert fuzz.main(["--device", "cpu", "--cases", "2", "--ops", "write", "scatter", "verify", "step", "--json",
                          str(out), *exact]) == 0
        ops = json.loads(out.read_text())["ops"]
        assert [ops[op]["cases"] for op in ("write", "scatter", "verify", "step")] == [2 + extra, 2 + 2 * extra, 2,
                                                                                       2 + extra]


def _writers_of_each_slot(case: dict) -> dict:
    """For each slot of the pool, the requests with an entry that writes it."""
    offsets, locs = case["offsets"], case["out_cache_loc"]
    writers: dict = {}
    for request in range(len(offsets) - 1):
        begin, end = max(int(offsets[request]), 0), min(int(offsets[request + 1]), len(locs))
        for slot in locs[begin:end].tolist():
            if 0 <= slot < case["pool"]["num_slots"]:
                writers.setdefault(slot, set()).add(request)
    return writers


def test_no_write_fuzz_case_names_one_slot_in_two_requests():
    """Two requests that write one slot race on a GPU (the engine never does it), so a case that
    held them would fail a correct kernel now and then. The write fuzz repeats a slot inside one
    request only, also where a span is cut after the slots are drawn: over test_gpu's own cases and
    more small ones."""
    streams = [(np.random.default_rng([2026, list(F.MAKERS).index("write")]), 150), (np.random.default_rng(77), 600)]
    repeated = 0
    for rng, count in streams:
        for i in range(count):
            case = F.make_write_case(rng, 200_000 if count == 150 and i % 50 == 49 else 3000)
            writers = _writers_of_each_slot(case)
            assert all(len(requests) == 1 for requests in writers.values()), f"case {i}"
            locs = case["out_cache_loc"]
            repeated += len(locs[(locs > 0) & (locs < case["pool"]["num_slots"])]) > len(writers)
    assert repeated > 50  # the repeats are still drawn

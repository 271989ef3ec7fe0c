"""kc.block_tables: a block table mirrored into the canary's slot table, and ForwardBatch from
cumulative offsets, on both backends; a vLLM-style engine whose batch rows move between forwards."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading

import numpy as np
import pytest

import kvcanary_cupy as kc
from _builders import one_forward
from _devices import BACKENDS, int64s_on, requires_gpu, to_device, to_numpy


def _expected_rows(table: np.ndarray, block_size: int, rows, first_block: int, target: np.ndarray) -> np.ndarray:
    """The slot table after the mirror, cell by cell."""
    want = target.copy()
    for index, row in enumerate(rows):
        for column, block in enumerate(table[index]):
            for offset in range(block_size):
                slot = int(block) * block_size + offset
                want[row, (first_block + column) * block_size + offset] = slot if 0 <= slot < 2**31 else -1
    return want


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("table_dtype", [np.int32, np.int64])
def test_mirror_writes_each_blocks_slots_into_its_canary_row(device, table_dtype):
    rng = np.random.default_rng(11)
    block_size, blocks = 16, 9
    start = rng.integers(-9, 2**20, size=(12, 40 * block_size), dtype=np.int32)  # never all zeros
    table = rng.integers(0, 4096, size=(7, 30), dtype=table_dtype)
    for rows, first_block, columns in [(None, 0, slice(None)), ([5, 2, 11, 1, 3, 8, 4], 7, slice(3, 3 + blocks))]:
        target = to_device(start, device)
        part = table[:, columns]
        kc.block_tables.mirror(target, block_table=to_device(part, device), block_size=block_size, rows=rows,
                               first_block=first_block)
        given_rows = range(1, 8) if rows is None else rows
        assert (to_numpy(target) == _expected_rows(part, block_size, given_rows, first_block, start)).all()


@pytest.mark.parametrize("device", BACKENDS)
def test_block_0_is_mirrored_to_the_first_slots(device):
    """Block 0 is a block like any other: its slots are 0 .. block_size - 1 (slot 0 the padding
    slot, SPEC §2); only negative ids and those whose slots int32 cannot hold are stored as -1."""
    rng = np.random.default_rng(87)
    start = rng.integers(1, 2**20, size=(3, 12), dtype=np.int32)
    req_to_token = to_device(start, device)
    table = np.array([[5, 0, 2], [0, 0, 9]], np.int32)
    kc.block_tables.mirror(req_to_token, block_table=to_device(table, device), block_size=4)
    held = to_numpy(req_to_token)
    assert held[1].tolist() == [20, 21, 22, 23, 0, 1, 2, 3, 8, 9, 10, 11]
    assert held[2].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 36, 37, 38, 39]
    assert held[0].tolist() == start[0].tolist()


@pytest.mark.parametrize("device", BACKENDS)
def test_a_block_whose_slots_int32_cannot_hold_is_read_as_out_of_range(device):
    """Block ids from 2**31 / block_size on, and negative ones, are stored as -1: their low 32 bits
    would name the padding slot (2**30 * 4 is 2**32) or another request's slot."""
    block_size = 4
    table = np.array([[3, 2**30, 7], [-1, 2**29 - 1, 2**29]], np.int64)
    req_to_token = to_device(np.zeros((3, 12), np.int32), device)
    kc.block_tables.mirror(req_to_token, block_table=to_device(table, device), block_size=block_size)
    held = to_numpy(req_to_token)
    assert held[1].tolist() == [12, 13, 14, 15, -1, -1, -1, -1, 28, 29, 30, 31]
    assert held[2, :4].tolist() == [-1] * 4 and held[2, 4:8].tolist() == [2**31 - 4, 2**31 - 3, 2**31 - 2, 2**31 - 1]
    assert (held[2, 8:] == -1).all()
    canary = kc.Canary(pool_slot_count=64, req_to_token=req_to_token, device=device,
                       capacities=kc.Capacities.from_args(req_to_token_pool_size=3, max_seq_len_per_req=12,
                                                          pool_slot_count=64, max_prefill_tokens=16))
    rng = np.random.default_rng(23)
    put = int64s_on(device)
    first = kc.ForwardBatch(req_pool_indices=put([1]), prefix_lens=put([0]), extend_seq_lens=put([4]),
                            input_ids=put(rng.integers(1, 1000, 4)), positions=put(range(4)),
                            out_cache_loc=put(range(12, 16)))
    one_forward(canary, first)
    assert canary.poll().total == 0
    reads = kc.ForwardBatch(req_pool_indices=put([1]), prefix_lens=put([6]), extend_seq_lens=put([0]),
                            input_ids=put([]), positions=put([]), out_cache_loc=put([]))
    one_forward(canary, reads)
    events = canary.poll().events
    assert events and all("OUT_OF_RANGE" in event.reasons for event in events)
    assert {event.position for event in events} <= {4, 5}


@pytest.mark.parametrize("device", BACKENDS)
def test_mirror_reads_a_strided_window_of_the_engines_table(device):
    rng = np.random.default_rng(12)
    engine_table = to_device(rng.integers(1, 500, size=(6, 20), dtype=np.int32), device)
    target = to_device(np.zeros((8, 64), np.int32), device)
    window = engine_table[1:5, 2:6]  # rows 1-4 of the engine's table, blocks 2-5: not contiguous
    kc.block_tables.mirror(target, block_table=window, block_size=4, rows=np.array([2, 3, 4, 5]), first_block=2)
    want = _expected_rows(to_numpy(window), 4, [2, 3, 4, 5], 2, np.zeros((8, 64), np.int32))
    assert (to_numpy(target) == want).all()


class _DeviceOnly:
    """Rows NumPy cannot read, as a CuPy array or a CUDA tensor."""

    def __len__(self):
        return 3

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed")


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("bad, words", [
    (dict(rows=[0, 1, 2]), "rows must be request rows in [1, 6) (row 0 is the padding row"),
    (dict(rows=[1, 6, 2]), "got rows[1] = 6"),
    (dict(rows=[1, 3, 3]), "rows must not name a row twice, got row 3 2 times"),
    (dict(rows=[1, 2]), "rows must have length 3"),
    # rows left to their default (1 .. count): a table of as many rows as req_to_token has one too many
    (dict(tall_table=True), "rows must be request rows in [1, 6) (row 0 is the padding row: block-table row r is "
                            "canary row r + 1), got rows[5] = 6"),
    (dict(rows=np.array([1.0, 2.0, 3.0])), "rows must hold integers"),
    # a 2-D array whose first dimension matches was taken whole: a row wrote several canary rows
    (dict(rows=np.array([[1, 4], [2, 5], [3, 0]])), "rows must be 1-D, got shape (3, 2)"),
    (dict(rows=np.int64(2)), "rows must be 1-D, got shape ()"),
    (dict(first_block=4), "req_to_token must be at least (first_block + blocks) * block_size = (4 + 2) * 4 = 24 wide"),
    (dict(first_block=-1), "first_block must be non-negative"),
    (dict(block_size=0), "block_size must be positive"),
    (dict(block_size=2.0), "block_size must be an int"),
    # past 2**31 a block's offsets do not fit in int32 (the kernel's bound then divides a negative)
    (dict(block_size=2**31 + 1), "block_size must be <= 2**31"),
    # a device array (CuPy's __array__ refuses): NumPy's own TypeError had no kv-canary: prefix
    (dict(rows=_DeviceOnly()), "rows must be host integers (a list, tuple or NumPy array), got _DeviceOnly"),
    (dict(block_table="table"), "block_table"),
    (dict(float_table=True), "block_table must have dtype int32 or int64, got float32"),
    (dict(flat_table=True), "block_table must be 2-D"),
    (dict(wide_target=True), "req_to_token must have dtype int32, got int64"),
])
def test_mirror_refuses_bad_arguments_and_changes_nothing(device, bad, words):
    rng = np.random.default_rng(13)
    start = rng.integers(1, 100, size=(6, 20), dtype=np.int32)
    target = to_device(start.astype(np.int64) if bad.pop("wide_target", False) else start, device)
    table = rng.integers(1, 50, size=(6 if bad.pop("tall_table", False) else 3, 2), dtype=np.int32)
    if bad.pop("float_table", False):
        table = table.astype(np.float32)
    if bad.pop("flat_table", False):
        table = table.ravel()
    arguments = dict(block_table=to_device(table, device), block_size=4)
    arguments.update(bad)
    with pytest.raises((TypeError, ValueError)) as caught:
        kc.block_tables.mirror(target, **arguments)
    assert str(caught.value).startswith("kv-canary: ") and words in str(caught.value)
    assert (to_numpy(target).astype(np.int32) == start).all()


@pytest.mark.parametrize("device", BACKENDS)
def test_mirror_takes_a_block_size_of_2_31(device):
    """The bound on ``block_size`` is inclusive: a block of 2**31 slots has offsets 0 .. 2**31 - 1,
    all of which int32 holds. A window of no columns needs no width and stores nothing."""
    rng = np.random.default_rng(81)
    start = rng.integers(1, 2**20, size=(3, 8), dtype=np.int32)
    target = to_device(start, device)
    kc.block_tables.mirror(target, block_table=to_device(np.empty((2, 0), np.int32), device), block_size=2**31)
    assert (to_numpy(target) == start).all()


def _as_strided(array, shape, strides, device):
    if device == "cpu":
        return np.lib.stride_tricks.as_strided(array, shape=shape, strides=strides)
    return kc._dlpack.cupy_module().lib.stride_tricks.as_strided(array, shape=shape, strides=strides)


@pytest.mark.parametrize("device", BACKENDS)
def test_mirror_refuses_a_table_whose_rows_overlap_and_changes_nothing(device):
    """Rows sharing cells (a short or zero row stride) would be stored by several GPU threads in no
    fixed order, where NumPy's assignment keeps the last row's."""
    memory = to_device(np.zeros(40, np.int32), device)
    table = to_device(np.array([[1, 2], [3, 4], [5, 6]], np.int32), device)
    for row_stride in (0, 4, 40):
        target = _as_strided(memory, (6, 20), (row_stride, 4), device)
        with pytest.raises(ValueError) as caught:
            kc.block_tables.mirror(target, block_table=table, block_size=4)
        assert str(caught.value).startswith("kv-canary: req_to_token rows must not overlap (row stride >= width "
                                            f"* itemsize = 80 bytes), got row stride {row_stride}")
        assert not to_numpy(memory).any()


@pytest.mark.parametrize("device", BACKENDS)
def test_mirror_refuses_a_block_table_inside_the_slot_table_and_changes_nothing(device):
    """A block table that is part of the slot table has threads read cells others store (NumPy
    reads the whole table before it stores)."""
    start = np.arange(6 * 20, dtype=np.int32).reshape(6, 20)
    target = to_device(start, device)
    with pytest.raises(ValueError) as caught:
        kc.block_tables.mirror(target, block_table=target[2:5, 0:2], block_size=4, first_block=1)
    assert str(caught.value).startswith("kv-canary: req_to_token and block_table must not share memory "
                                        "(req_to_token is stored into)")
    assert (to_numpy(target) == start).all()


@requires_gpu
def test_mirror_refuses_rows_on_the_device():
    target = to_device(np.zeros((6, 20), np.int32), "cuda")
    with pytest.raises(TypeError, match=r"^kv-canary: rows must be host integers .* got ndarray"):
        kc.block_tables.mirror(target, block_table=to_device(np.ones((3, 2), np.int32), "cuda"), block_size=4,
                               rows=to_device(np.array([1, 2, 3]), "cuda"))
    assert not to_numpy(target).any()


@requires_gpu
def test_mirror_refuses_arrays_on_two_devices():
    target = np.zeros((4, 8), np.int32)
    with pytest.raises(ValueError, match="kv-canary: all arrays of one call must be on one device"):
        kc.block_tables.mirror(target, block_table=to_device(np.ones((2, 2), np.int32), "cuda"), block_size=4)
    assert not target.any()


def _offsets_inputs(rng, dtype=np.int32):
    counts = np.array([3, 1, 0, 5, 1])
    cached = np.array([0, 17, 9, 4, 120])
    tokens = int(counts.sum())
    return dict(query_start_loc=np.concatenate([[0], np.cumsum(counts)]).astype(dtype),
                seq_lens=(cached + counts).astype(dtype),
                input_ids=rng.integers(1, 32000, size=tokens + 3).astype(dtype),  # a padded tail of 3
                positions=rng.integers(0, 200, size=tokens + 3).astype(np.int64),
                out_cache_loc=rng.integers(1, 4000, size=tokens + 3).astype(np.int64)), counts, cached


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_from_offsets_derives_the_lengths_and_widens_to_int64(device, dtype):
    rng = np.random.default_rng(14)
    inputs, counts, cached = _offsets_inputs(rng, dtype)
    given = {name: to_device(array, device) for name, array in inputs.items()}
    batch = kc.ForwardBatch.from_offsets(**given, req_ids=list("abcde"))
    assert to_numpy(batch.extend_seq_lens).tolist() == counts.tolist()
    assert to_numpy(batch.prefix_lens).tolist() == cached.tolist()
    assert to_numpy(batch.req_pool_indices).tolist() == [1, 2, 3, 4, 5]
    for name in ("input_ids", "positions", "out_cache_loc"):
        field = getattr(batch, name)
        assert field.dtype == np.int64 and (to_numpy(field) == inputs[name]).all()
    assert batch.req_ids == list("abcde")
    # int64 arrays are the batch's own, not copies: the engine's later refills show, as for any batch
    assert kc._dlpack.data_pointer(batch.out_cache_loc) == kc._dlpack.data_pointer(given["out_cache_loc"])
    rows = to_device(np.array([4, 9, 2, 7, 3], dtype), device)
    expected = to_device(inputs["input_ids"].astype(np.int64), device)
    batch = kc.block_tables.forward_batch(**given, req_pool_indices=rows, expected_input_tokens=expected,
                                          expected_input_positions=given["positions"])
    assert to_numpy(batch.req_pool_indices).tolist() == [4, 9, 2, 7, 3]
    assert batch.expected_input_tokens is expected


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("change, words, values", [
    (dict(query_start_loc=np.array([0, 3, 4, 4, 9], np.int32)), "query_start_loc must have length 6", False),
    (dict(query_start_loc=np.array([1, 4, 5, 5, 10, 11], np.int32)), "query_start_loc must start at 0", True),
    (dict(query_start_loc=np.array([0, 4, 3, 3, 9, 10], np.int32)), "never decrease", True),
    (dict(query_start_loc=np.array([0, 3, 4, 4, 9, 14], np.int32)), "end within the 13 tokens of input_ids, "
     "positions and out_cache_loc", True),
    (dict(input_ids=np.arange(9, dtype=np.int32)), "end within the 9 tokens of input_ids, got", True),
    (dict(seq_lens=np.array([3, 18, 9, 4, 121], np.int32)), "seq_lens must be at least each request's new", True),
    (dict(seq_lens=np.array([3.0, 18, 9, 9, 121])), "seq_lens must have dtype int32 or int64, got float64", False),
    (dict(input_ids=np.ones((2, 7), np.int32)), "input_ids must be 1-D", False),
    (dict(req_pool_indices=np.array([1, 2, 3], np.int64)), "req_pool_indices must have length 5", False),
    (dict(flip=np.zeros(3)), "forward_batch takes ForwardBatch's optional fields", False),
    (dict(prefix_lens=np.zeros(5, np.int64)), "got 'prefix_lens'", False),
])
def test_from_offsets_refuses_bad_arguments(device, change, words, values):
    """Shapes, dtypes and keywords on both backends; values only where they are on the host (a GPU's
    would cost a wait: they surface at the next poll)."""
    inputs, _, _ = _offsets_inputs(np.random.default_rng(15))
    inputs.update(change)
    given = {name: to_device(array, device) for name, array in inputs.items()}
    if values and device != "cpu":
        kc.ForwardBatch.from_offsets(**given)
        return
    with pytest.raises((TypeError, ValueError)) as caught:
        kc.ForwardBatch.from_offsets(**given)
    assert str(caught.value).startswith("kv-canary: ") and words in str(caught.value)


# --- an engine with a persistent batch: block-table rows are batch rows, and they move ----------------
class _PersistentBatchEngine:
    """Requests in batch rows ``0 .. n-1`` of an int32 block table; a finished request's row is
    filled by the last one (the table's rows move, as a condensing engine's do), and each forward is
    described by int32 ``query_start_loc`` and ``seq_lens``. ``mirror`` is called for the rows a
    forward changed; ``freed_early`` returns one block of a live request to the free list."""

    def __init__(self, device: str, seed: int, block_size: int = 4, blocks: int = 96):
        self.device, self.block_size = device, block_size
        self.rng = np.random.default_rng(seed)
        self.table = np.zeros((6, 16), np.int32)
        self.free = list(range(1, blocks))
        self.live: list = []  # per batch row: dict(name, tokens, cached, blocks)
        self.req_to_token = to_device(np.zeros((7, 16 * block_size), np.int32), device)
        self.canary = kc.Canary(pool_slot_count=blocks * block_size, req_to_token=self.req_to_token, device=device,
                                capacities=kc.Capacities.from_args(req_to_token_pool_size=7,
                                                                   max_seq_len_per_req=16 * block_size,
                                                                   pool_slot_count=blocks * block_size,
                                                                   max_prefill_tokens=64),
                                chain_position_assert=True)
        self.names = 0

    def _mirror(self, rows: list) -> None:
        if rows:
            window = np.ascontiguousarray(self.table[rows])
            kc.block_tables.mirror(self.req_to_token, block_table=to_device(window, self.device),
                                   block_size=self.block_size, rows=[row + 1 for row in rows])

    def admit(self, prompt_tokens: int) -> None:
        self.names += 1
        self.live.append(dict(name=f"r{self.names}", tokens=list(self.rng.integers(1, 32000, prompt_tokens)),
                              cached=0, blocks=[]))

    def finish(self, index: int) -> list:
        """Frees batch row ``index``; the last row moves into it. The rows that changed."""
        self.free.extend(self.live[index]["blocks"])
        last = len(self.live) - 1
        self.live[index] = self.live[last]
        self.table[index] = self.table[last]
        self.table[last] = 0
        self.live.pop()
        return [index] if index < last else []

    def forward(self, changed: list, chunk: int = 5) -> None:
        counts, ids, positions, slots = [], [], [], []
        for row, request in enumerate(self.live):
            count = min(chunk, len(request["tokens"]) - request["cached"]) or 1
            start = request["cached"]
            while len(request["blocks"]) * self.block_size < start + count:
                request["blocks"].append(self.free.pop(0))
                self.table[row, len(request["blocks"]) - 1] = request["blocks"][-1]
                changed.append(row)
            pos = np.arange(start, start + count)
            counts.append(count)
            ids.append(np.asarray(request["tokens"][start:start + count]))
            positions.append(pos)
            slots.append(self.table[row, pos // self.block_size].astype(np.int64) * self.block_size
                         + pos % self.block_size)
        self._mirror(sorted(set(changed)))
        # a padded tail, as a captured graph's batch has: slots of live requests, which must not be written
        ids.append(self.rng.integers(1, 32000, 3))
        positions.append(np.arange(3))
        slots.append(np.array([self.block_size * self.live[0]["blocks"][0] + offset for offset in range(3)]))
        put = lambda parts, dtype: to_device(np.concatenate(parts).astype(dtype), self.device)  # noqa: E731
        batch = kc.ForwardBatch.from_offsets(
            query_start_loc=to_device(np.cumsum([0] + counts).astype(np.int32), self.device),
            seq_lens=to_device(np.array([r["cached"] + c for r, c in zip(self.live, counts)], np.int32), self.device),
            input_ids=put(ids, np.int32), positions=put(positions, np.int64), out_cache_loc=put(slots, np.int64),
            req_ids=[request["name"] for request in self.live])
        one_forward(self.canary, batch)
        for request, count in zip(self.live, counts):
            request["cached"] += count
            if request["cached"] >= len(request["tokens"]):
                request["tokens"].append(int(self.rng.integers(1, 32000)))


@pytest.mark.parametrize("device", BACKENDS)
def test_a_condensing_engine_runs_clean_and_a_block_freed_early_is_named(device):
    engine = _PersistentBatchEngine(device, seed=16)
    for tokens in (13, 6, 9, 21):
        engine.admit(tokens)
    changed: list = []
    for forward in range(14):
        if forward in (4, 9):
            changed += engine.finish(1)  # the last request moves into row 1
        if forward in (5, 10):
            engine.admit(int(engine.rng.integers(3, 20)))
        engine.forward(changed)
        changed = []
    report = engine.canary.poll()
    assert report.total == 0 and report.forwards == 14

    # A block of a live request goes back on the free list and a new request's prompt takes it.
    victim = engine.live[0]
    engine.admit(engine.block_size)
    engine.live[-1]["blocks"] = [victim["blocks"][0]]
    engine.table[len(engine.live) - 1, 0] = victim["blocks"][0]
    engine.forward([len(engine.live) - 1])
    engine.forward([])
    report = engine.canary.poll()
    assert report.total > 0 and victim["name"] in report.requests
    named = {event.request for event in report}
    assert named <= {victim["name"]}, named


@pytest.mark.parametrize("device", BACKENDS)
def test_torch_tensors_are_mirrored_into_and_batched_in_place(device):
    torch = pytest.importorskip("torch")
    where = "cuda" if device == "cuda" else "cpu"
    rng = np.random.default_rng(17)
    table = rng.integers(1, 300, size=(3, 5), dtype=np.int32)
    target = torch.zeros((4, 24), dtype=torch.int32, device=where)
    kc.block_tables.mirror(target, block_table=torch.from_numpy(table).to(where), block_size=4, first_block=1)
    assert (target.cpu().numpy() == _expected_rows(table, 4, [1, 2, 3], 1, np.zeros((4, 24), np.int32))).all()
    inputs, counts, cached = _offsets_inputs(rng)
    batch = kc.ForwardBatch.from_offsets(**{name: torch.from_numpy(array).to(where) for name, array in inputs.items()})
    assert to_numpy(batch.extend_seq_lens).tolist() == counts.tolist()
    assert to_numpy(batch.prefix_lens).tolist() == cached.tolist()


# --- refill: a bound batch's arrays, in place --------------------------------------------------------
def _bound_batch(device, bs: int, tokens: int):
    """A batch of int64 arrays an engine binds once (filled with junk, never zeros)."""
    junk = lambda size: to_device(np.full(size, -77, np.int64), device)  # noqa: E731
    return kc.ForwardBatch(req_pool_indices=junk(bs), prefix_lens=junk(bs), extend_seq_lens=junk(bs),
                           input_ids=junk(tokens), positions=junk(tokens), out_cache_loc=junk(tokens))


@pytest.mark.parametrize("device", BACKENDS)
def test_refill_fills_a_bound_batch_in_place(device):
    rng = np.random.default_rng(18)
    inputs, counts, cached = _offsets_inputs(rng)
    batch = _bound_batch(device, 5, 20)
    addresses = {name: kc._dlpack.data_pointer(getattr(batch, name)) for name in ("prefix_lens", "input_ids")}
    rows = to_device(np.array([3, 1, 4, 6, 2], np.int32), device)
    kc.block_tables.refill(batch, **{name: to_device(array, device) for name, array in inputs.items()},
                           req_pool_indices=rows)
    assert to_numpy(batch.extend_seq_lens).tolist() == counts.tolist()
    assert to_numpy(batch.prefix_lens).tolist() == cached.tolist()
    assert to_numpy(batch.req_pool_indices).tolist() == [3, 1, 4, 6, 2]
    for name in ("input_ids", "positions", "out_cache_loc"):
        held = to_numpy(getattr(batch, name))
        assert (held[:13] == inputs[name]).all() and (held[13:] == -77).all()  # the rest as it was
    assert {name: kc._dlpack.data_pointer(getattr(batch, name)) for name in addresses} == addresses
    # the batch's own arrays given back to it (an engine that fills them itself) stay as they are
    ids = to_numpy(batch.input_ids).copy()
    kc.block_tables.refill(batch, query_start_loc=to_device(inputs["query_start_loc"], device),
                           seq_lens=to_device(inputs["seq_lens"], device), input_ids=batch.input_ids,
                           positions=batch.positions, out_cache_loc=batch.out_cache_loc,
                           req_pool_indices=batch.req_pool_indices)
    assert (to_numpy(batch.input_ids) == ids).all()
    assert to_numpy(batch.req_pool_indices).tolist() == [3, 1, 4, 6, 2]


@pytest.mark.parametrize("device", BACKENDS)
def test_offsets_of_mixed_dtypes_and_strides_give_the_same_batch(device):
    rng = np.random.default_rng(19)
    inputs, counts, cached = _offsets_inputs(rng)
    spread = np.zeros(2 * 6, np.int64)
    spread[::2] = inputs["query_start_loc"]  # every other element: a strided view
    given = dict(inputs, query_start_loc=to_device(spread, device)[::2],
                 seq_lens=to_device(inputs["seq_lens"].astype(np.int64), device),
                 input_ids=to_device(np.repeat(inputs["input_ids"], 2), device)[::2],
                 positions=to_device(inputs["positions"].astype(np.int32), device),
                 out_cache_loc=to_device(inputs["out_cache_loc"], device),
                 req_pool_indices=to_device(np.array([5, 4, 3, 2, 1], np.int32), device))
    batch = kc.ForwardBatch.from_offsets(**given)
    assert to_numpy(batch.extend_seq_lens).tolist() == counts.tolist()
    assert to_numpy(batch.prefix_lens).tolist() == cached.tolist()
    assert to_numpy(batch.req_pool_indices).tolist() == [5, 4, 3, 2, 1]
    for name in ("input_ids", "positions", "out_cache_loc"):
        assert (to_numpy(getattr(batch, name)) == inputs[name]).all()


def _rows_shifted_by_one(batch, given):
    """The batch's rows in cells 0-4 of a buffer of 6, the rows given in cells 1-5."""
    device = "cpu" if isinstance(batch.req_pool_indices, np.ndarray) else "cuda"
    memory = to_device(np.full(6, -77, np.int64), device)
    return dataclasses.replace(batch, req_pool_indices=memory[:5]), dict(given, req_pool_indices=memory[1:])


def _rows_backward_over_the_last_prefix_len(batch, given):
    """The batch's prefix lengths in cells 0-4 of a buffer of 9, the rows given backwards over cells
    4-8: they share cell 4 alone, the lowest the backward view reaches, not the one it starts at."""
    device = "cpu" if isinstance(batch.req_pool_indices, np.ndarray) else "cuda"
    memory = to_device(np.full(9, -77, np.int64), device)
    return dataclasses.replace(batch, prefix_lens=memory[:5]), dict(given, req_pool_indices=memory[4:][::-1])


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("spoil, words", [
    (lambda batch, given: (batch, dict(given, req_pool_indices=batch.prefix_lens)),
     "batch.prefix_lens and req_pool_indices must not share memory (batch.prefix_lens is stored into)"),
    (lambda batch, given: (batch, dict(given, req_pool_indices=batch.extend_seq_lens[::-1])),
     "batch.extend_seq_lens and req_pool_indices must not share memory"),
    # rows read and stored in place must be the same cells: a reversed, shifted or int32 view of
    # the batch's rows has GPU threads store cells others have yet to read (NumPy copies first)
    (lambda batch, given: (batch, dict(given, req_pool_indices=batch.req_pool_indices[::-1])),
     "batch.req_pool_indices and req_pool_indices must be the same array (same dtype, address, length and stride"),
    (lambda batch, given: (batch, dict(given, req_pool_indices=batch.req_pool_indices.view(np.int32)[:5])),
     "batch.req_pool_indices and req_pool_indices must be the same array"),
    (lambda batch, given: _rows_shifted_by_one(batch, given),
     "batch.req_pool_indices and req_pool_indices must be the same array"),
    (lambda batch, given: _rows_backward_over_the_last_prefix_len(batch, given),
     "batch.prefix_lens and req_pool_indices must not share memory (batch.prefix_lens is stored into)"),
    (lambda batch, given: (batch, dict(given, req_pool_indices=_as_strided(
        batch.req_pool_indices, (5,), (0,), "cpu" if isinstance(batch.req_pool_indices, np.ndarray) else "cuda"))),
     "batch.req_pool_indices and req_pool_indices must be the same array"),
    (lambda batch, given: (dataclasses.replace(batch, prefix_lens=batch.extend_seq_lens), given),
     "batch.prefix_lens and batch.extend_seq_lens must not share memory"),
    (lambda batch, given: (dataclasses.replace(batch, input_ids=batch.input_ids[:12]), given),
     "batch.input_ids must be at least as long as the input_ids given (13), got 12"),
    (lambda batch, given: (dataclasses.replace(batch, prefix_lens=batch.prefix_lens[:4]), given),
     "batch.prefix_lens must have length 5"),
    (lambda batch, given: (dataclasses.replace(batch, positions=batch.positions.astype(np.int32)), given),
     "batch.positions must have dtype int64, got int32"),
    (lambda batch, given: ("batch", given), "batch must be a ForwardBatch"),
])
def test_refill_refuses_a_batch_it_cannot_fill_and_changes_nothing(device, spoil, words):
    inputs, _, _ = _offsets_inputs(np.random.default_rng(20))
    batch, given = spoil(_bound_batch(device, 5, 20), {name: to_device(array, device) for name, array in inputs.items()})
    with pytest.raises((TypeError, ValueError)) as caught:
        kc.block_tables.refill(batch, **given)
    assert str(caught.value).startswith("kv-canary: ") and words in str(caught.value)
    if not isinstance(batch, str):
        for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids"):
            assert (to_numpy(getattr(batch, name)) == -77).all()


def _one_request_inputs(rng: np.random.Generator, count: int, device) -> dict:
    """What refill takes for one request of ``count`` new tokens past 7 cached, but its rows."""
    given = dict(query_start_loc=np.array([0, count], np.int64), seq_lens=np.array([count + 7], np.int64),
                 input_ids=rng.integers(1, 32000, size=count), positions=rng.integers(0, 200, size=count),
                 out_cache_loc=rng.integers(1, 4000, size=count))
    return {name: to_device(array, device) for name, array in given.items()}


@pytest.mark.parametrize("device", BACKENDS)
def test_refill_refuses_the_rows_of_a_one_request_batch_read_as_int32(device):
    """One request's row read in place must be the batch's own int64 cell: an int32 view of it has
    the same address, length and (unused) stride, but reads half the cell it stores."""
    rng = np.random.default_rng(91)
    count = int(rng.integers(2, 6))
    batch = _bound_batch(device, 1, count)
    given = _one_request_inputs(rng, count, device)
    with pytest.raises(ValueError, match=r"^kv-canary: batch\.req_pool_indices and req_pool_indices must be the same "
                                         r"array \(same dtype"):
        kc.block_tables.refill(batch, **given, req_pool_indices=batch.req_pool_indices.view(np.int32)[:1])
    for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids"):
        assert (to_numpy(getattr(batch, name)) == -77).all()


@pytest.mark.parametrize("device", BACKENDS)
def test_refill_takes_the_rows_of_a_one_request_batch_in_place_whatever_their_stride(device):
    """One request's row read in place is the same cell whatever stride its view reports (a stride
    moves nothing in an array of one element): taken, and the batch filled."""
    rng = np.random.default_rng(92)
    count = int(rng.integers(2, 6))
    batch = _bound_batch(device, 1, count)
    batch.req_pool_indices[0] = 3
    given = _one_request_inputs(rng, count, device)
    rows = _as_strided(batch.req_pool_indices, (1,), (24,), device)
    kc.block_tables.refill(batch, **given, req_pool_indices=rows)
    assert to_numpy(batch.req_pool_indices).tolist() == [3]
    assert to_numpy(batch.extend_seq_lens).tolist() == [count] and to_numpy(batch.prefix_lens).tolist() == [7]
    assert (to_numpy(batch.input_ids) == to_numpy(given["input_ids"])).all()


@requires_gpu
def test_the_gpu_gives_the_cpus_bits_whatever_the_values():
    """Block ids past the pool and negative, offsets that fall and lengths near int64's ends (the
    host checks only host values): the kernels' arithmetic gives NumPy's bits."""
    from kvcanary_cupy._dlpack import parse_device
    from kvcanary_cupy.ops._dispatch import backend_module
    cpu, cuda = (backend_module(parse_device(name), "block_tables") for name in ("cpu", "cuda"))
    rng = np.random.default_rng(21)
    edges = np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min, -1, 0, 2**31, -2**31 - 1], np.int64)
    for dtype in (np.int32, np.int64):
        table = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, size=(9, 7), dtype=dtype, endpoint=True)
        table.ravel()[:6] = edges.astype(dtype)
        rows = rng.permutation(np.arange(1, 12))[:9].astype(np.int64)
        start = rng.integers(-5, 5, size=(12, 64), dtype=np.int32)
        want = start.copy()
        cpu.mirror(want, table, rows, 8, 1)
        got = to_device(start, "cuda")
        cuda.mirror(got, to_device(table, "cuda"), to_device(rows, "cuda"), 8, 1,
                    stream=kc._dlpack.cupy_module().cuda.get_current_stream())
        assert (to_numpy(got) == want).all()
    stream = kc._dlpack.cupy_module().cuda.get_current_stream()
    for starts_dtype, lens_dtype, row_dtype, token_dtype in itertools.product((np.int32, np.int64), repeat=4):
        starts = np.concatenate([edges, rng.integers(-2**40, 2**40, 30)]).astype(starts_dtype)
        lens = rng.integers(np.iinfo(lens_dtype).min, np.iinfo(lens_dtype).max, size=starts.size - 1,
                            dtype=lens_dtype, endpoint=True)
        given_rows = rng.integers(-2**31, 2**31 - 1, size=lens.size).astype(row_dtype)
        sources = [rng.integers(np.iinfo(token_dtype).min, np.iinfo(token_dtype).max, size=count, dtype=token_dtype,
                                endpoint=True) for count in (5, 0, 300)]
        for rows_given in (given_rows, None):
            want = [np.zeros(lens.size, np.int64) for _ in range(3)]
            want_tokens = [np.full(count + 2, 7, np.int64) for count in (5, 0, 300)]
            cpu.fill(starts, lens, rows_given, *want, list(zip(sources, want_tokens)))
            got = [to_device(np.zeros(lens.size, np.int64), "cuda") for _ in range(3)]
            got_tokens = [to_device(np.full(count + 2, 7, np.int64), "cuda") for count in (5, 0, 300)]
            cuda.fill(to_device(starts, "cuda"), to_device(lens, "cuda"),
                      None if rows_given is None else to_device(rows_given, "cuda"), *got,
                      [(to_device(source, "cuda"), out) for source, out in zip(sources, got_tokens)], stream=stream)
            for mine, theirs in zip(got + got_tokens, want + want_tokens):
                assert (to_numpy(mine) == theirs).all()


@requires_gpu
def test_refill_is_captured_in_a_cuda_graph_and_replays_new_values():
    cupy = kc._dlpack.cupy_module()
    rng = np.random.default_rng(22)
    inputs, _, _ = _offsets_inputs(rng)
    given = {name: to_device(array, "cuda") for name, array in inputs.items()}
    batch = _bound_batch("cuda", 5, 20)
    stream = cupy.cuda.Stream(non_blocking=True)
    kc.block_tables.refill(batch, **given, stream=stream)  # kernels loaded before the capture, as for any op
    with stream:
        stream.begin_capture()
        kc.block_tables.refill(batch, **given, stream=stream)
        graph = stream.end_capture()
    for seed in range(3):
        fresh, counts, cached = _offsets_inputs(np.random.default_rng(100 + seed))
        fresh["seq_lens"] = fresh["seq_lens"] + seed  # other lengths each step
        with stream:  # refilled in place on the graph's stream, before it reads them
            for name, array in fresh.items():
                given[name][...] = to_device(array, "cuda")
        graph.launch(stream)
        stream.synchronize()
        assert to_numpy(batch.prefix_lens).tolist() == (cached + seed).tolist()
        assert (to_numpy(batch.input_ids)[:13] == fresh["input_ids"][:13]).all()


def test_from_offsets_refuses_more_request_ids_than_requests():
    inputs, _, _ = _offsets_inputs(np.random.default_rng(24))
    with pytest.raises(ValueError, match="kv-canary: req_ids must have at most one id per batch row"):
        kc.ForwardBatch.from_offsets(**inputs, req_ids=list("abcdef"))


@pytest.mark.parametrize("device", BACKENDS)
def test_unmirrored_names_each_row_the_engine_forgot_and_its_first_position(device):
    rng = np.random.default_rng(25)
    block_size = 4
    table = rng.integers(1, 500, size=(4, 6), dtype=np.int32)
    req_to_token = to_device(np.zeros((6, 6 * block_size), np.int32), device)
    engine_table = to_device(table, device)
    kc.block_tables.mirror(req_to_token, block_table=engine_table, block_size=block_size, rows=[2, 5, 1, 3])
    lens = np.array([24, 9, 0, 17])
    arguments = dict(block_table=engine_table, block_size=block_size, rows=[2, 5, 1, 3])
    assert kc.block_tables.unmirrored(req_to_token, seq_lens=lens, **arguments) == []
    table[1, 1] += 1        # a block appended or swapped, never mirrored: positions 4-7 of canary row 5
    table[2, 0] += 1        # row 1 holds no tokens yet: nothing read, nothing to say
    table[3, 5] += 1        # past row 3's 17 tokens: never read
    changed = to_device(table, device)
    found = kc.block_tables.unmirrored(req_to_token, seq_lens=to_device(lens, device), block_table=changed,
                                       block_size=block_size, rows=[2, 5, 1, 3])
    assert found == [(5, 4)]
    with pytest.raises(ValueError, match=r"kv-canary: seq_lens must be in \[0, blocks \* block_size = 24\]"):
        kc.block_tables.unmirrored(req_to_token, seq_lens=np.array([25, 0, 0, 0]), **arguments)
    with pytest.raises(ValueError, match="kv-canary: seq_lens must have length 4"):
        kc.block_tables.unmirrored(req_to_token, seq_lens=np.array([1, 2, 3]), **arguments)


def test_unmirrored_only_reads_the_slot_table():
    """``unmirrored`` stores nothing, so a read-only slot table (a snapshot, a read-only DLPack
    export) is checked as any other; ``mirror`` of the same arrays still refuses it, the arrays
    passed to ``unmirrored`` before notwithstanding."""
    table = np.array([[3, 4], [5, 6]], np.int32)
    req_to_token = np.zeros((3, 8), np.int32)
    kc.block_tables.mirror(req_to_token, block_table=table, block_size=4)
    req_to_token.setflags(write=False)
    assert kc.block_tables.unmirrored(req_to_token, block_table=table, block_size=4, seq_lens=np.array([8, 5])) == []
    table[1, 1] = 7
    assert kc.block_tables.unmirrored(req_to_token, block_table=table, block_size=4,
                                      seq_lens=np.array([8, 5])) == [(2, 4)]
    with pytest.raises(ValueError, match="^kv-canary: req_to_token must be writable"):
        kc.block_tables.mirror(req_to_token, block_table=table, block_size=4)


@pytest.mark.parametrize("device", BACKENDS)
def test_a_bound_refill_fills_from_what_the_arrays_hold_at_each_launch(device):
    inputs, _, _ = _offsets_inputs(np.random.default_rng(26))
    given = {name: to_device(array, device) for name, array in inputs.items()}
    rows = to_device(np.array([2, 4, 1, 5, 3], np.int64), device)
    batch = _bound_batch(device, 5, 20)
    bound = kc.block_tables.Refill(batch, **given, req_pool_indices=rows)
    for seed in range(3):
        fresh, counts, cached = _offsets_inputs(np.random.default_rng(200 + seed))
        fresh["seq_lens"] = fresh["seq_lens"] + seed
        for name, array in fresh.items():
            given[name][...] = to_device(array, device)  # the engine refills its arrays in place
        rows[...] = to_device(np.roll([2, 4, 1, 5, 3], seed), device)
        bound.launch()
        assert to_numpy(batch.prefix_lens).tolist() == (cached + seed).tolist()
        assert to_numpy(batch.extend_seq_lens).tolist() == counts.tolist()
        assert to_numpy(batch.req_pool_indices).tolist() == np.roll([2, 4, 1, 5, 3], seed).tolist()
        for name in ("input_ids", "positions", "out_cache_loc"):
            assert (to_numpy(getattr(batch, name))[:13] == fresh[name]).all()
    with pytest.raises(ValueError, match="kv-canary: batch.prefix_lens must have length 5"):
        kc.block_tables.Refill(dataclasses.replace(batch, prefix_lens=batch.prefix_lens[:4]), **given)
    if device == "cpu":  # host values are checked at every launch, before anything is stored
        held = batch.prefix_lens.copy()
        given["query_start_loc"][2] = 0
        with pytest.raises(ValueError, match="kv-canary: query_start_loc must start at 0, never decrease"):
            bound.launch()
        assert (batch.prefix_lens == held).all()


@pytest.mark.parametrize("device", BACKENDS)
def test_calls_of_one_geometry_each_fill_from_their_own_arrays(device):
    """An engine calling each step with arrays of the same dtypes, shapes and strides: the checks
    and the packed launch of the first call serve the later ones (kept by geometry, never by the
    arrays), and each call still reads and stores its own arrays: fresh ones, the same buffers
    refilled, the batch's rows read in place, or rows of 1 .. bs."""
    batch = _bound_batch(device, 5, 20)
    engine_rows = to_device(np.zeros(5, np.int64), device)
    for step in range(8):
        inputs, counts, cached = _offsets_inputs(np.random.default_rng(300 + step))
        inputs["seq_lens"] = inputs["seq_lens"] + step
        given = {name: to_device(array, device) for name, array in inputs.items()}
        order = np.roll([3, 1, 4, 6, 2], step)
        if step % 4 == 0:
            rows, want_rows = None, [1, 2, 3, 4, 5]
        elif step % 4 == 1:  # the batch's own rows, refilled by the engine, read in place
            batch.req_pool_indices[...] = to_device(order, device)
            rows, want_rows = batch.req_pool_indices, order.tolist()
        else:  # the engine's own buffer, or a fresh array, of the same geometry
            rows = engine_rows if step % 4 == 2 else to_device(np.zeros(5, np.int64), device)
            rows[...] = to_device(order, device)
            want_rows = order.tolist()
        made = kc.ForwardBatch.from_offsets(**given, req_pool_indices=rows)
        kc.block_tables.refill(batch, **given, req_pool_indices=rows)
        for filled in (made, batch):
            assert to_numpy(filled.prefix_lens).tolist() == (cached + step).tolist()
            assert to_numpy(filled.extend_seq_lens).tolist() == counts.tolist()
            assert to_numpy(filled.req_pool_indices).tolist() == want_rows
            for name in ("input_ids", "positions", "out_cache_loc"):
                assert (to_numpy(getattr(filled, name))[:inputs[name].size] == inputs[name]).all()


@pytest.mark.parametrize("device", BACKENDS)
def test_mirrors_of_one_geometry_each_write_their_own_rows(device):
    """Block tables of one shape mirrored call after call (the checks and the packed launch of the
    first serving the others): each call's table, rows and window land where they say, and the
    rows' values are checked at every call."""
    rng = np.random.default_rng(29)
    start = rng.integers(-9, 2**20, size=(10, 64), dtype=np.int32)
    target = to_device(start, device)
    want = start.copy()
    for step in range(6):
        table = rng.integers(0, 1 << 16, size=(3, 2), dtype=np.int32)
        rows = None if step % 3 == 0 else rng.permutation(np.arange(1, 10))[:3].tolist()
        first_block = step % 2
        kc.block_tables.mirror(target, block_table=to_device(table, device), block_size=4, rows=rows,
                               first_block=first_block)
        want = _expected_rows(table, 4, range(1, 4) if rows is None else rows, first_block, want)
        assert (to_numpy(target) == want).all()
    with pytest.raises(ValueError, match="kv-canary: rows "):
        kc.block_tables.mirror(target, block_table=to_device(table, device), block_size=4, rows=[1, 1, 2])
    with pytest.raises(ValueError, match="kv-canary: rows "):
        kc.block_tables.mirror(target, block_table=to_device(table, device), block_size=4, rows=[0, 1, 10])
    assert (to_numpy(target) == want).all()


@pytest.mark.parametrize("device", BACKENDS)
def test_threads_calling_with_arrays_of_one_geometry_each_get_their_own(device):
    """Four threads (each with a stream of its own on a GPU) refill batches and build them from
    arrays of one geometry at once: the checks and launches kept by geometry are shared, the
    addresses each launch takes are the calling thread's own."""
    failures = []

    def engine(seed: int) -> None:
        cupy = None if device == "cpu" else kc._dlpack.cupy_module()
        stream = None if cupy is None else cupy.cuda.Stream(non_blocking=True)
        batch = _bound_batch(device, 5, 20)
        try:
            for step in range(40):
                inputs, counts, cached = _offsets_inputs(np.random.default_rng(1000 * seed + step))
                inputs["seq_lens"] = inputs["seq_lens"] + seed * 100 + step
                with (stream if stream is not None else contextlib.nullcontext()):
                    given = {name: to_device(array, device) for name, array in inputs.items()}
                    made = kc.ForwardBatch.from_offsets(**given, stream=stream)
                    kc.block_tables.refill(batch, **given, stream=stream)
                if stream is not None:
                    stream.synchronize()
                for filled in (made, batch):
                    assert to_numpy(filled.prefix_lens).tolist() == (cached + seed * 100 + step).tolist()
                    assert (to_numpy(filled.input_ids)[:inputs["input_ids"].size] == inputs["input_ids"]).all()
        except Exception as error:  # noqa: BLE001 (reported by the main thread)
            failures.append(error)

    threads = [threading.Thread(target=engine, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_call_like_a_checked_one_but_where_it_matters_is_refused(device):
    """Checks passed once are skipped only for arrays alike in all they read: the same shapes over
    memory that overlaps, or values the host can read, are refused as on a first call."""
    inputs, _, _ = _offsets_inputs(np.random.default_rng(28))
    given = {name: to_device(array, device) for name, array in inputs.items()}
    batch = _bound_batch(device, 5, 20)
    for _ in range(2):
        kc.block_tables.refill(batch, **given)
        kc.ForwardBatch.from_offsets(**given)
    held = to_numpy(batch.prefix_lens).copy()
    spoiled = dataclasses.replace(batch, extend_seq_lens=batch.prefix_lens)  # same geometry, shared cells
    with pytest.raises(ValueError, match="kv-canary: batch.prefix_lens and batch.extend_seq_lens must not share"):
        kc.block_tables.refill(spoiled, **given)
    with pytest.raises(ValueError, match="kv-canary: batch.prefix_lens and req_pool_indices must not share"):
        kc.block_tables.refill(batch, **given, req_pool_indices=batch.prefix_lens)
    assert (to_numpy(batch.prefix_lens) == held).all()
    if device == "cpu":
        batch.positions.flags.writeable = False
        with pytest.raises(ValueError, match="kv-canary: batch.positions must be writable"):
            kc.block_tables.refill(batch, **given)
        given["query_start_loc"][1] = 9
        with pytest.raises(ValueError, match="kv-canary: query_start_loc must start at 0, never decrease"):
            kc.ForwardBatch.from_offsets(**given)


@pytest.mark.parametrize("dtype", ["V0", []])
def test_from_offsets_refuses_an_array_of_a_dtype_of_no_bytes(dtype):
    """A dtype of itemsize 0 has no alignment to read: the dtype rule refuses it, as for any other."""
    inputs, _, _ = _offsets_inputs(np.random.default_rng(31))
    for name in ("query_start_loc", "input_ids"):
        kc.block_tables._PASSED.clear()
        with pytest.raises(TypeError, match=f"^kv-canary: {name} must have dtype int32 or int64, got void"):
            kc.ForwardBatch.from_offsets(**{**inputs, name: np.zeros(6, dtype)})


@pytest.mark.parametrize("device", BACKENDS)
def test_a_bound_refill_reads_and_stores_what_was_checked_whatever_is_done_to_the_arrays(device):
    """The caller's array objects reshaped in place after binding (``a.shape = ...``) leave the
    launches as bound: Refill keeps views of its own, as every bundle kept across calls."""
    inputs, counts, cached = _offsets_inputs(np.random.default_rng(31))
    given = {name: to_device(array, device) for name, array in inputs.items()}
    batch = _bound_batch(device, 5, 20)
    bound = kc.block_tables.Refill(batch, **given)
    given["input_ids"].shape = (1, inputs["input_ids"].size)
    batch.prefix_lens.shape = (5, 1)
    bound.launch()
    assert to_numpy(batch.prefix_lens).ravel().tolist() == cached.tolist()
    assert to_numpy(batch.extend_seq_lens).tolist() == counts.tolist()
    assert (to_numpy(batch.input_ids)[:inputs["input_ids"].size] == inputs["input_ids"]).all()


@pytest.mark.parametrize("device", BACKENDS)
def test_refill_refuses_a_batch_without_a_field_it_fills(device):
    inputs, _, _ = _offsets_inputs(np.random.default_rng(32))
    given = {name: to_device(array, device) for name, array in inputs.items()}
    batch = dataclasses.replace(_bound_batch(device, 5, 20), input_ids=None)
    for call in (kc.block_tables.refill, kc.block_tables.Refill):
        with pytest.raises(TypeError, match=r"kv-canary: batch.input_ids must be an array \(refill stores into it\), "
                                            "got None"):
            call(batch, **given)


@requires_gpu
def test_a_bound_refill_is_captured_in_a_cuda_graph_on_a_stream_of_its_own():
    cupy = kc._dlpack.cupy_module()
    inputs, _, _ = _offsets_inputs(np.random.default_rng(27))
    given = {name: to_device(array, "cuda") for name, array in inputs.items()}
    batch = _bound_batch("cuda", 5, 20)
    bound = kc.block_tables.Refill(batch, **given)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        bound.launch(stream=stream)
        graph = stream.end_capture()
    fresh, counts, cached = _offsets_inputs(np.random.default_rng(300))
    with stream:  # refilled in place on the graph's stream, before it reads them
        for name, array in fresh.items():
            given[name][...] = to_device(array, "cuda")
    graph.launch(stream)
    stream.synchronize()
    assert to_numpy(batch.prefix_lens).tolist() == cached.tolist()
    assert to_numpy(batch.req_pool_indices).tolist() == [1, 2, 3, 4, 5]


def _mirror_many_cells(device: str, view: str) -> np.ndarray:
    """A mirror of 320 K cells (more than a grid of eight blocks an SM of a 132-SM GPU covers in one
    pass of its stride loop) from a block table viewed backwards, transposed or every other column,
    into a column window of a wider slot table, rows permuted; the slot table as it ends."""
    rng = np.random.default_rng([31, len(view)])
    count, blocks, block_size, first_block = 128, 40, 64, 1
    width = (first_block + blocks) * block_size
    engine = rng.integers(-3, 1 << 24, size=(count, 2 * blocks + 1), dtype=np.int64)
    engine[rng.random(engine.shape) < 0.01] = (1 << 31) // block_size + 5  # a slot int32 cannot hold
    if view == "backwards":
        table = to_device(engine, device)[::-1, ::-2]
    elif view == "transposed":
        table = to_device(np.ascontiguousarray(engine.T.astype(np.int32)), device).T[:, :blocks]
    else:
        table = to_device(engine.astype(np.int32), device)[:, 1::2]
    table = table[:, :blocks]
    parent = to_device(rng.integers(-9, 9, size=(count + 3, width + 24), dtype=np.int32), device)
    target = parent[:, 16:16 + width]
    rows = rng.permutation(np.arange(1, count + 3))[:count]
    kc.block_tables.mirror(target, block_table=table, block_size=block_size, rows=rows, first_block=first_block)
    return to_numpy(parent)


@pytest.mark.parametrize("view", ["backwards", "transposed", "every_other"])
def test_mirror_of_many_cells_through_a_strided_table_follows_the_model(view):
    """The CPU half of the GPU test below: the model's cells, and nothing outside the window."""
    got = _mirror_many_cells("cpu", view)
    assert (got[:, :16] != 0).any() and len(np.unique(got)) > 1000
    assert (got == _mirror_many_cells("cpu", view)).all()


@requires_gpu
@pytest.mark.parametrize("view", ["backwards", "transposed", "every_other"])
def test_mirror_of_many_cells_through_a_strided_table_equals_the_cpu(view):
    """Element strides of any sign and size in the GPU's mirror (negative ones read before the
    view's first element's address), and more cells than its grid covers at once: the slot table,
    columns outside the window included, equals the CPU's."""
    assert (_mirror_many_cells("cuda", view) == _mirror_many_cells("cpu", view)).all()


@requires_gpu
def test_fill_through_backward_and_strided_views_equals_the_cpu():
    """kvc_batch_from_offsets with every input read backwards or every third element (negative and
    wide element strides), int32 and int64, 3000 requests and 70 K tokens (past one pass of its
    grid's stride loop): the same bits as the CPU's fill."""
    from kvcanary_cupy._dlpack import parse_device
    from kvcanary_cupy.ops._dispatch import backend_module
    cpu, cuda = (backend_module(parse_device(name), "block_tables") for name in ("cpu", "cuda"))
    stream = kc._dlpack.cupy_module().cuda.get_current_stream()
    rng = np.random.default_rng(33)
    bs, counts = 3000, (70_000, 5, 0)

    def viewed(values: np.ndarray, how: int, device: str):
        """``values`` as a view with element stride ``how`` (-1: backwards, 3: every third)."""
        spread = np.zeros(values.size * abs(how), values.dtype)
        spread[::how] = values
        return to_device(spread, device)[::how]

    for dtypes in ((np.int32, np.int64, np.int32, np.int64), (np.int64, np.int32, np.int64, np.int32)):
        starts = np.cumsum(rng.integers(-2, 40, size=bs + 1)).astype(dtypes[0])
        lens = rng.integers(-5, 5000, size=bs).astype(dtypes[1])
        rows = rng.integers(-1, 4000, size=bs).astype(dtypes[2])
        sources = [rng.integers(-2**31, 2**31 - 1, size=count).astype(dtypes[3]) for count in counts]
        results = []
        for device in ("cpu", "cuda"):
            outs = [to_device(np.full(bs, 7, np.int64), device) for _ in range(3)]
            tokens = [to_device(np.full(count + 1, 7, np.int64), device) for count in counts]
            args = [viewed(starts, -1, device), viewed(lens, 3, device), viewed(rows, -1, device), *outs,
                    [(viewed(source, 3 if k else -1, device), out) for k, (source, out) in
                     enumerate(zip(sources, tokens))]]
            if device == "cpu":
                cpu.fill(*args)
            else:
                cuda.fill(*args, stream=stream)
            results.append([to_numpy(array) for array in outs + tokens])
        for mine, theirs in zip(*results):
            assert (mine == theirs).all()
        assert results[0][3][:counts[0]].tolist() == sources[0].tolist()


@pytest.mark.parametrize("device", BACKENDS)
def test_mirror_refuses_a_slot_table_one_cell_too_narrow_and_changes_nothing(device):
    """Each canary row must have a cell for every slot of the block table's columns: one cell short,
    the last block's last slot would be written into the next row's first cell."""
    rng = np.random.default_rng(31)
    start = rng.integers(1, 100, size=(5, 7), dtype=np.int32)
    target = to_device(start, device)
    table = to_device(rng.integers(1, 50, size=(3, 2), dtype=np.int32), device)
    with pytest.raises(ValueError, match=r"^kv-canary: req_to_token must be at least \(first_block \+ blocks\) \* "
                                         r"block_size = \(0 \+ 2\) \* 4 = 8 wide"):
        kc.block_tables.mirror(target, block_table=table, block_size=4)
    assert (to_numpy(target) == start).all()


@pytest.mark.parametrize("device", BACKENDS)
def test_unmirrored_refuses_a_negative_length(device):
    table = to_device(np.array([[3, 7], [5, 2]], np.int32), device)
    req_to_token = to_device(np.zeros((3, 8), np.int32), device)
    kc.block_tables.mirror(req_to_token, block_table=table, block_size=4)
    with pytest.raises(ValueError, match=r"^kv-canary: seq_lens must be in \[0, blocks \* block_size = 8\] .*"
                                         r"got seq_lens\[1\] = -1"):
        kc.block_tables.unmirrored(req_to_token, block_table=table, block_size=4, seq_lens=np.array([8, -1]))


@pytest.mark.parametrize("device", BACKENDS)
def test_from_offsets_copies_a_strided_int64_token_array(device):
    """Only contiguous int64 token arrays are the batch's own; a strided one is copied, so the
    batch holds the values it had when the batch was made, in an array of the batch's."""
    rng = np.random.default_rng(32)
    inputs, _, _ = _offsets_inputs(rng, np.int64)
    given = {name: to_device(array, device) for name, array in inputs.items()}
    wide = to_device(np.repeat(inputs["input_ids"], 2), device)
    given["input_ids"] = wide[::2]
    batch = kc.ForwardBatch.from_offsets(**given)
    assert (to_numpy(batch.input_ids) == inputs["input_ids"]).all()
    wide[...] = to_device(np.full(wide.shape, 7, np.int64), device)  # the engine's refill
    assert (to_numpy(batch.input_ids) == inputs["input_ids"]).all()


@pytest.mark.parametrize("device", BACKENDS)
def test_refill_leaves_a_view_of_the_batchs_own_token_array_as_it_is(device):
    """A token array given to refill that is the batch's own array's cells (a view of it, as a
    tensor over the engine's buffer is) is left as it is, as the array itself is."""
    rng = np.random.default_rng(33)
    inputs, counts, _ = _offsets_inputs(rng)
    batch = _bound_batch(device, 5, 13)
    batch.input_ids[...] = to_device(inputs["input_ids"][:13].astype(np.int64), device)
    kc.block_tables.refill(batch, query_start_loc=to_device(inputs["query_start_loc"], device),
                           seq_lens=to_device(inputs["seq_lens"], device), input_ids=batch.input_ids[:],
                           positions=to_device(inputs["positions"][:13], device),
                           out_cache_loc=to_device(inputs["out_cache_loc"][:13], device))
    assert (to_numpy(batch.input_ids) == inputs["input_ids"][:13]).all()
    assert to_numpy(batch.extend_seq_lens).tolist() == counts.tolist()


@pytest.mark.parametrize("device", BACKENDS)
def test_mirror_checks_the_width_for_each_first_block_and_block_size(device):
    """A call alike to one that passed but for ``first_block`` or ``block_size`` reaches other
    columns: the slot table's width is checked again, and nothing is stored past it."""
    rng = np.random.default_rng(97)
    start = rng.integers(1, 2**20, size=(4, 16), dtype=np.int32)
    target = to_device(start, device)
    table = to_device(rng.integers(1, 90, size=(3, 2), dtype=np.int32), device)
    kc.block_tables.mirror(target, block_table=table, block_size=4, first_block=2)
    written = to_numpy(target).copy()
    for bad in (dict(block_size=4, first_block=3), dict(block_size=8, first_block=2)):
        with pytest.raises(ValueError, match=r"^kv-canary: req_to_token must be at least \(first_block \+ blocks\) "
                                             r"\* block_size"):
            kc.block_tables.mirror(target, block_table=table, **bad)
        assert (to_numpy(target) == written).all()


@pytest.mark.parametrize("device", BACKENDS)
def test_mirror_refuses_a_block_table_it_cannot_step_in_whole_elements(device):
    rng = np.random.default_rng(98)
    target = to_device(rng.integers(1, 2**20, size=(4, 16), dtype=np.int32), device)
    memory = to_device(rng.integers(1, 90, size=64, dtype=np.int32), device)
    odd_rows = _as_strided(memory, (3, 2), (10, 4), device)  # a row every 2.5 elements
    with pytest.raises(ValueError, match=r"^kv-canary: block_table must have strides that are whole elements "
                                         r"\(4 bytes\), got \(10, 4\)"):
        kc.block_tables.mirror(target, block_table=odd_rows, block_size=4)
    raw = to_device(rng.integers(1, 255, size=26, dtype=np.uint8), device)
    misaligned = raw[2:].view(np.int32).reshape(3, 2)
    with pytest.raises(ValueError, match=r"^kv-canary: block_table must be 4-byte aligned"):
        kc.block_tables.mirror(target, block_table=misaligned, block_size=4)


def test_forward_batch_refuses_an_unknown_keyword_as_python_does():
    inputs, _, _ = _offsets_inputs(np.random.default_rng(99))
    with pytest.raises(TypeError, match=r"^kv-canary: forward_batch takes ForwardBatch's optional fields .* got "
                                        r"'flip'"):
        kc.ForwardBatch.from_offsets(**inputs, flip=np.ones(3))


@pytest.mark.parametrize("device", BACKENDS)
def test_refill_refuses_an_int32_view_of_the_batchs_own_token_array(device):
    """Only the batch's own int64 array is left in place; an int32 view of its memory is another
    array stored over by the copy, and refused."""
    inputs, _, _ = _offsets_inputs(np.random.default_rng(100))
    batch = _bound_batch(device, 5, 40)
    given = {name: to_device(array, device) for name, array in inputs.items()}
    given["input_ids"] = batch.input_ids.view(np.int32)[:16]
    with pytest.raises(ValueError, match=r"^kv-canary: .*input_ids"):
        kc.block_tables.refill(batch, **given)
    for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids", "positions"):
        assert (to_numpy(getattr(batch, name)) == -77).all()


def test_host_calls_refuse_a_stream_of_no_known_form():
    rng = np.random.default_rng(101)
    inputs, _, _ = _offsets_inputs(rng)
    target = rng.integers(1, 2**20, size=(4, 16), dtype=np.int32)
    with pytest.raises(TypeError, match=r"^kv-canary: stream must be None"):
        kc.block_tables.mirror(target.copy(), block_table=np.ones((2, 2), np.int32), block_size=4, stream="s")
    bound = kc.block_tables.Refill(_bound_batch("cpu", 5, 20), **inputs)
    with pytest.raises(TypeError, match=r"^kv-canary: stream must be None"):
        bound.launch(stream="s")


def test_refill_on_the_host_refuses_offsets_that_do_not_fit_and_changes_nothing():
    inputs, _, _ = _offsets_inputs(np.random.default_rng(102))
    batch = _bound_batch("cpu", 5, 20)
    inputs["query_start_loc"] = inputs["query_start_loc"] + 1
    with pytest.raises(ValueError, match=r"^kv-canary: query_start_loc must start at 0"):
        kc.block_tables.refill(batch, **inputs)
    for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids"):
        assert (getattr(batch, name) == -77).all()


def test_offsets_refused_on_the_host_are_shown_whole_up_to_twelve():
    """The message names the shortest token arrays, and shows twelve offsets whole, more as their
    first six and last three."""
    rng = np.random.default_rng(103)
    for requests, shown in ((11, None), (13, "[0, 1, 2, 3, 4, 5, ..., 11, 12, 99]")):
        starts = np.arange(requests + 1, dtype=np.int64)
        starts[-1] = 99
        tokens = int(rng.integers(20, 30))
        with pytest.raises(ValueError) as caught:
            kc.ForwardBatch.from_offsets(query_start_loc=starts, seq_lens=np.full(requests, 200),
                                         input_ids=rng.integers(1, 999, size=tokens),
                                         positions=rng.integers(1, 999, size=tokens),
                                         out_cache_loc=rng.integers(1, 999, size=tokens + 1))
        message = str(caught.value)
        assert f"end within the {tokens} tokens of input_ids and positions, got " in message
        assert message.endswith(shown or str(starts.tolist()))

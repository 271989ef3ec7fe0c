"""scatter_req_token_ids (SPEC §3.4, §4): rows copied, truncated to the width, out-of-range skipped."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from _devices import BACKENDS, requires_gpu, to_device, to_numpy


def _scatter(device, flat_in, offsets, rpi, pool):
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    out = to_device(np.array(pool, dtype=np.int32), device)
    kc.scatter_req_token_ids(flat_in=put(flat_in), offsets=put(offsets), req_pool_indices=put(rpi), pool_out=out)
    return to_numpy(out)


def _model(flat_in, offsets, rpi, pool):
    pool = np.array(pool, dtype=np.int32)
    rows, width = pool.shape
    for r, rp in enumerate(rpi):
        if not 0 <= rp < rows:
            continue
        length = min(offsets[r + 1] - offsets[r], width)
        for j in range(max(length, 0)):
            if 0 <= offsets[r] + j < len(flat_in):
                pool[rp, j] = flat_in[offsets[r] + j]
    return pool


@pytest.mark.parametrize("device", BACKENDS)
def test_basic(device):
    pool = np.full((4, 5), -7, np.int32)
    got = _scatter(device, [1, 2, 3, 4, 5, 6], [0, 2, 6], [3, 1], pool)
    want = pool.copy()
    want[3, :2] = [1, 2]
    want[1, :4] = [3, 4, 5, 6]
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("device", BACKENDS)
def test_truncated_to_width(device):
    got = _scatter(device, list(range(10, 20)), [0, 10], [1], np.full((2, 3), -7, np.int32))
    assert got.tolist() == [[-7, -7, -7], [10, 11, 12]]


@pytest.mark.parametrize("device", BACKENDS)
def test_rows_outside_pool_skipped(device):
    got = _scatter(device, [1, 2, 3, 4], [0, 1, 2, 3, 4], [-1, 2, 5, 0], np.full((3, 2), -7, np.int32))
    assert got.tolist() == [[4, -7], [-7, -7], [2, -7]]


@pytest.mark.parametrize("device", BACKENDS)
def test_values_past_int32_keep_their_low_32_bits(device):
    """SPEC §3.4 is silent on int64 ids that do not fit the int32 pool: both backends store the low
    32 bits, two's complement (as NumPy's astype does), rather than saturate or refuse."""
    values = [2**31, 2**32 + 5, -2**31 - 1, 2**40 + 7, -(2**33) - 3, 123]
    got = _scatter(device, values, [0, 3, 6], [2, 1], np.full((3, 3), 9, np.int32))
    wrapped = np.array(values, np.int64).astype(np.int32).tolist()
    assert got.tolist() == [[9, 9, 9], wrapped[3:], wrapped[:3]]


@pytest.mark.parametrize("device", BACKENDS)
def test_reads_outside_flat_in_skipped(device):
    pool = np.full((3, 4), 9, np.int32)
    got = _scatter(device, [1, 2, 3], [-2, 2, 6], [1, 2], pool)
    # Request 0 reads [-2, 2): only indices 0 and 1 exist, landing at columns 2 and 3.
    # Request 1 reads [2, 6): index 2 exists, the rest does not.
    assert got.tolist() == [[9, 9, 9, 9], [9, 9, 1, 2], [3, 9, 9, 9]]


@pytest.mark.parametrize("device", BACKENDS)
def test_negative_length_and_empty(device):
    pool = np.full((2, 2), 5, np.int32)
    assert _scatter(device, [1, 2], [2, 0], [1], pool).tolist() == pool.tolist()
    assert _scatter(device, [], [0], [], pool).tolist() == pool.tolist()


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("seed", range(5))
def test_random_against_model(device, seed):
    rng = np.random.default_rng(seed)
    rows, width, bs = int(rng.integers(1, 8)), int(rng.integers(1, 9)), int(rng.integers(0, 6))
    n = int(rng.integers(0, 30))
    flat_in = rng.integers(-2**31, 2**31, size=n).tolist()
    lens = rng.integers(-1, 10, size=bs)
    offsets = [0] + np.cumsum(lens).tolist()
    offsets = [o + int(rng.integers(-2, 3)) for o in offsets]
    rpi = rng.integers(-1, rows + 2, size=bs).tolist()
    pool = rng.integers(-100, 100, size=(rows, width)).astype(np.int32)
    assert _scatter(device, flat_in, offsets, rpi, pool).tolist() == _model(flat_in, offsets, rpi, pool).tolist()


@pytest.mark.parametrize("device", BACKENDS)
def test_strided_rows_of_pool(device):
    if device != "cpu":
        pytest.skip("host-only layout check")
    parent = np.full((3, 8), -7, np.int32)
    view = parent[:, :4]
    kc.scatter_req_token_ids(flat_in=np.arange(1, 5, dtype=np.int64), offsets=np.array([0, 4], np.int64),
                             req_pool_indices=np.array([2], np.int64), pool_out=view)
    assert parent.tolist() == [[-7] * 8, [-7] * 8, [1, 2, 3, 4, -7, -7, -7, -7]]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("width, row_stride", [(6, 0), (6, 4), (6, 20), (1, 0)])
def test_pool_rows_that_overlap_are_refused(device, width, row_stride):
    """Rows sharing memory (a broadcast view's zero stride, or one shorter than a row; a pool of
    one column with a zero stride holds every row in one cell) would be written by several GPU
    blocks in no fixed order: refused on both backends, nothing written."""
    rng = np.random.default_rng([width, row_stride])
    xp = np if device == "cpu" else pytest.importorskip("cupy")
    base = xp.asarray(rng.integers(-100, 100, size=4 * width).astype(np.int32))
    before = to_numpy(base).copy()
    pool = xp.lib.stride_tricks.as_strided(base, shape=(3, width), strides=(row_stride, 4))
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    with pytest.raises(ValueError, match=r"^kv-canary: scatter_req_token_ids pool_out rows must not overlap "
                                         rf"\(row stride >= width \* itemsize = {4 * width} bytes\), "
                                         rf"got row stride {row_stride}$"):
        kc.scatter_req_token_ids(flat_in=put(rng.integers(1, 1000, 2 * width)), offsets=put([0, width, 2 * width]),
                                 req_pool_indices=put([1, 2]), pool_out=pool)
    assert to_numpy(base).tolist() == before.tolist()


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("over", ["flat_in", "offsets", "req_pool_indices"])
def test_pool_out_over_an_array_it_reads_is_refused(device, over):
    """pool_out sharing memory with the ids, offsets or rows it is filled from would change them as
    it is filled (row after row on the CPU, in no fixed order on a GPU): refused, nothing written."""
    xp = np if device == "cpu" else pytest.importorskip("cupy")
    base = xp.asarray(np.arange(16, dtype=np.int64))
    before = to_numpy(base).copy()
    pool = base.view(xp.int32).reshape(4, 8)
    arrays = dict(flat_in=to_device(np.arange(8, dtype=np.int64), device),
                  offsets=to_device(np.array([0, 8], np.int64), device),
                  req_pool_indices=to_device(np.array([1], np.int64), device))
    arrays[over] = base[:len(to_numpy(arrays[over]))]
    with pytest.raises(ValueError, match=rf"^kv-canary: scatter_req_token_ids pool_out and scatter_req_token_ids "
                                         rf"{over} must not share memory"):
        kc.scatter_req_token_ids(**arrays, pool_out=pool)
    assert to_numpy(base).tolist() == before.tolist()


@pytest.mark.parametrize("device", BACKENDS)
def test_pool_out_beside_flat_in_in_one_buffer_is_accepted(device):
    xp = np if device == "cpu" else pytest.importorskip("cupy")
    base = xp.asarray(np.arange(24, dtype=np.int64))
    pool = base[8:].view(xp.int32).reshape(4, 8)
    kc.scatter_req_token_ids(flat_in=base[:8], offsets=to_device(np.array([0, 8], np.int64), device),
                             req_pool_indices=to_device(np.array([1], np.int64), device), pool_out=pool)
    assert to_numpy(pool)[1].tolist() == list(range(8))


_FORMS = {"decode-form": (True, False), "general-form": (False, False), "long-rows-form": (False, True)}


def _force_form(monkeypatch, form: str) -> None:
    from kvcanary_cupy.ops.backends._cuda import scatter as cuda_scatter

    decode, long = _FORMS[form]
    monkeypatch.setattr(cuda_scatter, "decode_form", lambda *_: decode)
    monkeypatch.setattr(cuda_scatter, "long_rows", lambda *_: long)


def _check_cuda_against_model(rng, lens, n, rpi, rows, width, jitter=False):
    """Offsets from the row lengths (with jitter, a tenth of them moved by one), n random tokens and a
    random pool: the CUDA scatter must leave the pool as the model does."""
    offsets = [0] + np.cumsum(lens).tolist()
    if jitter:
        offsets = [o + int(rng.integers(-1, 2)) if rng.random() < 0.1 else o for o in offsets]
    flat_in = rng.integers(-2**31, 2**31, size=max(n, 0)).tolist()
    pool = rng.integers(-100, 100, size=(rows, width)).astype(np.int32)
    assert _scatter("cuda", flat_in, offsets, rpi, pool).tolist() == _model(flat_in, offsets, rpi, pool).tolist()


@requires_gpu
@pytest.mark.parametrize("form", list(_FORMS))
@pytest.mark.parametrize("seed", range(4))
def test_cuda_every_kernel_form_matches_the_model(monkeypatch, form, seed):
    """Each form of the CUDA kernel on every shape, not only on the shapes the host picks it for:
    long rows and one-token rows, batches past a block's threads, and many requests of one row
    (past the kernel's 64 remembered later writers)."""
    _force_form(monkeypatch, form)
    rng = np.random.default_rng(100 + seed)
    rows, width = int(rng.integers(1, 40)), int(rng.integers(1, 300))
    bs = int(rng.integers(1, 400))
    lens = rng.integers(0, 3 if seed % 2 == 0 else 400, size=bs)
    n = int(lens.sum()) + int(rng.integers(-3, 3))
    rpi = rng.integers(-1, rows + 1, size=bs).tolist()
    _check_cuda_against_model(rng, lens, n, rpi, rows, width, jitter=True)


@requires_gpu
@pytest.mark.parametrize("form", list(_FORMS))
@pytest.mark.parametrize("seed", range(3))
def test_cuda_batches_of_thousands_with_shared_rows_match_the_model(monkeypatch, form, seed):
    """Batches of more requests than a block reads later rows for in one round (8 strides of its
    threads), their pool rows shared by many requests far apart in the batch."""
    _force_form(monkeypatch, form)
    rng = np.random.default_rng(300 + seed)
    bs = int(rng.integers(1100, 5000))
    rows, width = int(rng.integers(2, 200)), int(rng.integers(1, 8))
    lens = rng.integers(0, 4, size=bs)
    rpi = rng.integers(-1, rows + 1, size=bs).tolist()
    _check_cuda_against_model(rng, lens, int(lens.sum()), rpi, rows, width)


@requires_gpu
@pytest.mark.parametrize("form", list(_FORMS))
@pytest.mark.parametrize("seed", range(6))
def test_cuda_rows_of_many_strides_match_the_model(monkeypatch, form, seed):
    """Rows of thousands of tokens (several rounds of the long-rows form's reads), mostly of distinct
    pool rows, sometimes shared, with offsets that run past flat_in."""
    _force_form(monkeypatch, form)
    rng = np.random.default_rng(200 + seed)
    bs = int(rng.integers(1, 7))
    rows, width = bs + 2, int(rng.integers(1, 6000))
    lens = rng.integers(0, width + 100, size=bs)
    n = int(lens.sum()) - int(rng.integers(0, 50))
    rpi = (rng.permutation(rows - 1)[:bs] + 1).tolist()
    if seed % 3 == 2 and bs > 1:
        rpi[-1] = rpi[0]  # a later request of the same row takes its columns
    _check_cuda_against_model(rng, lens, n, rpi, rows, width)


@requires_gpu
@pytest.mark.parametrize("form", list(_FORMS))
def test_cuda_requests_of_one_row_past_the_remembered_writers_leave_each_column_to_its_last(monkeypatch, form):
    """100 requests of one pool row, each writing one column fewer than the request before it: column
    199 - r is written last by request r, and every request before it writes it too. The first 35
    have more later writers than the kernel remembers (64) and look them up in the batch instead;
    each must store the column it is the last writer of, and no other request that column."""
    _force_form(monkeypatch, form)
    bs = 100
    lens = np.arange(200, 200 - bs, -1)
    _check_cuda_against_model(np.random.default_rng(9), lens, int(lens.sum()), [1] * bs, 3, 256)


def _later_requests_from_before_flat_in(groups: int = 600, width: int = 256, before: int = 200):
    """Groups of four requests: r0 writes a whole row of its own, r2 writes the same row from
    ``before`` ids ahead of flat_in (so only its columns ``before`` on), r1 and r3 write nothing (a
    reversed range, a row outside the pool) and let the offsets go back and forth. Columns below
    ``before`` are r0's alone."""
    rng = np.random.default_rng(74)
    tail = width - before  # what r2 reads of flat_in: its first ids
    starts = [tail + k * (width + 40) for k in range(groups)]
    offsets, rpi = [], []
    for k, start in enumerate(starts):
        offsets += [start, start + width, -before, tail]
        rpi += [k + 1, -1, k + 1, -1]
    offsets.append(starts[-1] + width + 40)
    flat_in = rng.integers(-2**31, 2**31, size=offsets[-1]).tolist()
    pool = rng.integers(-2**31, 2**31, size=(groups + 1, width)).astype(np.int32)
    return flat_in, offsets, rpi, pool


@pytest.mark.parametrize("device", BACKENDS)
def test_a_later_request_from_before_flat_in_leaves_the_columns_it_skips_to_the_earlier(device):
    """A later request of the same row that starts before flat_in writes only the columns whose ids
    lie in it; the earlier request's values stay in the columns below them (SPEC §3.4)."""
    flat_in, offsets, rpi, pool = _later_requests_from_before_flat_in()
    got = _scatter(device, flat_in, offsets, rpi, pool)
    want = _model(flat_in, offsets, rpi, pool)
    assert got.tolist() == want.tolist()
    assert want[1, :200].tolist() == flat_in[offsets[0]:offsets[0] + 200]
    assert want[1, 200:].tolist() == flat_in[:56]


@requires_gpu
@pytest.mark.parametrize("form", list(_FORMS))
def test_cuda_every_form_leaves_the_columns_a_later_request_from_before_flat_in_skips(monkeypatch, form):
    """The same batch through each form of the CUDA kernel: the earlier request's block must take the
    later request's columns to start where its ids enter flat_in (column 200), not at column 0, where
    they start for every request that begins inside flat_in."""
    _force_form(monkeypatch, form)
    flat_in, offsets, rpi, pool = _later_requests_from_before_flat_in()
    assert _scatter("cuda", flat_in, offsets, rpi, pool).tolist() == _model(flat_in, offsets, rpi, pool).tolist()


def test_long_rows_form_is_picked_for_rows_of_two_strides_on_average():
    from kvcanary_cupy.ops.backends._cuda.scatter import long_rows

    assert long_rows(1, 4096)  # a prefill chunk
    assert long_rows(4, 2048)
    assert not long_rows(4, 2047)
    assert not long_rows(32, 4096)  # 128-token extends


def test_decode_form_is_picked_for_one_token_rows_of_up_to_four_requests_a_block():
    from kvcanary_cupy.ops.backends._cuda.scatter import decode_form

    assert decode_form(1024, 1024, 132)
    assert decode_form(256, 512, 132)
    assert decode_form(4096, 4096, 132)
    assert decode_form(4224, 4224, 132)  # 1056 blocks (8 an SM), four requests each
    assert not decode_form(4225, 4225, 132)
    assert not decode_form(256, 513, 132)  # rows of more than two tokens on average


def test_every_batch_shape_names_a_compiled_scatter_kernel():
    """The launcher's kernel for any batch (decode-shaped or not, short rows or long, few SMs or
    many) is one the scatter module compiles, and never both forms at once."""
    from kvcanary_cupy.ops.backends._cuda.scatter import decode_form, long_rows, scatter_form
    from kvcanary_cupy.rawkernels import _loader

    for sms in (1, 16, 132):
        for bs in (1, 2, 31, 256, 4096, 5000):
            for num_tokens in (0, 1, bs, 2 * bs, 2 * bs + 1, 128 * bs, 4096 * bs):
                decode, long = scatter_form(bs, num_tokens, sms)
                assert _loader.instance("kvc_scatter", decode, long) in _loader.SPECS["scatter"].kernels
                assert decode == decode_form(bs, num_tokens, sms)
                assert long == (not decode and long_rows(bs, num_tokens))


@pytest.mark.parametrize("device", BACKENDS)
def test_span_past_int64(device):
    """offsets[r+1] - offsets[r] >= 2**63: the row is filled to its width, from flat_in's cells only."""
    pool = np.full((3, 4), -7, np.int32)
    got = _scatter(device, [7, 8, 9], [-2, 2**63 - 1, 2**63 - 1], [1, 2], pool)
    want = pool.copy()
    want[1, 2:] = [7, 8]
    assert got.tolist() == want.tolist()
    got = _scatter(device, [7, 8, 9], [-2**63, 2**63 - 1], [1], pool)
    assert got.tolist() == pool.tolist()


@pytest.mark.parametrize("device", BACKENDS)
def test_non_monotonic_offsets_and_rows_past_flat_in(device):
    """SPEC §3.4 and §4: each row reads ``flat_in[offsets[r] : offsets[r] + L]`` on its own, whatever
    the neighbouring offsets: a reversed range writes nothing, a later row may read cells an
    earlier one read (or cells before them), a range that starts past ``flat_in`` writes nothing
    and one that runs past it writes only its cells inside; every other cell keeps its value."""
    rng = np.random.default_rng(90)
    flat_in = [int(v) for v in rng.integers(-2**31, 2**31, size=6)]
    pool = rng.integers(-2**31, 2**31, size=(5, 4)).astype(np.int32)
    # r0 [4, 1) reversed; r1 [1, 3); r2 [3, 9) runs past the 6 ids, truncated to the width 4;
    # r3 [9, 12) starts past them; r4 [12, 0) reversed; r5 [0, 3) reads again from the start.
    got = _scatter(device, flat_in, [4, 1, 3, 9, 12, 0, 3], [1, 2, 3, 4, 1, 0], pool)
    want = pool.copy()
    want[2, :2] = flat_in[1:3]
    want[3, :3] = flat_in[3:6]
    want[0, :3] = flat_in[0:3]
    assert got.tolist() == want.tolist()
    assert got[1].tolist() == pool[1].tolist() and got[4].tolist() == pool[4].tolist()

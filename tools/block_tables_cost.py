"""What kc.block_tables costs a forward on a GPU, against the array expressions a user would write.

For vLLM-shaped batches (int32 ``query_start_loc``, ``seq_lens`` and ``input_ids``; int64 positions
and slot mapping): ``kc.ForwardBatch.from_offsets``, ``kc.block_tables.refill`` into a bound batch
(eagerly, bound once as ``kc.block_tables.Refill``, and replayed from a CUDA graph that captured
it; the eager calls both as an engine makes them each step, with arrays alike in all the checks read
as a call before, and as the first call of their kind, ``_new``), and the naive version (CuPy
expressions: casts, a difference, an ``arange``); for block tables:
``kc.block_tables.mirror`` of the rows that got a block and of whole rows (also ``_new``), against the naive
broadcast and scatter. Each is timed three ways (device time between CUDA events, host time a
call with the device kept busy, back-to-back wall time a call), beside an empty CuPy kernel's launch
in the same run. Outputs are compared with the naive version's before timing.

    PYTHONPATH=. python tools/block_tables_cost.py --out block_tables_cost.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import numpy as np

import kvcanary_cupy as kc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import _timing as T  # noqa: E402

COPIES = 4  # input sets cycled through, so no call reads what the previous one left in cache

# (name, batch size, cached tokens a request, new tokens a request)
BATCHES = (("decode_bs256", 256, 4096, 1), ("decode_bs1024", 1024, 1024, 1), ("extend_bs32x128", 32, 4096, 128),
           ("prefill_bs1x4096", 1, 0, 4096))
# (name, rows mirrored, blocks a row, tokens a block)
MIRRORS = (("new_block_16_rows", 16, 1, 16), ("whole_rows_16x256", 16, 256, 16), ("whole_rows_256x256", 256, 256, 16))


def _batch_inputs(cupy, rng, bs: int, cached: int, new: int) -> dict:
    tokens = bs * new
    return dict(query_start_loc=cupy.asarray(np.arange(bs + 1, dtype=np.int32) * new),
                seq_lens=cupy.asarray(np.full(bs, cached + new, np.int32) - rng.integers(0, max(cached // 2, 1), bs)
                                      .astype(np.int32) * (cached > 0)),
                input_ids=cupy.asarray(rng.integers(1, 128_000, tokens, dtype=np.int32)),
                positions=cupy.asarray(rng.integers(0, cached + new, tokens, dtype=np.int64)),
                out_cache_loc=cupy.asarray(rng.permutation(1 << 22)[:tokens].astype(np.int64)))


def _naive_batch(cupy, inputs: dict):
    starts = inputs["query_start_loc"].astype(cupy.int64)
    extend = starts[1:] - starts[:-1]
    bs = extend.shape[0]
    return kc.ForwardBatch(req_pool_indices=cupy.arange(1, bs + 1, dtype=cupy.int64),
                           prefix_lens=inputs["seq_lens"].astype(cupy.int64) - extend, extend_seq_lens=extend,
                           input_ids=inputs["input_ids"].astype(cupy.int64), positions=inputs["positions"],
                           out_cache_loc=inputs["out_cache_loc"])


def _naive_mirror(cupy, req_to_token, table, rows: np.ndarray, block_size: int) -> None:
    count, blocks = table.shape
    slots = table.astype(cupy.int64)[:, :, None] * block_size + cupy.arange(block_size, dtype=cupy.int64)
    req_to_token[cupy.asarray(rows), :blocks * block_size] = slots.reshape(count, -1).astype(cupy.int32)


def _timed(timer, fn, reps: int = 200) -> dict:
    fn(0)
    timer.sync()
    device = [timer.bracket(lambda i=i: fn(i % COPIES), cold=False) for i in range(reps)]
    return dict(device_us=statistics.median(device) * 1e6,
                host_us=timer.host_per_call(fn, COPIES, reps) * 1e6,
                wall_us=timer.wall_per_call(fn, COPIES, reps) * 1e6)


def _same_batch(ours, naive) -> bool:
    return all(bool((getattr(ours, name) == getattr(naive, name)).all())
               for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids", "positions",
                            "out_cache_loc"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="", help="write the figures here as JSON")
    parser.add_argument("--profile", action="store_true", help="only where the host time of each call goes (cProfile)")
    args = parser.parse_args()
    import cupy  # noqa: PLC0415

    if args.profile:
        _profile(cupy)
        return

    stream = cupy.cuda.Stream(non_blocking=True)
    timer = T.GpuTimer(cupy, stream, l2_bytes=64 << 20)
    kc.compile_kernels(device="cuda")
    empty = cupy.RawKernel('extern "C" __global__ void kvc_empty() {}', "kvc_empty")
    rows = {"empty_kernel": _timed(timer, lambda i: _on(stream, lambda: empty((1,), (1,), ())))}
    rng = np.random.default_rng(0)
    for name, bs, cached, new in BATCHES:
        with stream:
            inputs = [_batch_inputs(cupy, rng, bs, cached, new) for _ in range(COPIES)]
            bound = [kc.ForwardBatch.from_offsets(**given) for given in inputs]
            bound = [kc.ForwardBatch(**{field: getattr(batch, field).copy() for field in
                                        ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids",
                                         "positions", "out_cache_loc")}) for batch in bound]
            agree = all(_same_batch(kc.ForwardBatch.from_offsets(**given), _naive_batch(cupy, given))
                        for given in inputs)
        prepared = [kc.block_tables.Refill(bound[i], **inputs[i]) for i in range(COPIES)]
        calls = {"from_offsets": lambda i: kc.ForwardBatch.from_offsets(**inputs[i], stream=stream),
                 "from_offsets_new": lambda i: _first_time(kc.ForwardBatch.from_offsets, **inputs[i], stream=stream),
                 "refill": lambda i: kc.block_tables.refill(bound[i], **inputs[i], stream=stream),
                 "refill_new": lambda i: _first_time(kc.block_tables.refill, bound[i], **inputs[i], stream=stream),
                 "Refill.launch": lambda i: prepared[i].launch(stream=stream),
                 "naive": lambda i: _on(stream, lambda: _naive_batch(cupy, inputs[i]))}
        # refill captured once a copy, as a static forward's graph holds it: each replay one graph launch
        graphs = [timer.capture(lambda i=i: kc.block_tables.refill(bound[i], **inputs[i], stream=stream))
                  for i in range(COPIES)]
        calls["refill_graph"] = lambda i: graphs[i].launch(stream)
        rows[name] = {call: _timed(timer, fn) for call, fn in calls.items()}
        rows[name]["naive_agrees"] = agree
    for name, count, blocks, block_size in MIRRORS:
        with stream:
            req_to_token = cupy.zeros((1025, 256 * block_size), dtype=cupy.int32)
            tables = [cupy.asarray(rng.integers(1, 1 << 18, (count, blocks), dtype=np.int32)) for _ in range(COPIES)]
            picked = [np.sort(rng.permutation(np.arange(1, 1025))[:count]) for _ in range(COPIES)]
            kc.block_tables.mirror(req_to_token, block_table=tables[0], block_size=block_size, rows=picked[0],
                                   stream=stream)
            ours = req_to_token.copy()
            _naive_mirror(cupy, req_to_token, tables[0] + 0, picked[0], block_size)
            agree = bool((ours == req_to_token).all())
        calls = {"mirror": lambda i: kc.block_tables.mirror(req_to_token, block_table=tables[i], block_size=block_size,
                                                             rows=picked[i], stream=stream),
                 "mirror_new": lambda i: _first_time(kc.block_tables.mirror, req_to_token, block_table=tables[i],
                                                     block_size=block_size, rows=picked[i], stream=stream),
                 "naive": lambda i: _on(stream, lambda: _naive_mirror(cupy, req_to_token, tables[i], picked[i],
                                                                      block_size))}
        rows[name] = {call: _timed(timer, fn) for call, fn in calls.items()}
        rows[name]["naive_agrees"] = agree
    print(f"{'case':22s} {'call':16s} {'device us':>10s} {'host us':>9s} {'wall us':>9s}")
    for name, calls in rows.items():
        for call, figures in ([("launch", calls)] if name == "empty_kernel" else calls.items()):
            if isinstance(figures, dict):
                print(f"{name:22s} {call:16s} {figures['device_us']:10.2f} {figures['host_us']:9.2f} "
                      f"{figures['wall_us']:9.2f}")
    if args.out:
        device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        pathlib.Path(args.out).write_text(json.dumps(dict(device=device, cupy=cupy.__version__, rows=rows), indent=1))


def _profile(cupy) -> None:
    import cProfile  # noqa: PLC0415
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    stream = cupy.cuda.Stream(non_blocking=True)
    kc.compile_kernels(device="cuda")
    with stream:
        inputs = _batch_inputs(cupy, np.random.default_rng(1), 256, 4096, 1)
        bound = kc.ForwardBatch.from_offsets(**inputs)
        bound = kc.ForwardBatch(**{field: getattr(bound, field).copy() for field in bound.__dataclass_fields__
                                   if getattr(bound, field) is not None})
        table = cupy.asarray(np.random.default_rng(2).integers(1, 1 << 18, (16, 1), dtype=np.int32))
        req_to_token = cupy.zeros((1025, 4096), dtype=cupy.int32)
    rows = np.arange(1, 17)
    calls = {"from_offsets": lambda: kc.ForwardBatch.from_offsets(**inputs, stream=stream),
             "refill": lambda: kc.block_tables.refill(bound, **inputs, stream=stream),
             "mirror": lambda: kc.block_tables.mirror(req_to_token, block_table=table, block_size=16, rows=rows,
                                                      stream=stream)}
    for name, call in calls.items():
        for _ in range(200):
            call()
        stream.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            call()
        profile.disable()
        stream.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
        print(f"== {name}: 2000 calls\n" + "\n".join(text.getvalue().splitlines()[:40]))


def _first_time(call, *args, **kwargs):
    """``call`` as the first of its arrays' kind: the checks it passed and the launches it packed
    for arrays alike before are forgotten first."""
    from kvcanary_cupy.ops.backends._cuda import block_tables as launchers  # noqa: PLC0415

    kc.block_tables._PASSED.clear()
    launchers._PREPARED_FILLS.clear()
    launchers._PREPARED_MIRRORS.clear()
    return call(*args, **kwargs)


def _on(stream, fn):
    with stream:
        return fn()


if __name__ == "__main__":
    main()

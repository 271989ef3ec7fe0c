"""Where the time of a copy_records call between a GPU canary and a host one goes.

    python tools/records_host_parts.py

For 128, 1,024 and 4,096 random slots: the whole call each way (host wall time, the call waiting
for its copies), then each part on its own, timed alone the same way: the host-side checks
(``RecordCopy``), the GPU gather or scatter with its wait, the staging allocation, the transfer of
the staged rows (device to host, host to device) and the host gather or scatter. The medians of 200
calls, us, a line a count. What the parts do not add up to is the call's own Python (stream and
device lookups, context switches, the checks of the stream form). A second line a count times the
same stages inside whole calls (each stage's function wrapped in a timer in ``ops.copy_records``):
its ``unstaged`` is what the call spends outside them.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import time

import cupy
import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy import _layout as L
from kvcanary_cupy._dlpack import to_host
from kvcanary_cupy.ops.backends._cpu import records as cpu_records
from kvcanary_cupy.ops.backends._cuda import records as gpu_records
from kvcanary_cupy.ops.batches import RecordCopy

from _wall import median_us

copy_module = importlib.import_module("kvcanary_cupy.ops.copy_records")  # the module, not kc.copy_records
POOL = 1 << 16
COUNTS = (128, 1024, 4096)


class _Timed:
    """A stand-in for a backend module whose gather and scatter add their time to ``spent``."""

    def __init__(self, module, spent: dict, side: str):
        self.module, self.spent, self.side = module, spent, side

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[f"{self.side} {name}"] += time.perf_counter() - start
        return timed


@contextlib.contextmanager
def _stages_timed(spent: dict):
    """The stages of ``kc.copy_records`` timed inside the call, restored afterwards."""
    names = ("RecordCopy", "_streams", "stream_capturing", "_staging", "_carried")
    saved = {name: getattr(copy_module, name) for name in names}
    saved["backend_module"] = copy_module.backend_module

    def wrap(name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return timed

    for name in names:
        setattr(copy_module, name, wrap(name, saved[name]))
    copy_module.backend_module = lambda device, op: _Timed(saved["backend_module"](device, op), spent,
                                                             "gpu" if device.is_cuda else "host")
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(copy_module, name, fn)


def stages_inside(call, reps: int = 200) -> dict:
    """Mean us a call of each stage of ``call``'s copy, and of the whole call outside them."""
    call()
    spent: dict = collections.defaultdict(float)
    with _stages_timed(spent):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        whole = time.perf_counter() - start
    row = {name: round(seconds / reps * 1e6, 1) for name, seconds in spent.items()}
    row["unstaged"] = round((whole - sum(spent.values())) / reps * 1e6, 1)
    row["whole (mean)"] = round(whole / reps * 1e6, 1)
    return row


def main() -> None:
    kc.compile_kernels(device="cuda")
    kc.compile_kernels(device="cpu", source_counts=[])
    rng = np.random.default_rng(0)
    gpu = kc.CanaryContext.allocate(POOL, device="cuda")
    host = kc.CanaryContext.allocate(max(COUNTS) + 1, device="cpu", ring_capacity=0)
    gpu.canary_buf[...] = cupy.asarray(rng.integers(0, 256, gpu.canary_buf.shape, dtype=np.uint8))
    stream = cupy.cuda.get_current_stream()
    for count in COUNTS:
        gpu_slots = cupy.asarray(rng.permutation(POOL)[:count].astype(np.int64))
        host_slots = np.arange(1, count + 1, dtype=np.int64)
        staged = cupy.empty((count, L.STAGED_RECORD_WORDS), np.int64)
        host_staged = to_host(staged)
        row = {
            "count": count,
            "whole to host": median_us(lambda: kc.copy_records(src=gpu, dst=host, src_slots=gpu_slots,
                                                               dst_slots=host_slots)),
            "whole from host": median_us(lambda: (kc.copy_records(src=host, dst=gpu, src_slots=host_slots,
                                                                  dst_slots=gpu_slots), stream.synchronize())),
            "checks": median_us(lambda: RecordCopy(src=gpu, dst=host, src_slots=gpu_slots, dst_slots=host_slots)),
            "staging alloc": median_us(lambda: cupy.empty((count, L.STAGED_RECORD_WORDS), np.int64)),
            "gpu gather+wait": median_us(lambda: (gpu_records.gather(gpu, gpu_slots, staged, stream=stream),
                                                  stream.synchronize())),
            "to host": median_us(lambda: to_host(staged)),
            "host scatter": median_us(lambda: cpu_records.scatter(host, host_slots, host_staged)),
            "host gather": median_us(lambda: cpu_records.gather(host, host_slots, host_staged)),
            "to gpu+wait": median_us(lambda: (cupy.asarray(host_staged), stream.synchronize())),
            "gpu scatter+wait": median_us(lambda: (gpu_records.scatter(gpu, gpu_slots, staged, stream=stream),
                                                   stream.synchronize())),
            "wait alone": median_us(stream.synchronize),
        }
        print("  ".join(f"{name} {value:.1f}" if isinstance(value, float) else f"{name} {value}"
                        for name, value in row.items()))
        for direction, call in (
                ("to host", lambda: kc.copy_records(src=gpu, dst=host, src_slots=gpu_slots, dst_slots=host_slots)),
                ("from host", lambda: (kc.copy_records(src=host, dst=gpu, src_slots=host_slots, dst_slots=gpu_slots),
                                       stream.synchronize()))):
            inside = stages_inside(call)
            print(f"  inside, {direction}: " + "  ".join(f"{name} {value}" for name, value in inside.items()))


if __name__ == "__main__":
    main()

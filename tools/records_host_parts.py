"""Where the time of a copy_records call between a GPU canary and a host one goes.

    python tools/records_host_parts.py

For 128, 1,024 and 4,096 random slots: the whole call each way (host wall time, the call waiting
for its copies), then each part on its own, timed alone the same way: the host-side checks
(``RecordCopy``), the GPU gather or scatter with its wait, the staging allocation, the transfer of
the staged rows (device to host, host to device) and the host gather or scatter. The medians of 200
calls, us, a line a count. What the parts do not add up to is the call's own Python (stream and
device lookups, context switches, the checks of the stream form).
"""

from __future__ import annotations

import statistics
import time

import cupy
import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy import _layout as L
from kvcanary_cupy._dlpack import to_host
from kvcanary_cupy.ops.backends._cpu import records as cpu_records
from kvcanary_cupy.ops.backends._cuda import records as gpu_records
from kvcanary_cupy.ops.batches import RecordCopy

POOL = 1 << 16
COUNTS = (128, 1024, 4096)


def median_us(fn, reps: int = 200) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


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
        print("  ".join(f"{name} {value}" for name, value in row.items()))


if __name__ == "__main__":
    main()

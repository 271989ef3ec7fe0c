"""Backends the test session can run on, and moving arrays between them."""

from __future__ import annotations

import numpy as np
import pytest

from kvcanary_cupy._dlpack import cuda_device_count, cupy_module

HAS_CUDA = cuda_device_count() > 0
BACKENDS = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if HAS_CUDA else [])


def requires_gpu(test):
    """Marks a test that needs CuPy and a CUDA device: skipped without one, and carrying the gpu
    marker that a GPU run selects its tests by."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA device")(test))


def force_write_team(team: str, set_attribute=setattr) -> None:
    """Every batch through one CUDA write form (write and step): ``thread``, a thread a request
    (kvc_write_decode); ``one`` or ``two``, a warp or a pair of warps a request (kvc_write).
    ``set_attribute`` is pytest's ``monkeypatch.setattr`` in a test, so that the host's choice
    comes back after it; a tool's run keeps the forced form to its end."""
    from kvcanary_cupy.ops.backends._cuda import write as cuda_write  # noqa: PLC0415

    set_attribute(cuda_write, "decode_form", lambda *_: team == "thread")
    set_attribute(cuda_write, "paired", lambda *_: team == "two")


def to_device(array: np.ndarray, device: str, keep_strides: bool = False):
    """A copy of ``array`` on ``device``; ``keep_strides`` copies the parent memory so strided
    views stay strided (used for real-KV sources with padded rows)."""
    if device == "cpu":
        return array
    cupy = cupy_module()
    if keep_strides and array.ndim == 2 and not array.flags.c_contiguous:
        row_items = array.strides[0] // array.itemsize
        padded = np.lib.stride_tricks.as_strided(array, shape=(array.shape[0], row_items),
                                                 strides=(array.strides[0], array.itemsize))
        copy = cupy.asarray(np.ascontiguousarray(padded))[:, : array.shape[1]]
    else:
        copy = cupy.asarray(array)
    # copied on the current stream, which a test's non-blocking streams do not wait for: in place
    # before any stream reads it (else a kernel's stores may land before the copy does)
    cupy.cuda.get_current_stream().synchronize()
    return copy


def int64s_on(device: str):
    """``values -> an int64 array of them on device``: the index arrays most tests build."""
    return lambda values: to_device(np.asarray(values, np.int64), device)


def to_numpy(array) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()


def spin_kernel():
    """A one-thread CuPy kernel, ``spin((1,), (1,), (cupy.uint64(ns),))``, that keeps its stream busy
    for ``ns`` nanoseconds: work queued behind it runs late."""
    cupy = cupy_module()
    return cupy.RawKernel(r'''
    extern "C" __global__ void spin(unsigned long long ns) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    }''', "spin")

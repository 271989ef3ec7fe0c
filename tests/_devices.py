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


SPIN_SOURCE = r'''
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}'''

# The block's whole shared window from shared address 0: the bytes the driver reserves below a
# kernel's own shared variables (a kernel that indexes one of its arrays at -1 reads there) and the
# dynamic shared memory of the launch. Volatile stores: shared memory no later statement of the
# kernel reads, which a compiler may otherwise drop. No word is zero, and neighbours differ.
FILL_SHARED_SOURCE = r'''
extern "C" __global__ void fill_shared(unsigned long long seed, int words) {
    for (int i = threadIdx.x; i < words; i += blockDim.x) {
        const unsigned long long k = seed + (unsigned long long)blockIdx.x * (unsigned long long)words + i;
        const unsigned long long word = (k * 0x9E3779B97F4A7C15ull) | 1ull;
        asm volatile("st.volatile.shared.u64 [%0], %1;" :: "r"(8u * i), "l"(word) : "memory");
    }
}'''

# The words a block of it reads (the same window) before storing any, copied out: what a kernel
# that reads shared memory it never stored would find.
READ_SHARED_SOURCE = r'''
extern "C" __global__ void read_shared(unsigned long long* out, int words) {
    for (int i = threadIdx.x; i < words; i += blockDim.x) {
        unsigned long long word;
        asm volatile("ld.volatile.shared.u64 %0, [%1];" : "=l"(word) : "r"(8u * i) : "memory");
        out[(long long)blockIdx.x * words + i] = word;
    }
}'''

# name -> source of the kernels the tests and tools build themselves (compiled in CI as the
# package's own are)
INLINE_KERNELS = {"spin": SPIN_SOURCE, "fill_shared": FILL_SHARED_SOURCE, "read_shared": READ_SHARED_SOURCE}


def spin_kernel():
    """A one-thread CuPy kernel, ``spin((1,), (1,), (cupy.uint64(ns),))``, that keeps its stream busy
    for ``ns`` nanoseconds: work queued behind it runs late."""
    return cupy_module().RawKernel(SPIN_SOURCE, "spin")


# cudaDevAttrReservedSharedMemoryPerBlock: the bytes at the start of every block's shared window
# that the driver keeps (1 KiB from sm_80 on)
RESERVED_SHARED_MEMORY_PER_BLOCK = 111


class StaleSharedMemory:
    """Fills the shared memory of every SM of the current device with non-zero words, on a stream:
    a kernel launched after it on that stream that reads a shared word before storing it finds
    one of these (CUDA leaves shared memory as the last block there left it) instead of the zero
    that a card mostly holds where nothing ran before, and so gives a wrong answer a comparison
    can see. Each fill uses new words."""

    BLOCK = 1024

    def __init__(self):
        cupy = cupy_module()
        device = cupy.cuda.Device()
        attributes = device.attributes
        self.sms = attributes["MultiProcessorCount"]
        # the most one block may have: one block a SM, each covering nearly all of its SM's memory
        self.bytes = attributes["MaxSharedMemoryPerBlockOptin"]
        self.reserved = cupy.cuda.runtime.deviceGetAttribute(RESERVED_SHARED_MEMORY_PER_BLOCK, device.id)
        self.fill = cupy.RawKernel(FILL_SHARED_SOURCE, "fill_shared")
        self.read = cupy.RawKernel(READ_SHARED_SOURCE, "read_shared")
        for kernel in (self.fill, self.read):
            kernel.max_dynamic_shared_size_bytes = self.bytes
        self.fills = 0

    @property
    def words(self) -> int:
        """The words of a block's shared window: the reserved bytes, then the dynamic ones."""
        return (self.reserved + self.bytes) // 8

    def __call__(self, stream) -> None:
        cupy = cupy_module()
        self.fills += 1
        self.fill((self.sms,), (self.BLOCK,), (cupy.uint64(self.fills << 40), cupy.int32(self.words)),
                  shared_mem=self.bytes, stream=stream)

    def read_back(self, stream):
        """What a kernel of one block a SM finds in its shared memory before storing any word
        (a ``(sms, words)`` uint64 array on the device; a row's first ``reserved // 8`` words are
        the reserved ones)."""
        cupy = cupy_module()
        out = cupy.empty((self.sms, self.words), dtype=cupy.uint64)  # every word stored by the kernel
        self.read((self.sms,), (self.BLOCK,), (out, cupy.int32(self.words)), shared_mem=self.bytes, stream=stream)
        return out


def stale_shared_memory(set_attribute=setattr) -> StaleSharedMemory:
    """Every kernel the package launches from here on runs after a :class:`StaleSharedMemory` fill on
    its stream. ``set_attribute`` as for :func:`force_write_team`."""
    from kvcanary_cupy.ops.backends._cuda import Launch  # noqa: PLC0415

    stale = StaleSharedMemory()
    launch = Launch.__call__

    def after_a_fill(self, stream) -> None:
        stale(stream)
        launch(self, stream)

    set_attribute(Launch, "__call__", after_a_fill)
    return stale

"""compile_kernels and `python -m kvcanary_cupy compile`: every CUDA kernel ready before the first op."""

from __future__ import annotations

import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.__main__ import main as cli_main
from kvcanary_cupy.rawkernels import _loader
from _devices import HAS_CUDA


def test_cpu_has_nothing_to_compile():
    assert kc.compile_kernels(device="cpu") is None


@pytest.mark.parametrize("device, error", [("gpu", ValueError), (True, TypeError), (-1, ValueError),
                                           (1.5, TypeError)])
def test_bad_device_is_rejected(device, error):
    with pytest.raises(error, match="^kv-canary: device"):
        kc.compile_kernels(device=device)


@pytest.mark.skipif(HAS_CUDA, reason="the machine has a CUDA device")
def test_cuda_without_a_device_says_why():
    with pytest.raises((RuntimeError, ValueError), match="^kv-canary: device"):
        kc.compile_kernels(device="cuda:0")
    assert cli_main(["compile", "--device", "cuda:0"]) == 2


def test_cli_compiles_every_device_seen(capsys):
    assert cli_main(["compile"]) == 0
    out = capsys.readouterr().out
    assert ("kernels ready" in out) if HAS_CUDA else ("no CUDA device seen" in out)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA device")
def test_every_source_is_loaded_and_ops_compile_nothing_more():
    import cupy

    kc.compile_kernels(device="cuda:0")
    arch = cupy.cuda.Device(0).compute_capability
    loaded = {key[0] for key in _loader._modules if key[3] == arch}
    assert loaded == set(_loader.SPECS)
    modules = len(_loader._modules)
    with pytest.raises(ValueError, match="^kv-canary: device must be one of"):
        kc.compile_kernels(device=f"cuda:{cupy.cuda.runtime.getDeviceCount()}")
    ctx = kc.CanaryContext.allocate(64, device="cuda")
    wplan = kc.WritePlan.from_host(offsets=[0, 3], seed_slot_indices=[-1], num_valid_reqs=1, device="cuda")
    ids = cupy.asarray([5, 9, 11], dtype=cupy.int64)
    kc.write(ctx, wplan, tag=0, input_ids=ids, positions=cupy.arange(3, dtype=cupy.int64), out_cache_loc=ids)
    cupy.cuda.Device(0).synchronize()
    assert len(_loader._modules) == modules

"""compile_kernels and `python -m kvcanary_cupy compile`: every kernel ready before the first op."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.__main__ import main as cli_main
from kvcanary_cupy.rawkernels import _loader
from _devices import HAS_CUDA


def test_cpu_compiles_take_the_cache_directory_lock(tmp_path, monkeypatch):
    """A CPU build of a new signature (the functions it calls compiled with it) takes the lock file
    of its cache directory once, so that two processes never fill one cache at the same time, and
    holds it while numba compiles each function; a signature already built in the process takes
    none."""
    fcntl = pytest.importorskip("fcntl")
    from numba.core import event

    from kvcanary_cupy.ops.backends._cpu import hashing

    (tmp_path / "kvc_lock_probe.py").write_text(
        "from kvcanary_cupy.ops.backends._cpu.hashing import JIT, njit\n\n"
        "@njit(**JIT)\ndef inner(x):\n    return x * 2\n\n"
        "@njit(**JIT)\ndef outer(x):\n    return inner(x) + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kvc_lock_probe as probe

    taken, flock = [], fcntl.flock

    def recorded(handle, operation):
        taken.append((handle.name, operation))
        return flock(handle, operation)

    monkeypatch.setattr(hashing.fcntl, "flock", recorded)
    lock = (str(tmp_path / "__pycache__" / "kvcanary-compile.lock"), fcntl.LOCK_EX)
    compiles = []  # (function, whether the lock was held) as numba starts each compile

    class Compiles(event.Listener):
        def on_start(self, started):
            function = started.data["dispatcher"].py_func
            if function.__module__ == "kvc_lock_probe":
                compiles.append((function.__name__, hashing._COMPILE_LOCK.depth > 0))

        def on_end(self, ended):
            pass

    with event.install_listener("numba:compile", Compiles()):
        assert probe.outer(3) == 7 and taken == [lock]
        assert probe.outer(4) == 9 and taken == [lock]
        assert probe.outer(1.5) == 4.0 and taken == [lock, lock]
    assert compiles == [("outer", True), ("inner", True)] * 2
    assert hashing._COMPILE_LOCK.depth == 0 and hashing._COMPILE_LOCK.handle is None


def test_a_cpu_build_that_asks_for_no_cache_stores_none_and_takes_no_lock(tmp_path, monkeypatch):
    """``njit`` without ``cache=True`` is numba's plain build: nothing is written beside the
    source, and no compile lock is taken."""
    pytest.importorskip("fcntl")
    from kvcanary_cupy.ops.backends._cpu import hashing

    (tmp_path / "kvc_uncached_probe.py").write_text(
        "from kvcanary_cupy.ops.backends._cpu.hashing import njit\n\n"
        "@njit(nogil=True)\ndef twice(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kvc_uncached_probe as probe

    taken = []
    monkeypatch.setattr(hashing.fcntl, "flock", lambda handle, operation: taken.append(handle.name))
    assert probe.twice(21) == 42 and probe.twice(0.25) == 0.5
    assert taken == []
    assert sorted(path.name for path in (tmp_path / "__pycache__").glob("*")
                  if not path.name.endswith(".pyc")) == []


def test_cpu_backend_without_a_writable_cache_directory_compiles_with_a_warning(tmp_path, monkeypatch):
    """A read-only install with no writable user cache directory (and no NUMBA_CACHE_DIR): numba
    finds nowhere to store its cache, so the functions are compiled in each process instead, and
    the backend says so once rather than failing at import."""
    from kvcanary_cupy.ops.backends._cpu import hashing

    def no_locator(py_func):
        raise RuntimeError(f"cannot cache function {py_func.__name__!r}: no locator available for file 'x.py'")

    monkeypatch.setattr(hashing, "_SourcesKeyedCache", no_locator)
    monkeypatch.setattr(hashing, "_NO_CACHE_WARNED", False)
    (tmp_path / "kvc_no_cache_probe.py").write_text(
        "from kvcanary_cupy.ops.backends._cpu.hashing import JIT, njit\n\n"
        "@njit(**JIT)\ndef inner(x):\n    return x * 2\n\n"
        "@njit(**JIT)\ndef outer(x):\n    return inner(x) + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning, match="NUMBA_CACHE_DIR") as caught:
        import kvc_no_cache_probe as probe
    assert len(caught) == 1
    assert probe.outer(3) == 7
    assert not (tmp_path / "__pycache__").exists() or not any((tmp_path / "__pycache__").glob("*.nbi"))


def test_unwritable_numba_cache_dir_is_named_in_the_warning(monkeypatch):
    """NUMBA_CACHE_DIR set to a directory numba cannot write (numba then passes over it): the warning
    names it, rather than asking for the variable to be set."""
    import numba

    from kvcanary_cupy.ops.backends._cpu import hashing

    monkeypatch.setattr(hashing, "_NO_CACHE_WARNED", False)
    monkeypatch.setattr(numba.config, "CACHE_DIR", "/read-only/cache")
    with pytest.warns(RuntimeWarning) as caught:
        hashing._warn_no_cache_directory(RuntimeError("no locator available"))
    said = str(caught[0].message)
    assert "neither NUMBA_CACHE_DIR (/read-only/cache), the installed package's __pycache__" in said
    assert "Point NUMBA_CACHE_DIR at a writable directory" in said and "Set NUMBA_CACHE_DIR" not in said

def test_cpu_ops_compile_nothing_more_after_it():
    """On the CPU it compiles each numba op for the source counts asked for (serial and parallel
    builds), so that an op of a context with that many sources compiles nothing at its first call."""
    import numpy as np
    from numba.core.registry import CPUDispatcher

    from kvcanary_cupy.ops.backends._cpu import hashing, plan, records, scatter, verify, write

    def signatures():
        return {(module.__name__, name): len(value.signatures)
                for module in (hashing, plan, records, scatter, verify, write)
                for name, value in vars(module).items() if isinstance(value, CPUDispatcher)}

    kc.compile_kernels(device="cpu", source_counts=[3])
    before = signatures()
    kv = np.ones((70_000, 32), np.uint8)
    ctx = kc.CanaryContext.allocate(70_000, hash_mode=kc.HashMode.ALL, real_kv_sources=[
        kc.RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=32, read_bytes=32)] * 3)
    vplan, wplan = kc.VerifyPlan.allocate(70_000), kc.WritePlan.allocate(1)
    table = np.arange(1, 70_003, dtype=np.int32).reshape(1, -1).repeat(2, axis=0)  # position p: slot p + 1
    for tokens in (69_000, 3):
        kc.plan(vplan, wplan, req_pool_indices=np.array([1]), prefix_lens=np.array([0]),
                extend_seq_lens=np.array([tokens]), req_to_token=table)
        ids = np.arange(1, tokens + 1, dtype=np.int64)
        kc.write(ctx, wplan, tag=2, input_ids=ids, positions=ids - 1, out_cache_loc=ids)
        kc.plan(vplan, wplan, req_pool_indices=np.array([1]), prefix_lens=np.array([tokens]),
                extend_seq_lens=np.array([1]), req_to_token=table)
        kc.verify(ctx, vplan, tag=0)
    tier = kc.CanaryContext.allocate(1_000, hash_mode=kc.HashMode.ALL, real_kv_sources=ctx.real_kv_sources)
    slots = np.arange(1, 500, dtype=np.int64)
    kc.copy_records(src=ctx, dst=tier, src_slots=slots, dst_slots=slots)
    kc.copy_records(src=tier, dst=tier, src_slots=slots, dst_slots=slots + 400)
    assert signatures() == before
    assert ctx.violations().total == 0
    with pytest.raises(ValueError, match="^kv-canary: source_counts item must be non-negative, got -1"):
        kc.compile_kernels(device="cpu", source_counts=[-1])
    with pytest.raises(TypeError, match="^kv-canary: source_counts must be a list, tuple or range of ints, got int 5"):
        kc.compile_kernels(device="cpu", source_counts=5)
    with pytest.raises(ValueError, match=r"^kv-canary: source_counts item must be at most 65536 \(a context's "
                                         r"number of real-KV sources\), got 4611686018427387904"):
        kc.compile_kernels(device="cpu", source_counts=[1, 2**62])
    with pytest.raises(ValueError, match="^kv-canary: source_counts item must be at most 65536"):
        kc.compile_kernels(device="cpu", source_counts=range(10**18))


def test_no_source_counts_ready_only_the_copy():
    """``source_counts=[]`` readies copy_records alone (its direct loop and the staged gather and
    scatter that records crossing to or from a GPU take), and compiles no hashing op: what a host
    tier beside GPU canaries needs. A fresh process, so that nothing else compiled them first."""
    import json
    import os
    import subprocess
    import sys

    script = """
import json
from numba.core.registry import CPUDispatcher
import kvcanary_cupy as kc
from kvcanary_cupy.ops.backends._cpu import records, verify, write
kc.compile_kernels(device="cpu", source_counts=[])
print(json.dumps({f"{m.__name__.rsplit('.', 1)[1]}.{name}": len(v.signatures) for m in (records, verify, write)
                  for name, v in vars(m).items() if isinstance(v, CPUDispatcher)}))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert {name: compiled[name] for name in ("records._copy", "records._gather", "records._scatter")} == \
        {"records._copy": 1, "records._gather": 1, "records._scatter": 1}, compiled
    hashing = {name: count for name, count in compiled.items() if not name.startswith("records.")}
    assert hashing and not any(hashing.values()), compiled


@pytest.mark.parametrize("device, error", [("gpu", ValueError), (True, TypeError), (-1, ValueError),
                                           (1.5, TypeError), ("cuda:\u00b2", ValueError), ("cuda:-1", ValueError)])
def test_bad_device_is_rejected(device, error):
    with pytest.raises(error, match="^kv-canary: device"):
        kc.compile_kernels(device=device)


@pytest.mark.skipif(HAS_CUDA, reason="the machine has a CUDA device")
def test_cuda_without_a_device_says_why():
    with pytest.raises((RuntimeError, ValueError), match="^kv-canary: device"):
        kc.compile_kernels(device="cuda:0")
    assert cli_main(["compile", "--device", "cuda:0"]) == 2


def test_cli_refuses_an_empty_device(capsys):
    """``--device ""`` is a device named, and refused; it is not taken for the default."""
    assert cli_main(["compile", "--device", ""]) == 2
    assert "kv-canary: device must be" in capsys.readouterr().err


def test_cli_piped_into_a_reader_that_stops_ends_quietly():
    """``kvcanary info | head -1``: the closed pipe ends the command with status 0 and no traceback."""
    import subprocess
    import sys

    command = f"{sys.executable} -m kvcanary_cupy info | head -c 1"
    for _ in range(3):  # the race with head's exit is not always lost; any run must end quietly
        done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_cli_compiles_every_device_seen(capsys, ticking_clock):
    """Each build is reported with the seconds it took (under a clock that ticks half a second at
    every reading: a few ticks, not the clock's reading itself)."""
    import re

    ticking_clock(5000.0, 0.5)
    assert cli_main(["compile"]) == 0
    out = capsys.readouterr().out
    took = [float(seconds) for seconds in re.findall(r" ready in (\d+\.\d\d) s$", out, re.MULTILINE)]
    assert took and all(0.5 <= seconds <= 50.0 for seconds in took), out
    assert ("cuda:0: kernels ready" if HAS_CUDA else "cpu: kernels ready") in out
    assert ("cpu: copy_records ready" in out) == HAS_CUDA  # beside GPUs, a host tier's copy


def test_info_lists_the_cpu_and_every_cuda_device_with_its_name(capsys):
    """``info`` lists the CPU and each CUDA device seen, every device with its name and memory as
    CuPy reports them; with none, the CPU alone."""
    from kvcanary_cupy._dlpack import cuda_device_count

    assert cli_main(["info"]) == 0
    out = capsys.readouterr().out
    count = cuda_device_count()
    lines = out.splitlines()
    assert "  devices     : cpu" + "".join(f", cuda:{i}" for i in range(count)) in lines, out
    listed = [line for line in lines if line.startswith("    cuda:")]
    if count == 0:
        assert listed == [], out
        return
    cupy = pytest.importorskip("cupy")
    names = []
    for i in range(count):
        name = cupy.cuda.runtime.getDeviceProperties(i)["name"]
        names.append(name.decode() if isinstance(name, bytes) else name)
    assert [line.split(",")[0] for line in listed] == [f"    cuda:{i}: {name}" for i, name in enumerate(names)]
    assert all(line.endswith(" GiB") for line in listed), out


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


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA device")
def test_each_device_loads_the_modules():
    """Devices of one architecture share the compiled modules, and each loads them itself."""
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if count < 2:
        pytest.skip("needs two GPUs")
    for device in range(count):
        kc.compile_kernels(device=f"cuda:{device}")
        assert {key[0] for key, on in _loader._loaded if on == device} == set(_loader.SPECS)


def test_cpu_cache_follows_what_a_cached_op_calls_and_freezes(tmp_path):
    """numba checks a cached function against its own file alone. The CPU backend keys its cache by
    all of its sources and the layout constants too, so that a change to the hash's constants in
    ``_layout.py`` (neither the file of ``sm`` nor of any op) is compiled in, not loaded stale."""
    import pathlib
    import shutil
    import subprocess
    import sys

    package = pathlib.Path(kc.__file__).parent
    copy = tmp_path / "kvcanary_cupy"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    probe = ("from kvcanary_cupy.ops.backends._cpu import hashing; import numpy as np; "
             "print(int(hashing.sm(np.uint64(12345))), sum(hashing.sm.stats.cache_hits.values()))")

    def run() -> tuple[int, int]:
        done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                              env={"PYTHONPATH": str(tmp_path), "PATH": ""}, timeout=300)
        assert done.returncode == 0, done.stderr
        value, hits = done.stdout.split()
        return int(value), int(hits)

    first, hits = run()
    assert hits == 0
    assert run() == (first, 1)  # a later process loads it from the cache
    layout = copy / "_layout.py"
    layout.write_text(layout.read_text().replace("SPLITMIX_MUL_1 = 0xBF58476D1CE4E5B9", "SPLITMIX_MUL_1 = 0x1"))
    changed, hits = run()
    assert hits == 0 and changed != first


def test_cpu_cache_entry_whose_parallel_code_came_from_the_cache_loads_in_a_fresh_process(tmp_path):
    """A cached function with no parallel loop of its own that calls a parallel one is stored
    without numba's step that starts the threading layer when the callee was itself loaded from
    the cache as the caller compiled (``_verify`` over ``hash_slots_parallel``, compiled after
    another op cached the hash). A process whose first parallel code is that entry died jumping to
    address 0; the CPU backend's cache starts the layer before it loads any entry."""
    import subprocess
    import sys

    (tmp_path / "kvc_reload_probe.py").write_text(
        "import numba\n"
        "from kvcanary_cupy.ops.backends._cpu.hashing import JIT, njit\n\n"
        "@njit(parallel=True, **JIT)\ndef fill(out):\n"
        "    for i in numba.prange(out.shape[0]):\n        out[i] = i * 3\n\n"
        "@njit(**JIT)\ndef total(out):\n    fill(out)\n    return out.sum()\n")
    package_root = str(pathlib.Path(kc.__file__).parents[1])
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{package_root}", "PATH": os.environ.get("PATH", "")}

    def run(statement: str) -> subprocess.CompletedProcess:
        script = f"import numpy as np\nfrom kvc_reload_probe import fill, total\n{statement}\n"
        return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                              env=env, timeout=300)

    cached_callee = run("fill(np.zeros(8))")  # the parallel function alone, into the cache
    assert cached_callee.returncode == 0, cached_callee.stderr
    compiled_caller = run("print(int(total(np.zeros(8))))")  # compiled over the cached callee
    assert compiled_caller.returncode == 0 and compiled_caller.stdout.split() == ["84"], compiled_caller.stderr
    loaded_caller = run("print(int(total(np.zeros(8))), sum(total.stats.cache_hits.values()))")
    assert loaded_caller.returncode == 0, f"exit status {loaded_caller.returncode}: {loaded_caller.stderr}"
    assert loaded_caller.stdout.split() == ["84", "1"]  # loaded from the cache, not compiled again


def test_the_installed_command_names_itself():
    """Run as the ``kvcanary`` script the install puts on the path, its usage says ``kvcanary``."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(sys.executable), "kvcanary")
    if not os.path.exists(script):
        pytest.skip("the package is not installed as a script beside this interpreter")
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: kvcanary "), done.stdout[:200]


def test_cli_compiles_the_source_counts_asked_for(capsys, monkeypatch):
    """``--source-counts`` reaches compile_kernels for the CPU (numba builds the hashing kernels for
    each count), beside GPUs too; a malformed list is refused by argparse."""
    from kvcanary_cupy import _dlpack

    calls = []
    monkeypatch.setattr(kc, "compile_kernels", lambda **options: calls.append(options))
    assert cli_main(["compile", "--device", "cpu", "--source-counts", "0,4"]) == 0
    assert calls == [{"device": "cpu", "source_counts": [0, 4]}]
    monkeypatch.setattr(_dlpack, "cuda_device_count", lambda: 1)  # a GPU seen: its kernels, and the CPU's asked for
    calls.clear()
    assert cli_main(["compile", "--source-counts", "2"]) == 0
    assert calls == [{"device": "cuda:0"}, {"device": "cpu", "source_counts": [2]}]
    calls.clear()
    assert cli_main(["compile"]) == 0
    assert calls == [{"device": "cuda:0"}, {"device": "cpu", "source_counts": []}]
    calls.clear()  # a GPU named with --device is one seen: the CPU's counts asked for are not dropped
    assert cli_main(["compile", "--device", "cuda:1", "--source-counts", "0,4"]) == 0
    assert calls == [{"device": "cuda:1"}, {"device": "cpu", "source_counts": [0, 4]}]
    calls.clear()  # the CPU however it is spelt is the CPU, not a GPU beside which copy_records is readied
    assert cli_main(["compile", "--device", "CPU", "--source-counts", "0,4"]) == 0
    assert cli_main(["compile", "--device", " cpu"]) == 0
    assert calls == [{"device": "cpu", "source_counts": [0, 4]}, {"device": "cpu"}]
    for bad in ("-1", "x", "1,,2"):
        with pytest.raises(SystemExit) as refused:
            cli_main(["compile", "--source-counts", bad])
        assert refused.value.code == 2
        assert "argument --source-counts: must be integers >= 0 separated by commas" in capsys.readouterr().err


def test_cli_tells_its_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip().endswith(f" {kc.__version__}")


def test_cupy_without_a_gpu_runs_on_the_cpu_and_says_why(tmp_path):
    """CuPy installed on a machine without a driver or device (its getDeviceCount raises): the
    package imports and runs on the CPU, ``info`` tells why no CUDA device is listed, and a demo
    asked for ``cuda`` is refused in one line rather than with CuPy's traceback, as are a context, a
    plan or a ``kc.Canary`` allocated there."""
    fake = tmp_path / "cupy"
    (fake / "cuda").mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '13.6.0'\nfrom . import cuda\nclass ndarray:\n    pass\n")
    (fake / "cuda" / "__init__.py").write_text("from . import runtime\n")
    (fake / "cuda" / "runtime.py").write_text(
        "class CUDARuntimeError(RuntimeError):\n    pass\n"
        "def getDeviceCount(*args):\n"
        "    raise CUDARuntimeError('cudaErrorNoDevice: no CUDA-capable device is detected')\n"
        "getDevice = getDeviceProperties = getDeviceCount\n")
    (fake / "cuda" / "__init__.py").write_text(
        "from . import runtime\n"
        "class Device:\n"  # CuPy's: made without a call, but made current by cudaSetDevice
        "    def __init__(self, index=0):\n        self.id = index\n"
        "    def __enter__(self):\n        runtime.getDeviceCount()\n"
        "    def __exit__(self, *args):\n        pass\n")
    code = ("from kvcanary_cupy.__main__ import main\n"
            "print(main(['info']))\n"
            "print(main(['demo', '--device', 'cuda', '--steps', '2', '--no-progress']))\n"
            "import numpy as np, kvcanary_cupy as kc\n"
            "caps = kc.Capacities.from_args(req_to_token_pool_size=2, max_seq_len_per_req=8, pool_slot_count=16,\n"
            "                               max_prefill_tokens=8)\n"
            "for make in (lambda: kc.CanaryContext.allocate(16, device='cuda'),\n"
            "             lambda: kc.VerifyPlan.allocate(8, device=0), lambda: kc.WritePlan.allocate(2, device='cuda:1'),\n"
            "             lambda: kc.Canary(pool_slot_count=16, capacities=caps, req_to_token=np.zeros((2, 8), np.int32),\n"
            "                               device='cuda')):\n"
            "    try:\n        make()\n    except ValueError as error:\n        print(error)\n")
    done = _run_beside(tmp_path, code)
    # arrays asked for on a GPU (a canary's, a plan's, a kc.Canary's) are refused in the same words
    lines = done.stdout.strip().splitlines()
    assert lines[-4:] == [f"kv-canary: device must be one of the 0 CUDA device(s) seen, got cuda:{i}"
                          for i in (0, 0, 1, 0)]
    printed = "\n".join(lines[:-4])
    assert "cuda backend: CuPy 13.6.0, 0 devices (cudaErrorNoDevice: no CUDA-capable device is detected)" in printed
    assert "devices     : cpu\n" in printed and printed.endswith("0\n2")
    assert done.stderr.strip() == "kv-canary: device must be one of the 0 CUDA device(s) seen, got cuda:0"


def _failing_import(directory, name: str, why: str) -> None:
    """A package ``name`` in ``directory`` whose import raises ImportError(``why``), as an installed
    one does when a library it needs is missing or refuses the versions beside it."""
    (directory / name).mkdir()
    (directory / name / "__init__.py").write_text(f"raise ImportError({why!r})\n")


def test_cupy_that_fails_to_import_is_not_called_missing(tmp_path):
    """CuPy installed but failing to import (a CUDA library it links missing): a GPU asked for is
    refused with the import's error, not with advice to install CuPy, as ``info`` says."""
    _failing_import(tmp_path, "cupy", "libcudart.so.12: cannot open shared object file: No such file or directory")
    code = ("import kvcanary_cupy as kc\n"
            "for make in (lambda: kc.CanaryContext.allocate(16, device='cuda'),\n"
            "             lambda: kc.compile_kernels(device='cuda:0')):\n"
            "    try:\n        make()\n    except ValueError as error:\n        print(error)\n")
    done = _run_beside(tmp_path, code)
    said = ("kv-canary: device: a CUDA device needs CuPy, which is installed but fails to import (libcudart.so.12: "
            "cannot open shared object file: No such file or directory): python -c 'import cupy' tells more")
    assert done.stdout.splitlines() == [said, said], done.stdout

_PLAIN_PYTHON_WORKLOAD = """
import hashlib
import numpy as np
import kvcanary_cupy as kc

n = 200  # past the entries the ops ask for ahead of their use
kv = np.random.default_rng(1).integers(0, 255, size=(n + 1, 32), dtype=np.uint8)
sources = [kc.RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=32, read_bytes=32)] * 2
ctx = kc.CanaryContext.allocate(n + 1, hash_mode=kc.HashMode.ALL, real_kv_sources=sources, ring_capacity=8)
vplan, wplan = kc.VerifyPlan.allocate(n), kc.WritePlan.allocate(1)
table = np.zeros((2, n + 1), np.int32)
table[1, :n] = np.arange(1, n + 1)
slots = np.arange(1, n + 1)
batch = dict(req_pool_indices=np.array([1]), req_to_token=table)
kc.plan(vplan, wplan, prefix_lens=np.array([0]), extend_seq_lens=np.array([n]), **batch)
kc.write(ctx, wplan, tag=2, input_ids=slots * 7, positions=slots - 1, out_cache_loc=slots)
kv[5, 3] ^= 1
kc.plan(vplan, wplan, prefix_lens=np.array([n]), extend_seq_lens=np.array([0]), **batch)
kc.verify(ctx, vplan, tag=0)
tier = kc.CanaryContext.allocate(n + 1, hash_mode=kc.HashMode.ALL, real_kv_sources=sources)
kc.copy_records(src=ctx, dst=tier, src_slots=slots, dst_slots=slots[::-1].copy())
print(ctx.violations().total, hashlib.sha256(ctx.canary_buf.tobytes() + ctx.violation_ring.tobytes()
                                             + tier.canary_buf.tobytes()).hexdigest())
"""


def test_numba_disable_jit_runs_the_ops_as_plain_python_and_says_so():
    """NUMBA_DISABLE_JIT=1 (numba's debugging switch) runs the CPU backend's kernels as plain Python:
    the results are the compiled ones, byte for byte (the prefetch hint, an intrinsic plain Python
    cannot call, does nothing), and the backend says once that it runs so, without NumPy's overflow
    warnings for the hash's wrapping products."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    compiled = subprocess.run([sys.executable, "-c", _PLAIN_PYTHON_WORKLOAD], capture_output=True, text=True,
                              env=env, timeout=300)
    plain = subprocess.run([sys.executable, "-c", _PLAIN_PYTHON_WORKLOAD], capture_output=True, text=True,
                           env=dict(env, NUMBA_DISABLE_JIT="1"), timeout=300)
    assert compiled.returncode == 0 and plain.returncode == 0, compiled.stderr + plain.stderr
    assert plain.stdout == compiled.stdout and plain.stdout.startswith("1 "), (plain.stdout, compiled.stdout)
    assert plain.stderr.count("NUMBA_DISABLE_JIT is set") == 1 and "overflow" not in plain.stderr, plain.stderr
    assert "NUMBA_DISABLE_JIT" not in compiled.stderr


def _run_beside(stub_dir, code: str):
    """``code`` run in a fresh interpreter that imports from ``stub_dir`` first (a stand-in CuPy):
    it must exit cleanly, with no traceback."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub_dir), *sys.path]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return done


def test_cupy_left_half_uninstalled_is_said_so(tmp_path):
    """A cupy directory left without its ``__init__.py`` (an uninstall that removed CuPy's files but not
    all of the directory) imports as an empty namespace package: ``info`` and a GPU asked for say
    CuPy fails to import and why, and arrays are still told apart, not met with an AttributeError for
    the CuPy names it lacks."""
    installed = importlib.util.find_spec("cupy")
    if installed is not None and installed.origin is not None:
        pytest.skip("an installed CuPy is imported before a directory without __init__.py, wherever it lies")
    (tmp_path / "cupy" / "_core").mkdir(parents=True)
    code = ("import numpy as np\n"
            "import kvcanary_cupy as kc\n"
            "from kvcanary_cupy import _dlpack\n"
            "from kvcanary_cupy.__main__ import main\n"
            "class Host:\n"  # a host array that is not a NumPy one, speaking DLPack
            "    def __init__(self, array):\n        self.array = array\n"
            "    def __dlpack__(self, **kwargs):\n        return self.array.__dlpack__(**kwargs)\n"
            "    def __dlpack_device__(self):\n        return self.array.__dlpack_device__()\n"
            "print(_dlpack.device_of(Host(np.zeros(3)), 'x'))\n"
            "try:\n    kc.CanaryContext.allocate(16, device='cuda')\n"
            "except ValueError as error:\n    print(error)\n"
            "print(main(['info']))\n")
    out = _run_beside(tmp_path, code).stdout
    assert out.startswith("cpu\nkv-canary: device: a CUDA device needs CuPy, which is installed but fails to import "
                          f"(cupy in {tmp_path / 'cupy'} is a directory without CuPy's modules"), out
    assert "  cuda backend: unavailable (CuPy is installed but fails to import: cupy in " in out and out.endswith("0\n")


_NUMBA_BROKEN = {
    "missing": ("not installed: pip install numba", "not installed"),
    "failing": ("installed but fails to import (Numba needs NumPy 2.3 or less. Got NumPy 2.4.)",
                "installed but fails to import: Numba needs NumPy 2.3 or less. Got NumPy 2.4.;"),
}


@pytest.mark.parametrize("broken", list(_NUMBA_BROKEN))
def test_numba_missing_or_failing_to_import_is_said_in_one_line(tmp_path, broken):
    """A broken install without numba, or with one that fails to import (it refuses a NumPy newer
    than it supports, as after upgrading NumPy alone), imports and says which, in one line, where a
    CPU op, a compile or the demo needs numba; ``info`` advises installing it only when it is missing."""
    if broken == "failing":
        _failing_import(tmp_path, "numba", "Numba needs NumPy 2.3 or less. Got NumPy 2.4.")
    code = ("import sys\n" + ("sys.modules['numba'] = None\n" if broken == "missing" else "") +
            "import kvcanary_cupy as kc\n"
            "from kvcanary_cupy.__main__ import main\n"
            "try:\n"
            "    kc.compile_kernels(device='cpu')\n"
            "except RuntimeError as error:\n"
            "    print(error)\n"
            "print(main(['demo', '--device', 'cpu', '--steps', '2', '--no-progress']), main(['info']))\n")
    done = _run_beside(tmp_path, code)
    said, info = _NUMBA_BROKEN[broken]
    message = f"kv-canary: arrays on the CPU run on the numba backend, and numba is {said}"
    assert done.stdout.startswith(message) and done.stderr.strip() == message, (done.stdout, done.stderr)
    assert f"cpu backend : unavailable (numba is {info}" in done.stdout and done.stdout.strip().endswith("2 0")


def test_source_counts_are_bounded_at_65536_inclusive(monkeypatch):
    """65536 sources is the most a context may hash: that count is warmed (the CPU warming stood in
    for here, which would build as many sources), one more is refused."""
    import kvcanary_cupy.precompile as precompile

    warmed = []
    monkeypatch.setattr(precompile, "_warm_cpu", warmed.append)
    kc.compile_kernels(device="cpu", source_counts=[precompile.MOST_SOURCES_WARMED, 2, 2])
    assert warmed == [[2, 65536]]
    with pytest.raises(ValueError, match=r"^kv-canary: source_counts item must be at most 65536"):
        kc.compile_kernels(device="cpu", source_counts=[65537])


def test_cli_without_a_command_shows_its_help_on_stderr_and_fails(capsys):
    assert cli_main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "usage:" in captured.err and "compile" in captured.err


def test_cli_refuses_a_source_count_past_the_bound_in_one_line(capsys):
    count = int(np.random.default_rng(104).integers(65_537, 10**6))
    assert cli_main(["compile", "--device", "cpu", "--source-counts", f"0,{count}"]) == 2
    assert capsys.readouterr().err.strip() == (f"kv-canary: source_counts item must be at most 65536 (a context's "
                                               f"number of real-KV sources), got {count}")


def test_resident_grids_follow_cudas_occupancy_rules(monkeypatch):
    """How many blocks of a kernel fill every SM once, counted as CUDA's occupancy rules count them:
    threads, registers (given out 256 at a time to each warp), the blocks an SM takes, and static
    shared memory (1 KB more a block kept by the driver). An H100's figures and kernels stood in
    for; on a GPU, tests/test_gpu.py compares the same count with the driver's own."""
    import sys
    import types

    kernels = {}
    monkeypatch.setattr(_loader, "_resident", {})
    monkeypatch.setattr(_loader, "get_kernel", lambda source, kernel, device_id: kernels[kernel])
    monkeypatch.setattr(_loader, "device_info", lambda device_id: _loader.DeviceInfo(
        sm_count=132, max_threads_per_sm=2048, regs_per_sm=65536, max_blocks_per_sm=32))
    attributes = {"MaxSharedMemoryPerMultiprocessor": 233472}
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda device_id: types.SimpleNamespace(attributes=attributes))))
    cases = [  # block, registers a thread, static shared bytes, blocks an SM
        (256, 32, 0, 8),  # threads and registers alike: 2048 / 256, 65536 / (32 * 32 * 8)
        (512, 16, 0, 4),  # threads: registers would take 8
        (256, 64, 0, 4),  # registers: 2048 a warp, 8 warps
        (256, 33, 0, 6),  # 1056 registers a warp given out as 1280
        (80, 64, 0, 10),  # a block of 2.5 warps takes 3 warps' registers
        (32, 16, 0, 32),  # threads would take 64: at most 32 blocks an SM
        (128, 32, 32 * 1024, 6),  # shared memory: 233472 // (32 KB + 1 KB)
        (1024, 255, 0, 1),  # registers would take none: one block all the same
    ]
    for index, (block, registers, shared, per_sm) in enumerate(cases):
        kernels[f"kernel{index}"] = types.SimpleNamespace(num_regs=registers, shared_size_bytes=shared)
        assert _loader.resident_grid("verify", f"kernel{index}", 0, block) == per_sm * 132, (block, registers, shared)
    # a CuPy that does not tell the SM's shared memory: no limit from it, rather than one block
    attributes.clear()
    kernels["unknown"] = types.SimpleNamespace(num_regs=32, shared_size_bytes=32 * 1024)
    assert _loader.resident_grid("verify", "unknown", 0, 128) == 16 * 132


def test_the_loader_hands_cupy_what_the_nvrtc_check_compiles_once_an_architecture_and_loads_it_on_each_device(
        monkeypatch):
    """What the loader gives CuPy to compile is what ``compile_specs()`` lists: the sources, options
    and name expressions that tests/test_rawkernels_compile.py compiles with NVRTC on machines
    without a GPU. A source compiles once for two devices of one architecture, and each device
    loads every kernel of it (CuPy stood in for)."""
    import sys
    import types

    compiled, loaded, current = [], [], []

    class Device:
        def __init__(self, device_id=0):
            self.id, self.compute_capability = device_id, "90"

        def __enter__(self):
            current.append(self.id)

        def __exit__(self, *exception):
            current.pop()

    class RawModule:
        def __init__(self, **arguments):
            compiled.append(arguments)

        def get_function(self, kernel):
            loaded.append((current[-1], kernel))
            return kernel

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=Device), RawModule=RawModule))
    monkeypatch.setattr(_loader, "_modules", {})
    monkeypatch.setattr(_loader, "_loaded", set())
    monkeypatch.setattr(_loader, "_key_locks", {})
    specs = _loader.compile_specs()
    for device_id in (0, 1):
        for spec in specs:
            _loader._module(spec.name, device_id)
            _loader._module(spec.name, device_id)
    assert len(compiled) == len(specs)
    for arguments, spec in zip(compiled, specs):
        assert arguments["code"] == spec.code and arguments["options"] == spec.options
        assert tuple(arguments.get("name_expressions", ())) == tuple(spec.name_expressions)
    assert sorted(loaded) == sorted((device_id, kernel) for device_id in (0, 1) for spec in specs
                                    for kernel in spec.kernels)

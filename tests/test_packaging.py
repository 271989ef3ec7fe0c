"""The wheel a user installs holds what the package needs at run time: every module, the CUDA
sources the loader compiles, and the ``py.typed`` marker of its typed API."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvcanary_cupy"


def _setuptools_builds_wheels() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1)  # bdist_wheel without the wheel package


@pytest.mark.skipif(not _setuptools_builds_wheels(), reason="needs setuptools >= 70.1 in this environment")
def test_wheel_holds_every_module_and_cuda_source(tmp_path):
    # a copy of what the build reads, so the checkout gets no build/ or egg-info of this build
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    shutil.copytree(PACKAGE, source / "kvcanary_cupy", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    build = ("import sys; from setuptools import build_meta; "
             "print(build_meta.build_wheel(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", build, str(out)], cwd=source, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    wheel = out / done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    wanted = {str(path.relative_to(ROOT)).replace("\\", "/") for path in PACKAGE.rglob("*")
              if path.is_file() and path.suffix in (".py", ".cu", ".cuh", ".typed") and "__pycache__" not in path.parts}
    assert {name for name in wanted if name.endswith((".cu", ".cuh"))}, "no CUDA sources found in the checkout"
    assert wanted <= names, sorted(wanted - names)
    assert not any(name.startswith(("tests/", "benchmarks/", "tools/")) for name in names)


@pytest.mark.skipif(not _setuptools_builds_wheels(), reason="needs setuptools >= 70.1 in this environment")
def test_sdist_holds_what_its_tests_need(tmp_path):
    """The source distribution runs its own tests: the package, the tests with their helpers, the
    docs and examples they check, the tools and benchmarks they run, and the license; not the
    measured results, which stay in the repository (the tests reading them skip without them)."""
    import tarfile

    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    for name in tracked.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, source / name)
    build = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=source, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    with tarfile.open(tmp_path / "dist" / done.stdout.strip().splitlines()[-1]) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    wanted = {"LICENSE", "README.md", "kvcanary_cupy/rawkernels/canary_common.cuh", "tests/conftest.py",
              "tests/_builders.py", "tests/_devices.py", "docs/SPEC.md", "examples/quickstart.py",
              "tools/canary_fuzz.py", "benchmarks/report.py"}
    assert wanted <= names, sorted(wanted - names)
    assert not any(name.startswith(("tests/results/", "benchmarks/results/")) or "__pycache__" in name
                   for name in names)


def _run_with_path_first(directory, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that imports from ``directory`` first; it must exit cleanly."""
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(directory), *sys.path]))
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
    out = _run_with_path_first(tmp_path, code).stdout
    assert out.startswith("cpu\nkv-canary: device: a CUDA device needs CuPy, which is installed but fails to import "
                          f"(cupy in {tmp_path / 'cupy'} is a directory without CuPy's modules"), out
    assert "  cuda backend: unavailable (CuPy is installed but fails to import: cupy in " in out and out.endswith("0\n")


def test_numba_that_fails_to_import_is_not_called_missing(tmp_path):
    """numba installed but failing to import (it refuses a NumPy newer than it supports, as after
    upgrading NumPy alone): a CPU op, a compile and the demo say so in one line, with numba's reason,
    and ``info`` does not advise installing it."""
    (tmp_path / "numba").mkdir()
    (tmp_path / "numba" / "__init__.py").write_text(
        "raise ImportError('Numba needs NumPy 2.3 or less. Got NumPy 2.4.')\n")
    code = ("import kvcanary_cupy as kc\n"
            "from kvcanary_cupy.__main__ import main\n"
            "try:\n"
            "    kc.compile_kernels(device='cpu')\n"
            "except RuntimeError as error:\n"
            "    print(error)\n"
            "print(main(['demo', '--device', 'cpu', '--steps', '2', '--no-progress']), main(['info']))\n")
    done = _run_with_path_first(tmp_path, code)
    message = ("kv-canary: arrays on the CPU run on the numba backend, and numba is installed but fails to import "
               "(Numba needs NumPy 2.3 or less. Got NumPy 2.4.)")
    assert done.stdout.startswith(message) and done.stderr.strip() == message, (done.stdout, done.stderr)
    assert ("cpu backend : unavailable (numba is installed but fails to import: Numba needs NumPy 2.3 or less. "
            "Got NumPy 2.4.;") in done.stdout and done.stdout.strip().endswith("2 0")

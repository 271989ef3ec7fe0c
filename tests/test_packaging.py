"""The wheel a user installs holds what the package needs at run time: every module, the CUDA
sources the loader compiles, and the ``py.typed`` marker of its typed API."""

from __future__ import annotations

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

"""The CPU backend's kernels under numba's bounds checking. numba does not check indices unless
asked, so an unguarded index there would read or write past an array as silently as a CUDA kernel
would. A child process with ``NUMBA_BOUNDSCHECK=1`` and a cache of its own (so that no build made
without the checks is loaded) runs the differential fuzz's hostile cases of every op: slots past
the pool and negative, pool rows past the table, lengths and offsets near int64's ends, corrupted
records, SWA tables, capacities that overflow; then seeds of the kc.Canary fuzz (tools/canary_fuzz.py),
whose engines also reach the session's own CPU kernels (SWA slot translation, run counts). Any
index out of range raises IndexError there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

CASES_PER_OP = 40

_CHILD = """
import sys
import numba
import numpy as np

@numba.njit
def past_the_end(values):
    return values[values.size]

try:
    past_the_end(np.zeros(3))
except IndexError:
    pass
else:
    sys.exit("numba's bounds checking is not on in this process")

import _fuzzcases as cases

for op, make in cases.MAKERS.items():
    for seed in range({count}):
        cases.RUNNERS[op](make(np.random.default_rng(seed), 2000), "cpu")
    print(op, {count}, "cases in bounds", flush=True)

import canary_fuzz

status = canary_fuzz.main(["--device", "cpu", "--start", "84", "--seeds", "12", "--forwards", "16"])
print("canary fuzz status", status, flush=True)
sys.exit(status)
"""


def test_every_op_and_the_session_stay_in_bounds_on_hostile_cases(tmp_path):
    tests = Path(__file__).resolve().parent
    path = os.pathsep.join([str(tests), str(tests.parent), str(tests.parent / "tools"),
                            os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=path,
               CUDA_VISIBLE_DEVICES="")  # the CPU backend only, even on a GPU machine
    child = subprocess.run([sys.executable, "-c", _CHILD.format(count=CASES_PER_OP)], env=env,
                           capture_output=True, text=True, timeout=1800)
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-4000:]
    assert child.stdout.count("cases in bounds") == 6, child.stdout
    assert "canary fuzz status 0" in child.stdout, child.stdout[-2000:]


def test_a_host_sources_words_run_from_row_0_to_its_last_used_byte():
    """The CPU backend reads a host source's KV through ``host_words()``: one flat word view from
    row 0 to the source's last used byte. It reaches every byte a slot hashes and nothing past the
    buffer: rows strided by 48 bytes of which 32 are used end 16 bytes before the buffer does."""
    import numpy as np

    import kvcanary_cupy as kc

    buffer = np.random.default_rng(71).integers(1, 256, size=(5, 48), dtype=np.uint8)
    view = buffer[:, :32]
    source = kc.RealKvSource(tensor=view, page_size=2, num_bytes_per_token=16, read_bytes=16)
    words = source.host_words()
    assert words.dtype == np.uint64 and words.nbytes == 4 * 48 + 32
    assert words.__array_interface__["data"][0] == buffer.__array_interface__["data"][0]
    raw = words.view(np.uint8)
    assert all((raw[row * 48:row * 48 + 32] == view[row]).all() for row in range(5))

import itertools
import pathlib
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CuPy and a CUDA device (skipped otherwise)")


@pytest.fixture
def ticking_clock(monkeypatch):
    """``ticking_clock(start, tick)``: ``time.perf_counter`` reads ``start`` first and ``tick`` seconds
    more at every later reading, so that timings come out as counts of readings, whatever the machine."""
    def install(start: float, tick: float) -> None:
        readings = itertools.count()
        monkeypatch.setattr(time, "perf_counter", lambda: start + next(readings) * tick)
    return install

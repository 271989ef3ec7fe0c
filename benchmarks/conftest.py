"""The ratio summary of the CPU benchmarks: ``ratio_log`` collects (op, entries, numba s, reference s)
and the terminal summary prints the speedups."""

import pytest

_RATIOS = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def ratio_log(pytestconfig):
    return pytestconfig.stash.setdefault(_RATIOS, [])


def pytest_terminal_summary(terminalreporter, config):
    rows = config.stash.get(_RATIOS, [])
    if not rows:
        return
    terminalreporter.section("numba backend vs plain-Python reference")
    for op, entries, fast, slow in rows:
        terminalreporter.write_line(f"{op:>7}: {entries} entries  numba {fast * 1e3:9.3f} ms  "
                                    f"reference {slow * 1e3:10.1f} ms  speedup x{slow / fast:,.0f}")

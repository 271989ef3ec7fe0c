import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CuPy and a CUDA device (skipped otherwise)")

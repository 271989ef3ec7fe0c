"""The probes in tools/ import on a machine without a GPU (they need one only to run): a helper
renamed or moved in the package or in tools/_probe.py breaks them here, not in the next GPU session."""

from __future__ import annotations

import pytest
from _tools import TOOLS, import_tools


@pytest.mark.parametrize("name", TOOLS)
def test_tool_imports(name):
    (module,) = import_tools(name)
    assert module.__doc__, f"tools/{name}.py says what it is for"

"""Decoding of the shared conformance cases (``../shared/conformance/cases.json``)."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

# KVCANARY_CONFORMANCE points elsewhere (a machine where ../shared is not beside the checkout).
CASES_PATH = pathlib.Path(os.environ.get(
    "KVCANARY_CONFORMANCE", pathlib.Path(__file__).resolve().parents[2] / "shared" / "conformance" / "cases.json"))


def load_cases() -> list[dict]:
    if not CASES_PATH.exists():
        return []
    return json.loads(CASES_PATH.read_text())["cases"]


def hex_bytes(text: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(text), dtype=np.uint8).copy()


def i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def canary_buffer(case: dict) -> np.ndarray:
    raw = hex_bytes(case["canary_buf"])
    return raw.reshape(case["num_slots"], -1)


def source_views(case: dict) -> list[tuple[np.ndarray, dict]]:
    """Each source as a (possibly strided) uint8 view [rows, row_bytes] over its parent rows."""
    views = []
    for src in case["sources"]:
        parent = hex_bytes(src["data"]).reshape(src["rows"], src["row_stride_bytes"])
        views.append((parent[:, : src["row_bytes"]], src))
    return views

"""The canary's wire format: hash constants, slot field offsets, ring columns, bits and tags.

Everything both backends must agree on lives here once. The CUDA sources receive these values as
NVRTC ``-D`` options built by :func:`nvrtc_defines`, so the kernels never hard-code a constant that
could drift from the numba backend.
"""

from __future__ import annotations

import enum

# --- hash -------------------------------------------------------------------------------------
SPLITMIX_MUL_1 = 0xBF58476D1CE4E5B9
SPLITMIX_MUL_2 = 0x94D049BB133111EB
SPLITMIX_SHIFT_1 = 30
SPLITMIX_SHIFT_2 = 27
SPLITMIX_SHIFT_3 = 31
CHAIN_ANCHOR = 0xC0FFEE1234567890
U64_MASK = (1 << 64) - 1

# --- canary slot: four int64 words at the start of each slot -----------------------------------
FIELD_TOKEN = 0
FIELD_POSITION = 1
FIELD_PREV_HASH = 2
FIELD_REAL_KV_HASH = 3
SLOT_FIELD_COUNT = 4
SLOT_WORD_BYTES = 8
MIN_SLOT_STRIDE_BYTES = SLOT_FIELD_COUNT * SLOT_WORD_BYTES
# copy_records' staging row (either backend gathers it, either scatters it): a slot's four fields,
# then 1 where the source slot was in range
STAGED_RECORD_WORDS = SLOT_FIELD_COUNT + 1
STAGED_IN_RANGE = SLOT_FIELD_COUNT
PADDING_SLOT = 0

# --- violation ring ----------------------------------------------------------------------------
RING_COLUMNS = 8
RING_COL_KERNEL_KIND = 0
RING_COL_SLOT = 1
RING_COL_POSITION = 2
RING_COL_STORED_TOKEN = 3
RING_COL_EXPECTED_TOKEN = 4
RING_COL_STORED_CHAIN_HASH = 5
RING_COL_EXPECTED_AUX = 6
RING_COL_FAIL_BITS = 7

# --- real-KV sources ---------------------------------------------------------------------------
SOURCE_ALIGN_BYTES = 16
PARTIAL_READ_BYTES = 16
# A source reaches a kernel as one row of this many int64 words.
SRC_BASE_ADDRESS = 0
SRC_ROW_STRIDE_BYTES = 1
SRC_NUM_ROWS = 2
SRC_PAGE_SIZE = 3
SRC_BYTES_PER_TOKEN = 4
SRC_READ_BYTES = 5
SOURCE_DESCRIPTOR_WORDS = 6

# --- plans -------------------------------------------------------------------------------------
NO_PREDECESSOR = -1
NO_EXPECTED_TOKEN = -1
INT64_MAX = (1 << 63) - 1
UNRESOLVED_SLOT = INT64_MAX
INT32_MAX = (1 << 31) - 1


class HashMode(enum.IntEnum):
    """How much of each slot's real KV bytes is folded into ``real_kv_hash``."""

    NONE = 0
    PARTIAL = 1
    ALL = 2


class LaunchTag(enum.IntEnum):
    """``kernel_kind`` of a violation row: which launch found it."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11


class FailReason(enum.IntFlag):
    """``fail_reason_bits`` of a violation row."""

    CHAIN_HASH = 1
    POSITION = 2
    REAL_KV_HASH = 4
    WRITE_TOKEN = 8
    WRITE_POSITION = 16
    VERIFY_TOKEN = 32
    OUT_OF_RANGE = 64


def _c_u64(value: int) -> str:
    return f"0x{value & U64_MASK:016X}ULL"


def nvrtc_defines() -> tuple[str, ...]:
    """The ``-D`` options that hand this module's constants to the CUDA sources."""
    values = {
        "KVC_SPLITMIX_MUL_1": _c_u64(SPLITMIX_MUL_1),
        "KVC_SPLITMIX_MUL_2": _c_u64(SPLITMIX_MUL_2),
        "KVC_SPLITMIX_SHIFT_1": str(SPLITMIX_SHIFT_1),
        "KVC_SPLITMIX_SHIFT_2": str(SPLITMIX_SHIFT_2),
        "KVC_SPLITMIX_SHIFT_3": str(SPLITMIX_SHIFT_3),
        "KVC_CHAIN_ANCHOR": _c_u64(CHAIN_ANCHOR),
        "KVC_FIELD_TOKEN": str(FIELD_TOKEN),
        "KVC_FIELD_POSITION": str(FIELD_POSITION),
        "KVC_FIELD_PREV_HASH": str(FIELD_PREV_HASH),
        "KVC_FIELD_REAL_KV_HASH": str(FIELD_REAL_KV_HASH),
        "KVC_SLOT_FIELD_COUNT": str(SLOT_FIELD_COUNT),
        "KVC_STAGED_RECORD_WORDS": str(STAGED_RECORD_WORDS),
        "KVC_STAGED_IN_RANGE": str(STAGED_IN_RANGE),
        "KVC_PADDING_SLOT": str(PADDING_SLOT),
        "KVC_RING_COLUMNS": str(RING_COLUMNS),
        "KVC_RING_COL_KERNEL_KIND": str(RING_COL_KERNEL_KIND),
        "KVC_RING_COL_SLOT": str(RING_COL_SLOT),
        "KVC_RING_COL_POSITION": str(RING_COL_POSITION),
        "KVC_RING_COL_STORED_TOKEN": str(RING_COL_STORED_TOKEN),
        "KVC_RING_COL_EXPECTED_TOKEN": str(RING_COL_EXPECTED_TOKEN),
        "KVC_RING_COL_STORED_CHAIN_HASH": str(RING_COL_STORED_CHAIN_HASH),
        "KVC_RING_COL_EXPECTED_AUX": str(RING_COL_EXPECTED_AUX),
        "KVC_RING_COL_FAIL_BITS": str(RING_COL_FAIL_BITS),
        "KVC_PARTIAL_READ_BYTES": str(PARTIAL_READ_BYTES),
        "KVC_SRC_BASE_ADDRESS": str(SRC_BASE_ADDRESS),
        "KVC_SRC_ROW_STRIDE_BYTES": str(SRC_ROW_STRIDE_BYTES),
        "KVC_SRC_NUM_ROWS": str(SRC_NUM_ROWS),
        "KVC_SRC_PAGE_SIZE": str(SRC_PAGE_SIZE),
        "KVC_SRC_BYTES_PER_TOKEN": str(SRC_BYTES_PER_TOKEN),
        "KVC_SRC_READ_BYTES": str(SRC_READ_BYTES),
        "KVC_SOURCE_DESCRIPTOR_WORDS": str(SOURCE_DESCRIPTOR_WORDS),
        "KVC_NO_EXPECTED_TOKEN": f"({NO_EXPECTED_TOKEN}LL)",
        "KVC_UNRESOLVED_SLOT": f"0x{UNRESOLVED_SLOT:X}LL",
        "KVC_INT32_MAX": f"0x{INT32_MAX:X}LL",
        "KVC_I64_MAX": f"0x{INT64_MAX:X}LL",
        "KVC_BIT_CHAIN_HASH": str(int(FailReason.CHAIN_HASH)),
        "KVC_BIT_POSITION": str(int(FailReason.POSITION)),
        "KVC_BIT_REAL_KV_HASH": str(int(FailReason.REAL_KV_HASH)),
        "KVC_BIT_WRITE_TOKEN": str(int(FailReason.WRITE_TOKEN)),
        "KVC_BIT_WRITE_POSITION": str(int(FailReason.WRITE_POSITION)),
        "KVC_BIT_VERIFY_TOKEN": str(int(FailReason.VERIFY_TOKEN)),
        "KVC_BIT_OUT_OF_RANGE": str(int(FailReason.OUT_OF_RANGE)),
    }
    return tuple(f"-D{name}={value}" for name, value in values.items())

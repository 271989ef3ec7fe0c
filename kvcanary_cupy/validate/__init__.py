"""Host-side argument checks for every public entry point (SPEC §4).

The dataclasses and ops call these before any backend runs, so a rejected call changes nothing.
"""

from .rules import (  # noqa: F401
    PREFIX,
    adopt_views,
    aligned,
    at_least,
    boolean,
    both_or_neither,
    c_contiguous,
    dtype,
    elements_aligned,
    fits_int32,
    host_int64,
    instance,
    int32_scalar,
    int64_scalar,
    integer,
    length,
    ndim,
    non_negative,
    non_negative_row_stride,
    one_device,
    member,
    positive,
    positive_multiple,
    rows_contiguous,
    source_read_bytes,
    source_rows,
    scalar_cell,
    shape_text,
    slot_count,
    table,
    vector,
    writable,
)

"""kvcanary_cupy: catch silent KV-cache corruption in LLM serving engines.

A small canary buffer beside the KV pool fingerprints every slot as tokens are written (a hash chain
of token, position and predecessor, plus a hash of the real KV bytes); verify re-checks the slots a
batch reads and records every mismatch in a violation ring. Arrays on a CUDA device run CuPy
RawKernels; host arrays run the numba backend, which is also the GPU's bit-exact oracle.
"""

from ._layout import FailReason, HashMode, LaunchTag, UNRESOLVED_SLOT
from .capacities import Capacities
from .context import CanaryContext, Violation, ViolationReport, VerifyPlan, WritePlan
from .ops import CanaryStep, copy_records, plan, scatter_req_token_ids, verify, write
from .sources import RealKvSource
from .precompile import compile_kernels
from . import block_tables, layouts
from .session import (Canary, CanaryEvent, CanaryReport, CanaryViolation, ForwardBatch, LiveRequests,
                      StaticForward, SwaGroup)

__version__ = "0.1.0"

__all__ = [
    "Canary",
    "CanaryEvent",
    "CanaryReport",
    "CanaryStep",
    "CanaryViolation",
    "Capacities",
    "ForwardBatch",
    "LiveRequests",
    "StaticForward",
    "SwaGroup",
    "block_tables",
    "layouts",
    "CanaryContext",
    "FailReason",
    "HashMode",
    "LaunchTag",
    "RealKvSource",
    "UNRESOLVED_SLOT",
    "VerifyPlan",
    "Violation",
    "ViolationReport",
    "WritePlan",
    "compile_kernels",
    "copy_records",
    "plan",
    "scatter_req_token_ids",
    "verify",
    "write",
    "__version__",
]

"""The ops (plan, verify, write, scatter, copy_records) and the prepared canary step, each validating on the host then dispatching to the backend of its arrays' device."""

from .copy_records import copy_records
from .plan import plan
from .scatter import scatter_req_token_ids
from .step import CanaryStep
from .verify import verify
from .write import write

__all__ = ["CanaryStep", "copy_records", "plan", "scatter_req_token_ids", "verify", "write"]

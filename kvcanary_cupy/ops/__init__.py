"""The four ops and the prepared canary step, each validating on the host then dispatching to the backend of its arrays' device."""

from .plan import plan
from .scatter import scatter_req_token_ids
from .step import CanaryStep
from .verify import verify
from .write import write

__all__ = ["CanaryStep", "plan", "scatter_req_token_ids", "verify", "write"]

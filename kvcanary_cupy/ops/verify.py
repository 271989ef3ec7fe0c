"""verify: re-check the slots a batch is about to read (SPEC §3.2)."""

from __future__ import annotations

from typing import Any

from .. import validate as check
from ..context import CanaryContext, VerifyPlan, require_intact
from ._dispatch import backend_module, launch_scope
from .batches import launch_tag


def verify(ctx: CanaryContext, vplan: VerifyPlan, *, tag: int, check_expected_token: bool = False,
           stream: Any = None) -> None:
    """Check every planned slot's token, position, chain link and real-KV hash; record mismatches.

    Reads the canary buffer only; writes the violation ring and counters. ``num_valid`` and
    ``enable`` are read by the backend, never by the host.
    """
    check.instance("ctx", ctx, CanaryContext)
    check.instance("vplan", vplan, VerifyPlan)
    require_intact(ctx, CanaryContext.VERIFY_WRITES)
    require_intact(vplan, writes=())  # read only, but its capacity bounds the entries checked
    tag = launch_tag(tag)
    check_expected_token = check.boolean("check_expected_token", check_expected_token)
    with launch_scope({"ctx": ctx.device, "vplan": vplan.device}, stream) as (device, resolved):
        backend_module(device, "verify").verify(ctx, vplan, tag=tag, check_expected_token=check_expected_token,
                                                stream=resolved)

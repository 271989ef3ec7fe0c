"""The canary step on the CPU: plan, verify and write in turn (host memory has no launches to save).

The verify plan is sized to the batch's entries (it grows when a batch needs more), not to the
step's verify capacity; a batch past that capacity gets an empty plan, which disables its verify
exactly as an overflowing plan would."""

from __future__ import annotations

from ....context import VerifyPlan
from . import plan as plan_backend
from . import verify as verify_backend
from . import write as write_backend


class _CpuStep:
    def __init__(self, ctx, wplan, batch, writes, *, verify_capacity: int, verify_tag: int,
                 check_expected_token: bool):
        self.ctx, self.wplan, self.batch, self.writes = ctx, wplan, batch, writes
        self.verify_capacity = verify_capacity
        self.verify_tag = verify_tag
        self.check_expected_token = check_expected_token
        self.vplan = VerifyPlan.allocate(0)
        self.overflow_plan = self.vplan

    def __call__(self, stream=None) -> None:
        total = plan_backend.verify_total(self.batch)
        if total > self.verify_capacity:
            vplan = self.overflow_plan
        else:
            if total > self.vplan.capacity:
                self.vplan = VerifyPlan.allocate(total)
            vplan = self.vplan
        plan_backend.plan(vplan, self.wplan, self.batch)
        verify_backend.verify(self.ctx, vplan, tag=self.verify_tag, check_expected_token=self.check_expected_token)
        write_backend.write(self.ctx, self.wplan, self.writes)


def prepare(ctx, wplan, batch, writes, **settings) -> list:
    return [_CpuStep(ctx, wplan, batch, writes, **settings)]

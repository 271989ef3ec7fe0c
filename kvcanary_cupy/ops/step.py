"""The canary step: one forward's verify of every slot it reads and write of its new tokens, prepared once."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .. import validate as check
from .._dlpack import own_view
from ..context import CanaryContext, WritePlan, require_intact
from ._dispatch import backend_module, check_stream_form, launch_scope, resolve_stream
from .batches import PlanBatch, WriteBatch, launch_tag


@dataclasses.dataclass(frozen=True)
class StepVerify:
    """How the step verifies: the verify plan's capacity it stands in for, the tag, the token check."""

    capacity: int
    tag: int
    check_expected_token: bool = False

    def __post_init__(self) -> None:
        capacity = check.fits_int32("verify_capacity", check.non_negative("verify_capacity", self.capacity))
        object.__setattr__(self, "capacity", capacity)
        object.__setattr__(self, "tag", launch_tag(self.tag, "verify_tag"))
        object.__setattr__(self, "check_expected_token",
                           check.boolean("check_expected_token", self.check_expected_token))


class CanaryStep:
    """One forward's canary work, validated once and launched every step.

    ``launch()`` verifies every prefix slot the batch reads (SPEC §3.2, entries as ``kc.plan``
    derives them) and then writes the batch's new tokens (SPEC §3.1). Every output — canary buffer,
    violation rows, write index, counters — equals what ``kc.plan`` into a verify plan of
    ``verify_capacity`` entries, ``kc.verify(tag=verify_tag)`` and ``kc.write(tag=write_tag)`` would
    leave; a batch with more entries than ``verify_capacity`` skips its verify, as an overflowing plan
    does. On a GPU no verify plan is materialised: the kernel derives each entry from
    ``req_to_token`` where it checks it, and a decode batch (at most two new tokens per request on
    average, at most 512 requests) is one launch; otherwise two.

    The arrays are bound here: refill them in place between launches, as for a captured CUDA graph.
    Call ``launch`` after the forward has written its KV, since the write fingerprints those bytes.
    On a GPU, building a step waits for CuPy's current stream, where its arrays are zeroed, so that
    a launch on any stream finds them zeroed.
    """

    def __init__(self, ctx: CanaryContext, *, verify_capacity: int, verify_tag: int, write_tag: int,
                 req_pool_indices: Any, prefix_lens: Any, extend_seq_lens: Any, req_to_token: Any,
                 input_ids: Any, positions: Any, out_cache_loc: Any,
                 swa_window_size: int = 0, full_to_swa_index_mapping: Optional[Any] = None,
                 req_to_verify_expected_tokens: Optional[Any] = None,
                 req_to_verify_expected_tokens_valid_lens: Optional[Any] = None,
                 kv_token_id_vs_position_offset: int = 0, check_expected_token: bool = False,
                 expected_input_tokens: Optional[Any] = None, expected_input_positions: Optional[Any] = None):
        check.instance("ctx", ctx, CanaryContext)
        require_intact(ctx, CanaryContext.WRITE_WRITES)
        settings = StepVerify(capacity=verify_capacity, tag=verify_tag, check_expected_token=check_expected_token)
        # Launched on every step long after it was validated: the step's own views (see own_view).
        arrays = {name: own_view(value) for name, value in locals().items()}
        batch = PlanBatch.from_arguments(arrays)
        writes = WriteBatch(tag=launch_tag(write_tag, "write_tag"),
                            **{name: arrays[name] for name in ("input_ids", "positions", "out_cache_loc",
                                                               "expected_input_tokens", "expected_input_positions")})
        devices = {"ctx": ctx.device, "req_pool_indices": batch.device, "input_ids": writes.device}
        self.device = check.one_device(devices)
        # What the step stores into (the canary buffer, the ring, its counters) must not be what it
        # reads: the CPU verifies the whole batch before it writes, a GPU launch does both at once.
        read = {name: value for bundle in (batch, writes) for name, value in vars(bundle).items()
                if name != "device" and hasattr(value, "__dlpack__")}
        check.stored_apart({f"ctx.{name}": getattr(ctx, name) for name in CanaryContext.WRITE_WRITES}, read)
        self.ctx, self.settings, self.batch, self.writes = ctx, settings, batch, writes
        with launch_scope({"step": self.device}, None):
            self.write_plan = WritePlan.allocate(batch.batch_size, device=self.device)
            self._launches = backend_module(self.device, "step").prepare(
                ctx, self.write_plan, batch, writes, verify_capacity=settings.capacity, verify_tag=settings.tag,
                check_expected_token=settings.check_expected_token)

    @property
    def num_launches(self) -> int:
        """Kernel launches per step on this device (on a GPU, 1 for a decode batch of up to 512
        requests; otherwise 2)."""
        return len(self._launches)

    def launch(self, *, stream: Any = None) -> None:
        """Run the step on ``stream`` (default: CuPy's current stream). On a GPU its packed launches
        run as prepared; on the host the context's arrays are checked again (their forms and
        writability), since the CPU's launches read them as they are."""
        if self.device.is_cuda:
            # The hot path of an eager engine: no context manager beyond the device's own.
            import cupy

            with cupy.cuda.Device(self.device.index):
                resolved = resolve_stream(stream, self.device)
                for launch in self._launches:
                    launch(resolved)
            return
        check_stream_form(stream)
        # host arrays can be made read-only or reshaped after the step was built
        require_intact(self.ctx, CanaryContext.WRITE_WRITES)
        for launch in self._launches:
            launch(None)


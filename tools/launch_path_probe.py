"""Where an eager op's host time goes, on a GPU: each part of ``kc.plan`` and ``kc.write`` timed on
its own (argument bundle, checks, device scope, launch), the launch through CuPy's ``RawKernel``
call against the same launch with its parameters packed by ``struct`` into one block and handed to
``cuLaunchKernel``, and the cost of adopting PyTorch tensors through DLPack. Small decode batch,
random data; parts are timed in rounds so a machine's drift shows.

    PYTHONPATH=. python tools/launch_path_probe.py [--calls 5000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import ctypes
import struct
import time

import cupy as cp
import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy import validate as check
from kvcanary_cupy._dlpack import device_of, native_view
from kvcanary_cupy.context import require_intact
from kvcanary_cupy.ops._dispatch import launch_scope
from kvcanary_cupy.ops.backends._cuda import plan as cuda_plan
from kvcanary_cupy.ops.backends._cuda import write as cuda_write
from kvcanary_cupy.ops.batches import PlanBatch, WriteBatch

_CODES = {np.int64: "q", np.int32: "i4x", np.uint64: "Q", np.uint32: "I4x"}


class StructLaunch:
    """The alternative launch path: a parameter block per kernel, refilled by one ``pack_into``."""

    def __init__(self, fn, args):
        types = tuple(map(type, args))
        self.format = "<" + "".join(_CODES.get(kind, "Q") for kind in types)
        self.cells = ctypes.create_string_buffer(8 * len(types))
        base = ctypes.addressof(self.cells)
        self.pointers = (ctypes.c_void_p * len(types))(*[base + 8 * i for i in range(len(types))])
        self.address = ctypes.addressof(self.pointers)
        self.function = fn.kernel.ptr

    def __call__(self, grid, block, args, stream):
        values = [int(a) if isinstance(a, np.generic) else a.data.ptr for a in args]
        struct.pack_into(self.format, self.cells, 0, *values)
        cp.cuda.driver.launchKernel(self.function, grid, 1, 1, block, 1, 1, 0, stream.ptr, self.address, 0)


def per_call_us(call, calls: int) -> float:
    for _ in range(200):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    cp.cuda.Device().synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(3)
    bs = 8
    ctx = kc.CanaryContext.allocate(1 << 16, device="cuda")
    vplan = kc.VerifyPlan.allocate(1024, device="cuda")
    wplan = kc.WritePlan.allocate(bs, device="cuda")
    table = rng.permutation(1 << 16)[: (bs + 1) * 64].astype(np.int32).reshape(bs + 1, 64)
    batch = dict(req_pool_indices=cp.arange(1, bs + 1, dtype=cp.int64),
                 prefix_lens=cp.asarray(rng.integers(1, 63, bs), dtype=cp.int64),
                 extend_seq_lens=cp.ones(bs, dtype=cp.int64), req_to_token=cp.asarray(table))
    writes = dict(input_ids=cp.asarray(rng.integers(0, 1 << 17, bs), dtype=cp.int64),
                  positions=batch["prefix_lens"].copy(), out_cache_loc=cp.asarray(table[1:, 63].astype(np.int64)))
    stream = cp.cuda.get_current_stream()
    plan_batch = PlanBatch(**batch)
    write_batch = WriteBatch(tag=kc.LaunchTag.TAIL_K_FULL, **writes)
    devices = {"vplan": vplan.device, "wplan": wplan.device, "req_pool_indices": plan_batch.device}

    if hasattr(cuda_plan, "prepare"):
        plan_launch = cuda_plan.prepare(vplan, wplan, plan_batch)
        fn, grid, block, plan_args = plan_launch.fn, plan_launch.grid[0], plan_launch.block[0], plan_launch.args
    else:  # a tree whose plan launcher launches at once: its arguments captured on the way
        captured = {}
        real_launch = cuda_plan.launch

        def capture(fn, grid, block, kernel_args, launch_stream):
            captured["plan"] = (fn, grid, block, kernel_args)
            real_launch(fn, grid, block, kernel_args, launch_stream)

        cuda_plan.launch = capture
        try:
            cuda_plan.plan(vplan, wplan, plan_batch, stream=stream)
        finally:
            cuda_plan.launch = real_launch
        fn, grid, block, plan_args = captured["plan"]
    packed_plan = StructLaunch(fn, plan_args)
    write_launch = cuda_write.prepare(ctx, wplan, write_batch)
    packed_write = StructLaunch(write_launch.fn, write_launch.args)

    def scope():
        with launch_scope(devices, None):
            pass

    def cupy_plan_launch():
        with stream:
            fn((grid,), (block,), plan_args)

    def cupy_write_launch():
        with stream:
            write_launch.fn(write_launch.grid, write_launch.block, write_launch.args)

    canary = kc.Canary(pool_slot_count=1 << 16, req_to_token=batch["req_to_token"], device="cuda", mode="log",
                       capacities=kc.Capacities.from_args(req_to_token_pool_size=bs + 1, max_seq_len_per_req=64,
                                                          pool_slot_count=1 << 16, max_prefill_tokens=64))
    forward = kc.ForwardBatch(**{k: v for k, v in batch.items() if k != "req_to_token"}, **writes)

    def session_forward():
        canary.before_forward(forward)
        canary.after_forward(forward)

    # 100 batches of fresh arrays in turn, one geometry at 100 addresses each array
    rotating = [kc.ForwardBatch(**{k: v.copy() for k, v in batch.items() if k != "req_to_token"},
                                **{k: v.copy() for k, v in writes.items()}) for _ in range(100)]
    turn = [0]

    def session_forward_rotating(session):
        turn[0] = (turn[0] + 1) % len(rotating)
        session.before_forward(rotating[turn[0]])
        session.after_forward(rotating[turn[0]])

    # the same with nothing prepared: every forward validated and converted (a tree that prepares
    # nothing, or a canary told never to)
    unprepared = kc.Canary(pool_slot_count=1 << 16, req_to_token=batch["req_to_token"], device="cuda", mode="log",
                           capacities=canary.capacities)
    for cache in ("_prepared_plans", "_prepared_writes"):
        if hasattr(unprepared, cache):
            getattr(unprepared, cache).second_meeting = lambda geometry: False

    vector = batch["prefix_lens"]
    parts = {
        "kc.Canary forward (before + after), same arrays": session_forward,
        "  before_forward": lambda: canary.before_forward(forward),
        "kc.Canary forward, 100 fresh batches in turn": lambda: session_forward_rotating(canary),
        "kc.Canary forward, 100 fresh batches, nothing prepared": lambda: session_forward_rotating(unprepared),
        "kc.plan, whole call": lambda: kc.plan(vplan, wplan, **batch),
        "  PlanBatch(...) (adopt + check 4 arrays)": lambda: PlanBatch(**batch),
        "  require_intact x2": lambda: (require_intact(vplan), require_intact(wplan)),
        "  launch_scope enter+exit": scope,
        "  backend plan (arguments + launch)": lambda: cuda_plan.plan(vplan, wplan, plan_batch, stream=stream),
        "    batch_args": lambda: cuda_plan.batch_args(plan_batch),
        "    plan launch through CuPy (30 args)": cupy_plan_launch,
        "    plan launch through struct block": lambda: packed_plan(grid, block, plan_args, stream),
        "kc.write, whole call": lambda: kc.write(ctx, wplan, tag=kc.LaunchTag.TAIL_K_FULL, **writes),
        "  WriteBatch(...) (adopt + check 3 arrays)": lambda: WriteBatch(tag=kc.LaunchTag.TAIL_K_FULL, **writes),
        "  backend write (arguments + launch)": lambda: cuda_write.write(ctx, wplan, write_batch, stream=stream),
        "    write prepare (arguments)": lambda: cuda_write.prepare(ctx, wplan, write_batch),
        "    write launch through CuPy (22 args)": cupy_write_launch,
        "    write launch through struct block": lambda: packed_write(write_launch.grid[0], write_launch.block[0],
                                                              write_launch.args, stream),
        "kc.verify, whole call": lambda: kc.verify(ctx, vplan, tag=kc.LaunchTag.HEAD_K_FULL),
        "rule: device_of(cupy)": lambda: device_of(vector, "x"),
        "rule: native_view(cupy)": lambda: native_view(vector, "x"),
        "rule: check.vector(cupy)": lambda: check.vector("x", vector, np.int64, bs, "why"),
        "rule: check.table(cupy)": lambda: check.table("x", batch["req_to_token"], np.int32),
    }
    if hasattr(canary, "static_forward"):  # a tree that has it
        static = canary.static_forward(forward)

        def static_forward():
            static.before()
            static.after()

        parts["kc.Canary.static_forward, before + after"] = static_forward
    try:
        import torch  # noqa: PLC0415

        torch_batch = {name: torch.from_dlpack(value) for name, value in batch.items()}
        parts["kc.plan, whole call, torch tensors"] = lambda: kc.plan(vplan, wplan, **torch_batch)
        parts["rule: device_of(torch)"] = lambda: device_of(torch_batch["prefix_lens"], "x")
        parts["rule: native_view(torch)"] = lambda: native_view(torch_batch["prefix_lens"], "x")
        parts["cupy.from_dlpack(torch) (DLPack's exchange)"] = lambda: cp.from_dlpack(torch_batch["prefix_lens"])
        torch_canary = kc.Canary(pool_slot_count=1 << 16, req_to_token=torch_batch["req_to_token"], device="cuda",
                                 mode="log", capacities=canary.capacities)
        torch_forward = kc.ForwardBatch(**{k: v for k, v in torch_batch.items() if k != "req_to_token"},
                                        **{k: torch.from_dlpack(v) for k, v in writes.items()})

        def torch_session_forward():
            torch_canary.before_forward(torch_forward)
            torch_canary.after_forward(torch_forward)

        parts["kc.Canary forward, torch tensors, same tensors"] = torch_session_forward
    except ImportError:
        pass
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, cupy {cp.__version__}, bs {bs} decode, "
          f"{args.calls} calls a part, host us a call, one column a round")
    rows = {name: [] for name in parts}
    for _ in range(args.rounds):
        for name, call in parts.items():
            rows[name].append(per_call_us(call, args.calls))
    for name, times in rows.items():
        print(f"{name:<48}" + "".join(f"{t:>9.2f}" for t in times))


if __name__ == "__main__":
    main()

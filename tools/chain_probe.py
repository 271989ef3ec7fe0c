"""The serial hash chains on a GPU: a bare one-thread chain against the write kernel's chain.

    python tools/chain_probe.py [DIR ...]   # DIR: write.cu and its headers to compare with
    ROUNDS_AB=3 python tools/chain_probe.py DIR   # alternate DIR and this tree three times
    (DIR from an earlier commit: git archive REV kvcanary_cupy/rawkernels | tar -x -C DIR --strip-components=2)

1. Bare chains (one thread, inputs staged in shared memory, so nothing but the chain is serial):
   ``mix3`` is the write's chain step (running = mix3(running, token, position)) and ``fold`` a
   real-KV fold step (acc = sm(acc ^ word)). FORMS: as the kernels write it (``plain``, with the
   split multiply of ``kvc_mul64``), on the "pending" form, and with the multiply written two other
   ways. Every form must give the same value.
2. The write op, graph-timed (no host time), on prefill and decode cases: us and ns per chained
   token, for comparison with the bare chain of the same run.
3. The write op with one warp a request and with two (write.cu's kPaired), forced.
   WRITE_PATCHES: write.cu with parts of the chunk loop left out.
4. clock64 stamps at CLOCK_POINTS of the chunk loop: cycles per token between them. The stamps
   perturb the schedule, so the breakdown shows where time goes, not exact totals.
"""

from __future__ import annotations

import os
import pathlib
import sys

import cupy
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _shapes as S  # noqa: E402
from _probe import event_timed, timed, timed_cold, use_sources  # noqa: E402
from kvcanary_cupy.rawkernels import _loader  # noqa: E402

TOKENS = 2048   # staged in shared memory (2 x 16 KB)
ROUNDS = 16     # passes over them: 32768 chained steps a launch

SOURCE = r"""
#include "canary_common.cuh"
#define KVC_PROBE_TOKENS %(tokens)d

// The "pending" form of an sm chain: sm's value with its last xor-shift still to do. That
// xor-shift and the next sm's first are linear over GF(2) and fold into one xor of four shifts
// (one dependent instruction fewer per sm). Measured on the H200: no gain on mix3 (the 3-deep
// IMAD chain of each 64-bit multiply dominates), 4 %% on the fold; the kernels keep the plain form.
__device__ __forceinline__ kvc_u64 kvc_xs1(kvc_u64 x) { return x ^ (x >> KVC_SPLITMIX_SHIFT_1); }
__device__ __forceinline__ kvc_u64 kvc_sm_core(kvc_u64 a) {
    const kvc_u64 b = kvc_mul64(a, (kvc_u64)KVC_SPLITMIX_MUL_1);
    return kvc_mul64(b ^ (b >> KVC_SPLITMIX_SHIFT_2), (kvc_u64)KVC_SPLITMIX_MUL_2);
}
__device__ __forceinline__ kvc_u64 kvc_sm_value(kvc_u64 d) { return d ^ (d >> KVC_SPLITMIX_SHIFT_3); }
__device__ __forceinline__ kvc_u64 kvc_sm_unvalue(kvc_u64 v) {
    return v ^ (v >> KVC_SPLITMIX_SHIFT_3) ^ (v >> (2 * KVC_SPLITMIX_SHIFT_3));
}
// kvc_sm_core(kvc_xs1(kvc_sm_value(d) ^ k)) given kx = kvc_xs1(k)
__device__ __forceinline__ kvc_u64 kvc_sm_next(kvc_u64 d, kvc_u64 kx) {
    return kvc_sm_core(d ^ (d >> KVC_SPLITMIX_SHIFT_3) ^ (d >> KVC_SPLITMIX_SHIFT_1) ^
                       (d >> (KVC_SPLITMIX_SHIFT_1 + KVC_SPLITMIX_SHIFT_3)) ^ kx);
}
__device__ __forceinline__ kvc_u64 kvc_mix3_next(kvc_u64 d, kvc_u64 bx, kvc_u64 cx) {
    return kvc_sm_next(kvc_sm_next(kvc_sm_next(d, 0ull), bx), cx);
}

// A 64-bit multiply by a constant as three independent 32-bit products and one add of three
// (two dependent steps instead of three), written in PTX. kVariant 1 takes the cross products
// from wide multiplies, which ptxas cannot fold into a multiply-add chain.
template <int kVariant>
__device__ __forceinline__ kvc_u64 kvc_mul_split(kvc_u64 x, kvc_u64 m) {
    const unsigned ml = (unsigned)m, mh = (unsigned)(m >> 32);
    kvc_u64 r;
    if (kVariant == 0) {
        asm("{\n\t.reg .u32 xl, xh, a, b, wl, wh;\n\t"
            "mov.b64 {xl, xh}, %%1;\n\t"
            "mul.lo.u32 a, xh, %%2;\n\t"
            "mul.lo.u32 b, xl, %%3;\n\t"
            "mul.wide.u32 %%0, xl, %%2;\n\t"
            "mov.b64 {wl, wh}, %%0;\n\t"
            "add.u32 a, a, b;\n\t"
            "add.u32 wh, wh, a;\n\t"
            "mov.b64 %%0, {wl, wh};\n\t}"
            : "=l"(r) : "l"(x), "r"(ml), "r"(mh));
    } else {
        asm("{\n\t.reg .u32 xl, xh, wl, wh, al, ah, bl, bh;\n\t.reg .u64 a, b;\n\t"
            "mov.b64 {xl, xh}, %%1;\n\t"
            "mul.wide.u32 a, xh, %%2;\n\t"
            "mul.wide.u32 b, xl, %%3;\n\t"
            "mul.wide.u32 %%0, xl, %%2;\n\t"
            "mov.b64 {wl, wh}, %%0;\n\t"
            "mov.b64 {al, ah}, a;\n\t"
            "mov.b64 {bl, bh}, b;\n\t"
            "add.u32 al, al, bl;\n\t"
            "add.u32 wh, wh, al;\n\t"
            "mov.b64 %%0, {wl, wh};\n\t}"
            : "=l"(r) : "l"(x), "r"(ml), "r"(mh));
    }
    return r;
}
template <int kVariant>
__device__ __forceinline__ kvc_u64 kvc_sm_split(kvc_u64 x) {
    x = kvc_mul_split<kVariant>(x ^ (x >> KVC_SPLITMIX_SHIFT_1), (kvc_u64)KVC_SPLITMIX_MUL_1);
    x = kvc_mul_split<kVariant>(x ^ (x >> KVC_SPLITMIX_SHIFT_2), (kvc_u64)KVC_SPLITMIX_MUL_2);
    return x ^ (x >> KVC_SPLITMIX_SHIFT_3);
}

// kForm 0 plain, 1 pending, 2 and 3 split multiplies (variants 0 and 1); kKind 0 mix3, 1 fold
template <int kForm, int kKind>
__global__ void chain_probe(const kvc_u64* a, const kvc_u64* b, int rounds, kvc_u64* out,
                            long long* cycles) {
    __shared__ kvc_u64 s_a[KVC_PROBE_TOKENS];
    __shared__ kvc_u64 s_b[KVC_PROBE_TOKENS];
    for (int i = threadIdx.x; i < KVC_PROBE_TOKENS; i += blockDim.x) {
        // the pending form takes its inputs through kvc_xs1, done here off the chain
        s_a[i] = kForm == 1 ? kvc_xs1(a[i]) : a[i];
        s_b[i] = kForm == 1 ? kvc_xs1(b[i]) : b[i];
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    kvc_u64 x = kForm == 1 ? kvc_sm_unvalue(0x1234567890ABCDEFull) : 0x1234567890ABCDEFull;
    const long long t0 = clock64();
    for (int r = 0; r < rounds; ++r) {
#pragma unroll 8
        for (int i = 0; i < KVC_PROBE_TOKENS; ++i) {
            if (kForm >= 2) {
                constexpr int v = kForm - 2;
                x = kKind == 0 ? kvc_sm_split<v>(kvc_sm_split<v>(kvc_sm_split<v>(x) ^ s_a[i]) ^ s_b[i])
                               : kvc_sm_split<v>(x ^ s_a[i]);
            } else if (kKind == 0) {
                x = kForm == 1 ? kvc_mix3_next(x, s_a[i], s_b[i]) : kvc_mix3(x, s_a[i], s_b[i]);
            } else {
                x = kForm == 1 ? kvc_sm_next(x, s_a[i]) : kvc_sm(x ^ s_a[i]);
            }
        }
    }
    const long long t1 = clock64();
    out[0] = kForm == 1 ? kvc_sm_value(x) : x;
    cycles[0] = t1 - t0;
}
"""

FORMS = ((0, "plain"), (1, "pending"), (2, "split"), (3, "split-wide"))
NAMES = [f"chain_probe<{form}, {kind}>" for kind in (0, 1) for form, _ in FORMS]


def bare_chains() -> dict:
    module = cupy.RawModule(code=SOURCE % {"tokens": TOKENS}, options=_loader.nvrtc_options(),
                            name_expressions=NAMES)
    rng = np.random.default_rng(7)
    a = cupy.asarray(rng.integers(0, 2**63, TOKENS, dtype=np.int64).view(np.uint64))
    b = cupy.asarray(rng.integers(0, 2**63, TOKENS, dtype=np.int64).view(np.uint64))
    out = cupy.zeros(1, dtype=cupy.uint64)
    cycles = cupy.zeros(1, dtype=cupy.int64)
    steps = TOKENS * ROUNDS
    rows = {}
    for kind, kind_name in ((0, "mix3"), (1, "fold")):
        values = []
        for form, form_name in FORMS:
            fn = module.get_function(f"chain_probe<{form}, {kind}>")
            launch = lambda: fn((1,), (256,), (a, b, np.int32(ROUNDS), out, cycles))  # noqa: E731
            us = event_timed(launch)
            values.append(int(out.get()[0]))
            rows[f"{kind_name} {form_name}"] = {"ns_per_step": us * 1e3 / steps,
                                                 "cycles_per_step": int(cycles.get()[0]) / steps,
                                                 "regs": fn.num_regs}
        assert len(set(values)) == 1, f"{kind_name}: the forms differ: {values}"
    return rows


# clock64 stamps at points of the chunk loop (lane 0 of each warp), the cycles between successive
# points summed into device counters
CLOCK_POINTS = (
    ("start", "            const kvc_i64 i = base + lane;\n"),
    ("loads issued, checks", "            const unsigned mask = __ballot_sync(KVC_FULL_MASK, in_range);\n"),
    ("ballot, match, handoff wait", "            // Serial walk over the stored entries of the chunk, in lockstep on every lane.\n"),
    ("staging", "#pragma unroll 8\n                for (int j = 0; j < kChunk; ++j) {"),
    ("walk", "            unsigned m = mask == KVC_FULL_MASK ? 0u : mask;\n"),
    ("partial walk", "            const bool hand_over = kPaired && base + kChunk < hi;\n"),
    ("handoff, records, store", None),
)
_END = "            stored += (unsigned long long)__popc(mask);\n            __syncwarp();\n"


def clock_patch() -> tuple:
    n = len(CLOCK_POINTS)
    patch = [("#include \"write_request.cuh\"",
              f"#include \"write_request.cuh\"\n__device__ unsigned long long kvc_probe_cycles[{n}];")]
    for k, (_, line) in enumerate(CLOCK_POINTS):
        stamp = f"probe_t[{k}] = clock64();\n"
        if k == 0:
            stamp = f"long long probe_t[{n}];\n" + stamp
        if line is None:
            sums = "".join(f"atomicAdd(&kvc_probe_cycles[{j}], (unsigned long long)(probe_t[{j + 1}] - probe_t[{j}]));"
                           for j in range(n - 1))
            patch.append((_END, _END + stamp + f"if (lane == 0) {{ {sums} }}\n"))
        else:
            patch.append((line, stamp + line))
    return tuple(patch)


WRITE_CASES = ("e2e_prefill_chunk_first", "e2e_prefill_chunk_hash", "prefill_hash_256b", "small_extend_batch",
               "e2e_decode_steady", "e2e_decode_steady_hash")

_PREFILL = ("e2e_prefill_chunk_first",)
DECODE_CASES = ("smoke_decode_empty", "e2e_decode_tail", "e2e_decode_steady", "e2e_decode_steady_hash",
                "decode_large_batch_short_prefix")
_DECODE_HASH = ("e2e_decode_steady_hash", "e2e_decode_steady")

# The inline real-KV hash of a short request spread over lanes: lane t folds source t % nsrc of the
# chunk's entry t / nsrc (one memory latency for all sources instead of one each), then each entry's
# lane combines its sources in order. A candidate for decode writes with several sources.
# write.cu's decode-shaped hash (kvc_real_kv_hash_across_lanes) against one lane folding its entry's
# sources one after another, as before it
_ENTRY_LANE_SOURCES = (("if (src.count > 0 && inline_hash && (kvc_i64)entries * src.count <= 32) {",
                        "if (false) {"),)

# write.cu variants: (label, cases, ((old, new), ...)). Parts of the chunk loop left out show what the
# chain's serial path carries besides the chain (e2e_prefill_chunk_first: distinct slots, no sources,
# no expected tokens); candidates are changes with the same results and another schedule.
WRITE_PATCHES = (
    ("no chain (xor instead of mix3)", _PREFILL, (("                    running = kvc_mix3(running, t, p);",
                                                   "                    running ^= t ^ p;"),)),
    ("no duplicate-slot match", _PREFILL, (("const unsigned peers = __match_any_sync(KVC_FULL_MASK, key);",
                                            "const unsigned peers = 1u << lane;"),)),
    ("no stores", _PREFILL, (("            if (!hand_over && in_range && last_of_slot) {", "            if (false) {"),
                             ("                if (in_range && last_of_slot) {\n                    kvc_store_slot",
                              "                if (false) {\n                    kvc_store_slot"))),
    ("sources hashed by the entry's lane alone", _DECODE_HASH, _ENTRY_LANE_SOURCES),
)


def write_ops(names=WRITE_CASES, cold: bool = False) -> dict:
    """Device time of the write op on each case (graph replays, no host time) in us, and per chained
    token; ``cold``: one write a replay with L2 evicted before it, as the benchmarks time it."""
    rows = {}
    for name in names:
        case = S.BY_NAME[name]
        state = S.build_state(case, "cuda")
        us = timed_cold(lambda: state.write(0), reps=40) if cold else timed(lambda: state.write(0), reps=10, per_graph=5)
        # requests chain in parallel: the serial length is one request's new tokens
        rows[name] = {"us": us, "ns_per_chained_token": us * 1e3 / case.extend}
        assert state.violations() == 0
    return rows


def clock_breakdown(name: str = "e2e_prefill_chunk_first") -> None:
    """Cycles per token between the points of CLOCK_POINTS, one write of ``name``."""
    module = use_sources("write", _loader.RAWKERNEL_DIR, clock_patch())
    case = S.BY_NAME[name]
    state = S.build_state(case, "cuda")
    counters = module.get_global("kvc_probe_cycles")
    n = len(CLOCK_POINTS)
    for _ in range(2):
        counters.memset(0, 8 * n)
        state.write(0)
        state.sync()
        cycles = cupy.ndarray((n,), cupy.uint64, counters).get()
        parts = " ".join(f"[{label}] {cycles[k - 1] / case.n_write:.1f}" for k, (label, _) in enumerate(CLOCK_POINTS) if k)
        print(f"clock {name}, cycles per token up to: {parts}")


def main() -> None:
    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
          f"SM clock {cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0) / 1e3:.0f} MHz")
    for label, row in bare_chains().items():
        print(f"bare {label:14s} {row['ns_per_step']:7.1f} ns/step {row['cycles_per_step']:7.1f} cycles/step regs {row['regs']}")

    def show(label: str, rows: dict) -> None:
        for name, row in rows.items():
            print(f"write[{label}] {name:26s} {row['us']:9.2f} us {row['ns_per_chained_token']:9.1f} ns/chained token")

    show("this tree", write_ops())
    # one warp a request against two (write.cu's kPaired), whatever the host would pick
    from kvcanary_cupy.ops.backends._cuda import write as cuda_write
    auto = cuda_write.paired
    for label, team in (("one warp a request", False), ("two warps a request", True)):
        cuda_write.paired = lambda *_, team=team: team
        show(label, write_ops(("e2e_prefill_chunk_first", "e2e_prefill_chunk_hash", "small_extend_batch")))
    cuda_write.paired = auto
    clock_breakdown()
    show("this tree", write_ops(_DECODE_HASH))
    for label, cases, patch in WRITE_PATCHES:
        use_sources("write", _loader.RAWKERNEL_DIR, patch)
        show(label, write_ops(cases))
    # the same with write.cu and its headers from other directories (e.g. an earlier commit's),
    # each measured ROUNDS_AB times in turn with this tree's, so the spread is seen too: prefill
    # hot, decode-shaped writes cold (a chain of memory round trips, which a warm L2 hides)
    prefill = ("e2e_prefill_chunk_first", "e2e_prefill_chunk_hash")
    for _ in range(int(os.environ.get("ROUNDS_AB", "1"))):
        for directory in sys.argv[1:] + [None]:
            where = pathlib.Path(directory).resolve() if directory else _loader.RAWKERNEL_DIR
            label = directory or "this tree"
            use_sources("write", where)
            show(label, write_ops(prefill))
            show(label + ", cold L2", write_ops(DECODE_CASES, cold=True))


if __name__ == "__main__":
    main()

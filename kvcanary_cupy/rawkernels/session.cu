// session: the bookkeeping kc.Canary does on the device between its ops, each a single launch of
// a kernel compiled with the others (an array expression would be several launches, and a first
// compile of CuPy's own kernels inside the first forwards).
#include "canary_common.cuh"

// The tally of the verify launches whose plan disabled them (enable == 0 skips the step, SPEC
// 3.2), read at the next poll. One thread.
extern "C" __global__ void kvc_count_disabled(const int* __restrict__ enable, kvc_i64* disabled) {
    if (*enable == 0) *disabled += 1;
}

// How many times a static forward's launches ran (a replayed CUDA graph leaves no host trace), read
// and cleared at the next poll. One thread.
extern "C" __global__ void kvc_count_run(kvc_i64* runs) { *runs += 1; }

// A sliding-window group's write slots: out[i] = lut[loc[i]] where 0 <= loc[i] < lut_len, else -1
// (a slot the write skips). Grid-stride.
extern "C" __global__ void kvc_translate_slots(const kvc_i64* __restrict__ loc, kvc_i64 n,
                                               const kvc_i64* __restrict__ lut, kvc_i64 lut_len,
                                               kvc_i64* __restrict__ out) {
    const kvc_i64 step = (kvc_i64)gridDim.x * blockDim.x;
    for (kvc_i64 i = (kvc_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const kvc_i64 slot = loc[i];
        out[i] = (slot >= 0 && slot < lut_len) ? lut[slot] : -1;
    }
}

// Shared device code of the kv-canary kernels: the hash, slot and ring access, and the real-KV
// fingerprint over a device source table.
//
// Every wire-format constant reaches this file as an NVRTC -D option built from
// kvcanary_cupy/_layout.py (nvrtc_defines); nothing here restates a value of that module.
#pragma once

#ifndef KVC_SPLITMIX_MUL_1
#error "kv-canary: KVC_SPLITMIX_MUL_1 is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_SPLITMIX_MUL_2
#error "kv-canary: KVC_SPLITMIX_MUL_2 is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_SPLITMIX_SHIFT_1
#error "kv-canary: KVC_SPLITMIX_SHIFT_1 is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_SPLITMIX_SHIFT_2
#error "kv-canary: KVC_SPLITMIX_SHIFT_2 is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_SPLITMIX_SHIFT_3
#error "kv-canary: KVC_SPLITMIX_SHIFT_3 is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_CHAIN_ANCHOR
#error "kv-canary: KVC_CHAIN_ANCHOR is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_FIELD_TOKEN
#error "kv-canary: KVC_FIELD_TOKEN is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_FIELD_POSITION
#error "kv-canary: KVC_FIELD_POSITION is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_FIELD_PREV_HASH
#error "kv-canary: KVC_FIELD_PREV_HASH is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_FIELD_REAL_KV_HASH
#error "kv-canary: KVC_FIELD_REAL_KV_HASH is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_PADDING_SLOT
#error "kv-canary: KVC_PADDING_SLOT is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_RING_COLUMNS
#error "kv-canary: KVC_RING_COLUMNS is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_RING_COL_FAIL_BITS
#error "kv-canary: KVC_RING_COL_FAIL_BITS is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_PARTIAL_READ_BYTES
#error "kv-canary: KVC_PARTIAL_READ_BYTES is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_SRC_BASE_ADDRESS
#error "kv-canary: KVC_SRC_BASE_ADDRESS is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_SRC_ROW_STRIDE_BYTES
#error "kv-canary: KVC_SRC_ROW_STRIDE_BYTES is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_SRC_NUM_ROWS
#error "kv-canary: KVC_SRC_NUM_ROWS is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_SRC_PAGE_SIZE
#error "kv-canary: KVC_SRC_PAGE_SIZE is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_SRC_BYTES_PER_TOKEN
#error "kv-canary: KVC_SRC_BYTES_PER_TOKEN is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_SRC_READ_BYTES
#error "kv-canary: KVC_SRC_READ_BYTES is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_SOURCE_DESCRIPTOR_WORDS
#error "kv-canary: KVC_SOURCE_DESCRIPTOR_WORDS is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_NO_EXPECTED_TOKEN
#error "kv-canary: KVC_NO_EXPECTED_TOKEN is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_UNRESOLVED_SLOT
#error "kv-canary: KVC_UNRESOLVED_SLOT is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_INT32_MAX
#error "kv-canary: KVC_INT32_MAX is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_I64_MAX
#error "kv-canary: KVC_I64_MAX is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_BIT_CHAIN_HASH
#error "kv-canary: KVC_BIT_CHAIN_HASH is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_BIT_POSITION
#error "kv-canary: KVC_BIT_POSITION is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_BIT_REAL_KV_HASH
#error "kv-canary: KVC_BIT_REAL_KV_HASH is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_BIT_WRITE_TOKEN
#error "kv-canary: KVC_BIT_WRITE_TOKEN is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_BIT_WRITE_POSITION
#error "kv-canary: KVC_BIT_WRITE_POSITION is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_BIT_VERIFY_TOKEN
#error "kv-canary: KVC_BIT_VERIFY_TOKEN is not defined (pass _layout.nvrtc_defines())"
#endif
#ifndef KVC_BIT_OUT_OF_RANGE
#error "kv-canary: KVC_BIT_OUT_OF_RANGE is not defined (pass _layout.nvrtc_defines())"
#endif

// A ring row is written positionally: kind, slot, position, stored token, expected token,
// stored chain hash, expected aux, fail bits (SPEC section 2); a row must hold all eight.
#if KVC_RING_COLUMNS < 8
#error "kv-canary: KVC_RING_COLUMNS must be at least 8"
#endif
// The slot is read as whole 32-byte records; the four fields must be the first four words.
#if KVC_FIELD_TOKEN > 3 || KVC_FIELD_POSITION > 3 || KVC_FIELD_PREV_HASH > 3 || \
    KVC_FIELD_REAL_KV_HASH > 3
#error "kv-canary: slot fields must be the first four words of a slot"
#endif

typedef long long kvc_i64;
typedef unsigned long long kvc_u64;

#define KVC_FULL_MASK 0xFFFFFFFFu

// ------------------------------------------------------------------------------------------------
// hash

// x * m mod 2^64. The high word is mulhi(x.lo, m.lo) + x.hi * m.lo + x.lo * m.hi: written as
// three independent 32-bit products and one three-way add, it is two dependent steps where the
// compiler's multiply-add chain is three. The cross products come from wide multiplies so that
// ptxas keeps them apart (sm's serial chains measured 11-14 % faster on the H200;
// tools/chain_probe.py).
__device__ __forceinline__ kvc_u64 kvc_mul64(kvc_u64 x, kvc_u64 m) {
    kvc_u64 r;
    asm("{\n\t"
        ".reg .u32 xl, xh, wl, wh, al, ah, bl, bh;\n\t"
        ".reg .u64 a, b;\n\t"
        "mov.b64 {xl, xh}, %1;\n\t"
        "mul.wide.u32 a, xh, %2;\n\t"
        "mul.wide.u32 b, xl, %3;\n\t"
        "mul.wide.u32 %0, xl, %2;\n\t"
        "mov.b64 {wl, wh}, %0;\n\t"
        "mov.b64 {al, ah}, a;\n\t"
        "mov.b64 {bl, bh}, b;\n\t"
        "add.u32 al, al, bl;\n\t"
        "add.u32 wh, wh, al;\n\t"
        "mov.b64 %0, {wl, wh};\n\t"
        "}"
        : "=l"(r)
        : "l"(x), "r"((unsigned)m), "r"((unsigned)(m >> 32)));
    return r;
}

__device__ __forceinline__ kvc_u64 kvc_sm(kvc_u64 x) {
    x = kvc_mul64(x ^ (x >> KVC_SPLITMIX_SHIFT_1), (kvc_u64)KVC_SPLITMIX_MUL_1);
    x = kvc_mul64(x ^ (x >> KVC_SPLITMIX_SHIFT_2), (kvc_u64)KVC_SPLITMIX_MUL_2);
    return x ^ (x >> KVC_SPLITMIX_SHIFT_3);
}

__device__ __forceinline__ kvc_u64 kvc_mix3(kvc_u64 a, kvc_u64 b, kvc_u64 c) {
    return kvc_sm(kvc_sm(kvc_sm(a) ^ b) ^ c);
}

// sm in plain arithmetic, for values the compiler can fold (kvc_mul64's asm is opaque to it).
__host__ __device__ constexpr kvc_u64 kvc_xorshift_constant(kvc_u64 x, int shift) {
    return x ^ (x >> shift);
}
__host__ __device__ constexpr kvc_u64 kvc_sm_constant(kvc_u64 x) {
    return kvc_xorshift_constant(
        kvc_xorshift_constant(kvc_xorshift_constant(x, KVC_SPLITMIX_SHIFT_1) *
                                  (kvc_u64)KVC_SPLITMIX_MUL_1,
                              KVC_SPLITMIX_SHIFT_2) *
            (kvc_u64)KVC_SPLITMIX_MUL_2,
        KVC_SPLITMIX_SHIFT_3);
}

__device__ __forceinline__ kvc_u64 kvc_anchor_link() {
    constexpr kvc_u64 kLink = kvc_sm_constant((kvc_u64)KVC_CHAIN_ANCHOR);
    return kLink;
}

// ------------------------------------------------------------------------------------------------
// canary slots

// The four fields of one slot. kVec16: the buffer base and the slot stride are multiples of 16,
// so the 32-byte record is read as two 16-byte vectors.
struct KvcSlot {
    kvc_i64 w[4];
};

template <bool kVec16, bool kReadOnly>
__device__ __forceinline__ KvcSlot kvc_load_slot(const unsigned char* buf, kvc_i64 stride,
                                                 kvc_i64 slot) {
    KvcSlot s;
    const unsigned char* p = buf + slot * stride;
    if (kVec16) {
        const longlong2* q = reinterpret_cast<const longlong2*>(p);
        longlong2 a, b;
        if (kReadOnly) {
            a = __ldg(q);
            b = __ldg(q + 1);
        } else {
            a = q[0];
            b = q[1];
        }
        s.w[0] = a.x;
        s.w[1] = a.y;
        s.w[2] = b.x;
        s.w[3] = b.y;
    } else {
        const kvc_i64* q = reinterpret_cast<const kvc_i64*>(p);
#pragma unroll
        for (int f = 0; f < 4; ++f) s.w[f] = kReadOnly ? __ldg(q + f) : q[f];
    }
    return s;
}

__device__ __forceinline__ kvc_u64 kvc_slot_link(const KvcSlot& s) {
    return kvc_mix3((kvc_u64)s.w[KVC_FIELD_PREV_HASH], (kvc_u64)s.w[KVC_FIELD_TOKEN],
                    (kvc_u64)s.w[KVC_FIELD_POSITION]);
}

__device__ __forceinline__ kvc_i64* kvc_slot_words(unsigned char* buf, kvc_i64 stride,
                                                   kvc_i64 slot) {
    return reinterpret_cast<kvc_i64*>(buf + slot * stride);
}

// Stores a slot's fields; without store_hash the real-KV hash word is left to another thread.
template <bool kVec16>
__device__ __forceinline__ void kvc_store_slot(unsigned char* buf, kvc_i64 stride, kvc_i64 slot,
                                               kvc_i64 token, kvc_i64 position, kvc_u64 chain,
                                               kvc_u64 kv_hash, bool store_hash) {
    kvc_i64* w = kvc_slot_words(buf, stride, slot);
    if (kVec16 && store_hash) {
        kvc_i64 f[4];
        f[KVC_FIELD_TOKEN] = token;
        f[KVC_FIELD_POSITION] = position;
        f[KVC_FIELD_PREV_HASH] = (kvc_i64)chain;
        f[KVC_FIELD_REAL_KV_HASH] = (kvc_i64)kv_hash;
        longlong2* q = reinterpret_cast<longlong2*>(w);
        q[0] = make_longlong2(f[0], f[1]);
        q[1] = make_longlong2(f[2], f[3]);
    } else {
        w[KVC_FIELD_TOKEN] = token;
        w[KVC_FIELD_POSITION] = position;
        w[KVC_FIELD_PREV_HASH] = (kvc_i64)chain;
        if (store_hash) w[KVC_FIELD_REAL_KV_HASH] = (kvc_i64)kv_hash;
    }
}

// ------------------------------------------------------------------------------------------------
// violation ring

struct KvcRing {
    kvc_i64* rows;       // [capacity, KVC_RING_COLUMNS]
    kvc_i64 capacity;
    int* write_index;    // int32 [1]
};

// Takes the next index atomically; the row is kept only while the ring has room (fill-once).
__device__ __forceinline__ void kvc_record(const KvcRing& ring, kvc_i64 kind, kvc_i64 slot,
                                           kvc_i64 position, kvc_i64 stored_token,
                                           kvc_i64 expected_token, kvc_i64 stored_chain,
                                           kvc_i64 expected_aux, kvc_i64 bits) {
    const int i = atomicAdd(ring.write_index, 1);
    if (i < 0 || (kvc_i64)i >= ring.capacity) return;
    kvc_i64* row = ring.rows + (kvc_i64)i * KVC_RING_COLUMNS;
    row[KVC_RING_COL_KERNEL_KIND] = kind;
    row[KVC_RING_COL_SLOT] = slot;
    row[KVC_RING_COL_POSITION] = position;
    row[KVC_RING_COL_STORED_TOKEN] = stored_token;
    row[KVC_RING_COL_EXPECTED_TOKEN] = expected_token;
    row[KVC_RING_COL_STORED_CHAIN_HASH] = stored_chain;
    row[KVC_RING_COL_EXPECTED_AUX] = expected_aux;
    row[KVC_RING_COL_FAIL_BITS] = bits;
}

// kvc_record out of line, for a kernel that records from many places on its short path: its code
// (fetched cold after a model forward) then has one call at each place instead of a row's stores.
// The decode write with real-KV sources measured 0.4 us faster with it (6.98 -> 6.56 us, bs256).
__device__ __noinline__ void kvc_record_cold(const KvcRing ring, kvc_i64 kind, kvc_i64 slot,
                                             kvc_i64 position, kvc_i64 stored_token,
                                             kvc_i64 expected_token, kvc_i64 stored_chain,
                                             kvc_i64 expected_aux, kvc_i64 bits) {
    kvc_record(ring, kind, slot, position, stored_token, expected_token, stored_chain, expected_aux,
               bits);
}

// ------------------------------------------------------------------------------------------------
// real-KV sources
//
// The table is int64 [nsrc, KVC_SOURCE_DESCRIPTOR_WORDS]: base address, row stride in bytes,
// number of rows, page size, bytes per token, bytes to read (already the mode's: the partial
// length or read_bytes). The host checked that the base and the stride are multiples of 16, that
// bytes per token and read bytes are positive multiples of 16 with read <= bytes per token, and
// that page_size * bytes_per_token fits in a row. nsrc == 0 means no hashing (mode NONE).

struct KvcSources {
    const kvc_i64* table;
    int count;
};

__device__ __forceinline__ kvc_i64 kvc_src_word(const KvcSources& src, int k, int word) {
    return __ldg(src.table + (kvc_i64)k * KVC_SOURCE_DESCRIPTOR_WORDS + word);
}

// slot / page and slot % page for slot >= 0, page >= 1, with a 32-bit path when both fit.
__device__ __forceinline__ void kvc_divmod(kvc_i64 slot, kvc_i64 page, kvc_i64& q, kvc_i64& r) {
    if (((kvc_u64)slot | (kvc_u64)page) <= 0xFFFFFFFFull) {
        const unsigned s32 = (unsigned)slot, p32 = (unsigned)page;
        const unsigned q32 = s32 / p32;
        q = q32;
        r = s32 - q32 * p32;
    } else {
        q = (kvc_i64)((kvc_u64)slot / (kvc_u64)page);
        r = slot - q * page;
    }
}

// Loads issued where they are written: the compiler may not sink them towards their first use,
// so a load placed before a long computation overlaps it. They take the non-coherent path
// (ld.global.nc), so they are only for data that no thread writes during the launch.
__device__ __forceinline__ kvc_i64 kvc_ld_early(const kvc_i64* p) {
    kvc_i64 v;
    asm volatile("ld.global.nc.b64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

// v unchanged, through a volatile asm that the compiler keeps after the volatile asm before it (the
// loads requested with kvc_ld_early and kvc_ld16_early): what is computed from v then stays after
// those requests instead of being hoisted above them, where it would wait for v's load first.
__device__ __forceinline__ kvc_i64 kvc_after_requests(kvc_i64 v) {
    asm volatile("mov.b64 %0, %0;" : "+l"(v));
    return v;
}

// kvc_ld_early if `when`, else `otherwise`, as one predicated load: no branch, so ptxas keeps it with
// the loads issued beside it. Behind a branch it issued the decode write's entry inputs only after
// what it hoisted above that branch had waited for the request count (nvdisasm of kvc_write_decode).
// For 64-bit words and for 32-bit cells (req_to_token, the expected-token pool).
#define KVC_LD_EARLY_IF(T, BITS, REG)                                                              \
    __device__ __forceinline__ T kvc_ld_early_if(const T* p, bool when, T otherwise) {             \
        T v = otherwise;                                                                           \
        asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %2, 0;\n\t@q ld.global.nc.b" BITS       \
                     " %0, [%1];\n\t}"                                                             \
                     : "+" REG(v)                                                                  \
                     : "l"(p), "r"((unsigned)when));                                               \
        return v;                                                                                  \
    }
KVC_LD_EARLY_IF(kvc_i64, "64", "l")
KVC_LD_EARLY_IF(int, "32", "r")
#undef KVC_LD_EARLY_IF

// Sum over the 32 lanes of a warp, on every lane, every lane taking part.
__device__ __forceinline__ unsigned long long kvc_warp_sum(unsigned long long v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(KVC_FULL_MASK, v, off);
    return v;
}

// A block's completion, published by one thread after a barrier: the add is a release at GPU
// scope, so what the block read and wrote before it is ordered before the add for whoever acquires
// the count (lighter than a full fence and a relaxed add).
__device__ __forceinline__ void kvc_release_add(unsigned int* counter, unsigned int value) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(counter), "r"(value) : "memory");
}

// The same with the previous count returned and acquire semantics too: the block that finds itself
// last sees what every other block published.
__device__ __forceinline__ unsigned int kvc_acq_rel_add(unsigned int* counter, unsigned int value) {
    unsigned int previous;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
                 : "=r"(previous)
                 : "l"(counter), "r"(value)
                 : "memory");
    return previous;
}

// Waits until a counter other blocks add to with release semantics reaches `target`, reading it with
// acquire semantics: what they wrote before adding is then visible to the caller. The wait ends
// after `limit_ns` of global time whatever the count: a count lost to a stray write (the canary's
// memory is what it guards against) then costs that long instead of hanging the stream.
__device__ __forceinline__ void kvc_wait_for_count(const unsigned int* counter, unsigned int target,
                                                   unsigned long long limit_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
        unsigned int count;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(count) : "l"(counter) : "memory");
        if (count >= target) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start >= limit_ns) return;
    }
}

__device__ __forceinline__ longlong2 kvc_ld16_early(const longlong2* p) {
    longlong2 v;
    asm volatile("ld.global.nc.v2.b64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p));
    return v;
}

// 16-byte vectors per batch of a long fold (the next batch is in flight meanwhile). Each batch in
// flight holds 4 registers a vector: a kernel with many threads in flight (verify) folds without
// batches (kvc_fold_from<1>), which keeps its register count and so its occupancy. The write's
// hashing keeps the batches: unbatched, a 2 x 256 B ALL-mode prefill write measured 445 against
// 396 us on an H200, and the decode writes were no faster for their 20 % smaller code.
#define KVC_FOLD_BATCH 8

__device__ __forceinline__ kvc_u64 kvc_fold16(kvc_u64 acc, const longlong2& v) {
    acc = kvc_sm(acc ^ (kvc_u64)v.x);
    return kvc_sm(acc ^ (kvc_u64)v.y);
}

// fold(bytes): acc = sm(acc ^ w) over 8-byte little-endian words; the bytes are 16-byte aligned
// and a multiple of 16 long. Software-pipelined: batch k+1 loads while batch k folds.
// kvc_fold_from continues a fold already at acc.
template <int kBatch = KVC_FOLD_BATCH>
__device__ __forceinline__ kvc_u64 kvc_fold_from(kvc_u64 acc, const unsigned char* p,
                                                 kvc_i64 nbytes) {
    const longlong2* q = reinterpret_cast<const longlong2*>(p);
    const kvc_i64 n16 = nbytes >> 4;
    kvc_i64 k = 0;
    if (kBatch > 1 && n16 >= kBatch) {
        longlong2 cur[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) cur[u] = kvc_ld16_early(q + u);
        for (k = kBatch; k + kBatch <= n16; k += kBatch) {
            longlong2 nxt[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) nxt[u] = kvc_ld16_early(q + k + u);
#pragma unroll
            for (int u = 0; u < kBatch; ++u) acc = kvc_fold16(acc, cur[u]);
#pragma unroll
            for (int u = 0; u < kBatch; ++u) cur[u] = nxt[u];
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) acc = kvc_fold16(acc, cur[u]);
    }
    for (; k < n16; ++k) acc = kvc_fold16(acc, __ldg(q + k));
    return acc;
}

template <int kBatch = KVC_FOLD_BATCH>
__device__ __forceinline__ kvc_u64 kvc_fold(const unsigned char* p, kvc_i64 nbytes) {
    return kvc_fold_from<kBatch>(0ull, p, nbytes);
}

// Whether slot (>= 0) maps past a source's rows, for a page already known to be >= 1: row = slot /
// page >= rows  <=>  slot >= rows * page (rows * page is bounded by the source's size in bytes, so
// it cannot overflow).
__device__ __forceinline__ bool kvc_source_row_past_end(kvc_i64 rows, kvc_i64 page, kvc_i64 slot) {
    return rows < 0 || slot >= rows * page;
}

// kvc_source_row_past_end for any page: a bad one reads as out of range.
__device__ __forceinline__ bool kvc_source_row_out_of_range(kvc_i64 rows, kvc_i64 page,
                                                            kvc_i64 slot) {
    return page < 1 || kvc_source_row_past_end(rows, page, slot);
}

// True when slot (>= 0) maps to a row past some source's rows; no data is read.
__device__ __forceinline__ bool kvc_sources_out_of_range(const KvcSources& src, kvc_i64 slot) {
    bool oor = false;
    for (int k = 0; k < src.count; ++k) {
        if (kvc_source_row_out_of_range(kvc_src_word(src, k, KVC_SRC_NUM_ROWS),
                                        kvc_src_word(src, k, KVC_SRC_PAGE_SIZE), slot))
            oor = true;
    }
    return oor;
}

// One source's descriptor words, as the hashing uses them.
struct KvcSourceDesc {
    kvc_i64 base, stride, rows, page, bytes_per_token, read_bytes;
};

__device__ __forceinline__ KvcSourceDesc kvc_source_desc(const KvcSources& src, int k) {
    return {kvc_src_word(src, k, KVC_SRC_BASE_ADDRESS),
            kvc_src_word(src, k, KVC_SRC_ROW_STRIDE_BYTES),
            kvc_src_word(src, k, KVC_SRC_NUM_ROWS),
            kvc_src_word(src, k, KVC_SRC_PAGE_SIZE),
            kvc_src_word(src, k, KVC_SRC_BYTES_PER_TOKEN),
            kvc_src_word(src, k, KVC_SRC_READ_BYTES)};
}

// Source k's descriptor, requested where this is written (kvc_ld_early): for a lane that knows
// which source it folds before it knows the slot, so the descriptor's read is not on the chain.
__device__ __forceinline__ KvcSourceDesc kvc_source_desc_early(const KvcSources& src, int k) {
    const kvc_i64* d = src.table + (kvc_i64)k * KVC_SOURCE_DESCRIPTOR_WORDS;
    return {kvc_ld_early(d + KVC_SRC_BASE_ADDRESS), kvc_ld_early(d + KVC_SRC_ROW_STRIDE_BYTES),
            kvc_ld_early(d + KVC_SRC_NUM_ROWS), kvc_ld_early(d + KVC_SRC_PAGE_SIZE),
            kvc_ld_early(d + KVC_SRC_BYTES_PER_TOKEN), kvc_ld_early(d + KVC_SRC_READ_BYTES)};
}

// kvc_source_row_bytes for a page that is not a power of two (or not valid: then out of range).
__device__ __forceinline__ const unsigned char* kvc_source_row_bytes_divided(
    const KvcSourceDesc& d, kvc_i64 slot) {
    if (kvc_source_row_out_of_range(d.rows, d.page, slot)) return nullptr;
    kvc_i64 row, col;
    kvc_divmod(slot, d.page, row, col);
    return reinterpret_cast<const unsigned char*>(d.base) + row * d.stride +
           col * d.bytes_per_token;
}

// Where a source keeps the bytes of slot (>= 0), or nullptr when its row is out of range. A
// power-of-two page (every page of 1, and the engines' usual 16, 32 or 64) takes its row and
// column by a shift and a mask: a decode write addresses its sources as soon as the slot arrives,
// and the division was most of that path. The shift and the test depend on the descriptor alone,
// which is read before the slot.
__device__ __forceinline__ const unsigned char* kvc_source_row_bytes(const KvcSourceDesc& d,
                                                                     kvc_i64 slot) {
    const bool power_of_two = d.page >= 1 && (d.page & (d.page - 1)) == 0;
    if (!power_of_two) return kvc_source_row_bytes_divided(d, slot);
    if (kvc_source_row_past_end(d.rows, d.page, slot)) return nullptr;
    const int shift = __ffsll(d.page) - 1;
    return reinterpret_cast<const unsigned char*>(d.base) + (slot >> shift) * d.stride +
           (slot & (d.page - 1)) * d.bytes_per_token;
}

// Where source k keeps the bytes of slot (>= 0), or nullptr when its row is out of range.
__device__ __forceinline__ const unsigned char* kvc_source_bytes(const KvcSources& src, int k,
                                                                 kvc_i64 slot, kvc_i64* nread) {
    const KvcSourceDesc d = kvc_source_desc(src, k);
    *nread = d.read_bytes;
    return kvc_source_row_bytes(d, slot);
}

// Source k's fold of slot (>= 0) into f; false, with f 0, when the slot maps past its rows.
template <int kBatch>
__device__ __forceinline__ bool kvc_fold_source(const KvcSources& src, int k, kvc_i64 slot,
                                                kvc_u64& f) {
    kvc_i64 nread;
    const unsigned char* p = kvc_source_bytes(src, k, slot, &nread);
    f = 0;
    if (p == nullptr) return false;
    f = kvc_fold<kBatch>(p, nread);
    return true;
}

// The first 32 bytes of a source's read (read bytes are a positive multiple of 16; the second half
// only when it is read), requested where this is written, and the fold of the whole read from them.
struct KvcSourceHead {
    longlong2 first, second;
};

__device__ __forceinline__ KvcSourceHead kvc_request_head(const unsigned char* p, kvc_i64 nbytes) {
    const longlong2* q = reinterpret_cast<const longlong2*>(p);
    KvcSourceHead h = {kvc_ld16_early(q), make_longlong2(0, 0)};
    if (nbytes >= 32) h.second = kvc_ld16_early(q + 1);
    return h;
}

// The fold past a source's first 32 bytes, out of line, for a caller whose sources are usually read
// in their first 32 bytes: inline, its batches were most of a decode write's code.
__device__ __noinline__ kvc_u64 kvc_fold_tail(kvc_u64 acc, const unsigned char* p, kvc_i64 nbytes) {
    return kvc_fold_from(acc, p, nbytes);
}

template <bool kTailOutOfLine = false>
__device__ __forceinline__ kvc_u64 kvc_fold_with_head(const unsigned char* p, kvc_i64 nbytes,
                                                      const KvcSourceHead& h) {
    kvc_u64 f = kvc_fold16(0ull, h.first);
    if (nbytes >= 32) f = kvc_fold16(f, h.second);
    if (nbytes > 32) {
        f = kTailOutOfLine ? kvc_fold_tail(f, p + 32, nbytes - 32)
                           : kvc_fold_from(f, p + 32, nbytes - 32);
    }
    return f;
}

#define KVC_PREFETCH_SOURCES 4  // sources whose first 32 bytes are all requested before folding

// real_kv_hash(slot) for slot >= 0; sets *oor when a source row is out of range (its fold is 0).
template <int kBatch = KVC_FOLD_BATCH>
__device__ __forceinline__ kvc_u64 kvc_real_kv_hash(const KvcSources& src, kvc_i64 slot,
                                                    bool* oor) {
    kvc_u64 acc = 0;
    bool out = false;
    for (int k = 0; k < src.count; ++k) {
        kvc_u64 f;
        if (!kvc_fold_source<kBatch>(src, k, slot, f)) out = true;
        acc = kvc_sm(acc ^ f);
    }
    *oor = out;
    return acc;
}

// real_kv_hash of the slots of up to 32 entries, one entry a lane, with the (entry, source)
// folds spread over the warp: lane t folds source t % nsrc of entry t / nsrc, then each entry's
// lane combines its sources' folds in order. A short request's sources are then read at once by
// several lanes instead of one after another by one. Needs entries * src.count <= 32 and the whole
// warp converged; lanes with !in_range get 0 and no out-of-range flag.
__device__ __forceinline__ kvc_u64 kvc_real_kv_hash_across_lanes(const KvcSources& src,
                                                                 kvc_i64 slot, bool in_range,
                                                                 int entries, bool* oor) {
    const int lane = (int)(threadIdx.x & 31);
    const int nsrc = src.count;
    const int entry = lane / nsrc;
    const int k = lane - entry * nsrc;
    const kvc_i64 entry_slot = __shfl_sync(KVC_FULL_MASK, slot, entry);
    const bool fold = __shfl_sync(KVC_FULL_MASK, (int)in_range, entry) != 0 && entry < entries;
    kvc_u64 f = 0;
    int source_oor = 0;
    if (fold && !kvc_fold_source<1>(src, k, entry_slot, f)) source_oor = 1;
    kvc_u64 acc = 0;
    int any_oor = 0;
    for (int kk = 0; kk < nsrc; ++kk) {
        // past entries * nsrc only for lanes that are not in range
        const int from = (lane * nsrc + kk) & 31;
        acc = kvc_sm(acc ^ __shfl_sync(KVC_FULL_MASK, f, from));
        any_oor |= __shfl_sync(KVC_FULL_MASK, source_oor, from);
    }
    *oor = in_range && any_oor != 0;
    return in_range ? acc : 0ull;
}

// real_kv_hash(slot) as kvc_real_kv_hash, for a thread that has little else in flight (a decode
// write): the first 32 bytes of up to KVC_PREFETCH_SOURCES sources are requested at once, so the
// sources cost one memory latency instead of one each.
__device__ __forceinline__ kvc_u64 kvc_real_kv_hash_prefetched(const KvcSources& src,
                                                               kvc_i64 slot, bool* oor) {
    if (src.count > KVC_PREFETCH_SOURCES) return kvc_real_kv_hash(src, slot, oor);
    const unsigned char* p[KVC_PREFETCH_SOURCES];
    kvc_i64 nread[KVC_PREFETCH_SOURCES];
    KvcSourceHead head[KVC_PREFETCH_SOURCES];
    bool out = false;
#pragma unroll
    for (int k = 0; k < KVC_PREFETCH_SOURCES; ++k) {
        p[k] = nullptr;
        nread[k] = 0;
        head[k] = {make_longlong2(0, 0), make_longlong2(0, 0)};
        if (k < src.count) {
            const KvcSourceDesc d = kvc_source_desc(src, k);
            nread[k] = d.read_bytes;
            p[k] = kvc_source_row_bytes(d, slot);
            if (p[k] == nullptr) {
                out = true;
            } else {
                head[k] = kvc_request_head(p[k], nread[k]);
            }
        }
    }
    kvc_u64 acc = 0;
#pragma unroll
    for (int k = 0; k < KVC_PREFETCH_SOURCES; ++k) {
        if (k < src.count) {
            const kvc_u64 f = p[k] != nullptr ? kvc_fold_with_head(p[k], nread[k], head[k]) : 0ull;
            acc = kvc_sm(acc ^ f);
        }
    }
    *oor = out;
    return acc;
}

// real_kv_hash(slot) computed by the kLanes lanes of an aligned group that all hold the same slot
// (a decode write's request), in two calls so that the caller can work while the sources are read:
// kvc_request_in_group asks for the bytes of the lane's own source (member m folds source m; the
// descriptor was read by the caller before the slot arrived, kvc_source_desc_early), and
// kvc_hash_in_group folds them, combines the group's folds in source order from shuffles, and
// folds any sources past the first kLanes a round at a time. Up to kLanes sources then cost one
// memory latency, read by as many lanes, where one thread (kvc_real_kv_hash_prefetched) issues
// every source's loads and folds them all itself. The group's lanes reach both together (their
// data is the same).
struct KvcGroupSource {
    const unsigned char* bytes;  // nullptr: no source for this lane, or its row is out of range
    kvc_i64 read_bytes;
    KvcSourceHead head;
    bool out_of_range;
};

template <int kLanes>
__device__ __forceinline__ unsigned kvc_group_mask() {
    static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0,
                  "a group is a power-of-two share of a warp");
    const int lane = (int)(threadIdx.x & 31);
    const int member = lane & (kLanes - 1);
    return (kLanes == 32 ? KVC_FULL_MASK : (1u << kLanes) - 1u) << (lane - member);
}

template <int kLanes>
__device__ __forceinline__ KvcGroupSource kvc_request_in_group(const KvcSources& src,
                                                               const KvcSourceDesc& own,
                                                               kvc_i64 slot) {
    const int member = (int)(threadIdx.x & (kLanes - 1));
    KvcGroupSource g = {};  // no source, nothing requested
    if (member < src.count) {
        g.bytes = kvc_source_row_bytes(own, slot);
        g.read_bytes = own.read_bytes;
        if (g.bytes == nullptr) g.out_of_range = true;
        else g.head = kvc_request_head(g.bytes, own.read_bytes);
    }
    return g;
}

// Every member's fold is shuffled at once and then combined in order (src.count is the same on every
// lane), and one ballot says whether any source was out of range: the loop this replaces waited on
// a shuffle of the fold and one of a flag before each step of the combine.
// kShortReads: the host found at most kLanes sources, none reading more than 32 bytes (its head),
// so the fold of a longer read and the rounds past the first kLanes sources are compiled out:
// half the instance's code and 104 registers instead of 136 (sm_90). On an H200 the 4-source
// ALL-mode decode write took 0.03-0.19 us less (three interleaved A/Bs: 6.21-6.30 -> 6.05-6.27 us).
template <int kLanes, bool kShortReads = false>
__device__ __forceinline__ kvc_u64 kvc_hash_in_group(const KvcSources& src,
                                                     const KvcGroupSource& g, kvc_i64 slot,
                                                     bool* oor) {
    const unsigned group = kvc_group_mask<kLanes>();
    const int member = (int)(threadIdx.x & (kLanes - 1));
    kvc_u64 f = 0;
    if (g.bytes != nullptr) {
        if (kShortReads) {
            f = kvc_fold16(0ull, g.head.first);
            if (g.read_bytes >= 32) f = kvc_fold16(f, g.head.second);
        } else {
            f = kvc_fold_with_head<true>(g.bytes, g.read_bytes, g.head);
        }
    }
    kvc_u64 folds[kLanes];
#pragma unroll
    for (int j = 0; j < kLanes; ++j) folds[j] = __shfl_sync(group, f, j, kLanes);
    kvc_u64 acc = 0;
#pragma unroll
    for (int j = 0; j < kLanes; ++j) {
        if (j >= src.count) break;
        acc = kvc_sm(acc ^ folds[j]);
    }
    bool any_oor = __ballot_sync(group, g.out_of_range) != 0;
    for (int k0 = kLanes; !kShortReads && k0 < src.count; k0 += kLanes) {
        const int k = k0 + member;
        kvc_u64 fk = 0;
        bool source_oor = false;
        if (k < src.count) {
            const KvcSourceDesc d = kvc_source_desc(src, k);
            const unsigned char* p = kvc_source_row_bytes(d, slot);
            if (p == nullptr) source_oor = true;
            else fk = kvc_fold_with_head<true>(p, d.read_bytes, kvc_request_head(p, d.read_bytes));
        }
        const int folded = src.count - k0 < kLanes ? src.count - k0 : kLanes;
        for (int j = 0; j < folded; ++j) acc = kvc_sm(acc ^ __shfl_sync(group, fk, j, kLanes));
        any_oor |= __ballot_sync(group, source_oor) != 0;
    }
    *oor = any_oor;
    return acc;
}

// Asks L2 for the line of a word that the kernel updates atomically near its end: an atomic on a
// line that is not in L2 (the forward before the canary step evicted it) waits for DRAM at the
// point where the launch has nothing else left to do.
__device__ __forceinline__ void kvc_prefetch_word(const void* p) {
    if (p != nullptr) asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Asks L2 for the 128-byte lines of [p, p + nbytes) without waiting, the block's threads taking a
// line each: data read late in a kernel (after a grid-wide handoff) arrives from L2, not DRAM.
__device__ __forceinline__ void kvc_prefetch_l2(const void* p, kvc_i64 nbytes) {
    if (p == nullptr || nbytes <= 0) return;
    const kvc_u64 first = (kvc_u64)p & ~127ull;
    const kvc_u64 end = (kvc_u64)p + (kvc_u64)nbytes;
    for (kvc_u64 a = first + 128ull * threadIdx.x; a < end; a += 128ull * blockDim.x)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
}

// ------------------------------------------------------------------------------------------------
// small helpers

__device__ __forceinline__ kvc_i64 kvc_min64(kvc_i64 a, kvc_i64 b) { return a < b ? a : b; }
__device__ __forceinline__ kvc_i64 kvc_max64(kvc_i64 a, kvc_i64 b) { return a > b ? a : b; }

// a + b for a, b >= 0, saturating at INT64_MAX.
__device__ __forceinline__ kvc_i64 kvc_sat_add(kvc_i64 a, kvc_i64 b) {
    return (a > KVC_I64_MAX - b) ? KVC_I64_MAX : a + b;
}

// Wrapping signed addition (two's complement), without signed-overflow UB.
__device__ __forceinline__ kvc_i64 kvc_wrap_add(kvc_i64 a, kvc_i64 b) {
    return (kvc_i64)((kvc_u64)a + (kvc_u64)b);
}

// clamp(v, 0, cap) for an int32 device count and an int64 capacity.
__device__ __forceinline__ kvc_i64 kvc_clamp_count(int v, kvc_i64 cap) {
    const kvc_i64 x = v < 0 ? 0 : (kvc_i64)v;
    return x < cap ? x : cap;
}

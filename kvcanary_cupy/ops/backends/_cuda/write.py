"""write on a CUDA device (SPEC §3.1): kvc_write (a warp, or a pair of warps, per request chain, long
requests' hashing spread over the grid), or kvc_write_decode for decode-shaped batches (a thread, or
with real-KV sources a group of lanes, per request)."""

from __future__ import annotations

from ....rawkernels import _loader
from . import Launch, context_args, decode_shaped, i64, kernel, ptr, resident_grid, vec16

_BLOCK = 32 * _loader.SPECS["write"].constant("KVC_WRITE_WARPS")
_CHUNK = _loader.SPECS["write"].constant("KVC_WRITE_CHUNK")
_DECODE_BLOCK = _loader.SPECS["write_decode"].constant("KVC_WRITE_DECODE_THREADS")
_DECODE_LANES = _loader.SPECS["write_decode"].constant("KVC_WRITE_DECODE_LANES")
_SHORT_READ_BYTES = 32  # the head kvc_request_in_group requests: two 16-byte loads


def decode_form(num_entries: int, capacity: int, real_kv: bool) -> bool:
    """write_decode.cu's kvc_write_decode (a thread a request, or with real-KV sources a group of
    KVC_WRITE_DECODE_LANES lanes reading its sources at once) for a decode-shaped batch: at most two
    new tokens a request on average, counted over the plan's capacity; with sources at most one. A
    group walks its request's entries one after another, each entry's sources a memory round trip,
    where kvc_write reads a chunk's at once: two tokens a request with 4 sources measured 9.2
    against 8.3 us (bs256), where one token measured 6.6 against 7.9."""
    requests = max(capacity, 1)
    return num_entries <= requests if real_kv else decode_shaped(requests, num_entries)


def decode_lanes(real_kv: bool) -> int:
    """Lanes a request in kvc_write_decode."""
    return _DECODE_LANES if real_kv else 1


def short_reads(ctx) -> bool:
    """kvc_write_decode's kShortReads: the context hashes at most KVC_WRITE_DECODE_LANES real-KV
    sources, none folding more than the 32 bytes a lane requests at once, so the decode write's
    hashing path holds no fold loop and no second round of sources. False for a context that hashes
    nothing, sources or not (mode NONE): that instance has no hashing path at all."""
    sources = ctx.real_kv_sources
    return (has_real_kv(ctx) and len(sources) <= _DECODE_LANES
            and all(source.read_length(ctx.hash_mode) <= _SHORT_READ_BYTES for source in sources))


def decode_instance(ctx) -> str:
    """The kvc_write_decode instance that writes a decode-shaped batch in ``ctx``."""
    return _loader.instance("kvc_write_decode", vec16(ctx.canary_buf), has_real_kv(ctx), short_reads(ctx))


def paired(num_entries: int, max_requests: int) -> bool:
    """Two warps a request (write.cu's kPaired) unless the batch is decode-shaped (at most two new
    tokens a request on average, counted over the plan's capacity) or no request can reach a second
    chunk: while one warp walks a chunk's chain, the other checks, stages and stores another."""
    return num_entries > _CHUNK and not decode_shaped(max(max_requests, 1), num_entries)


def has_real_kv(ctx) -> bool:
    """The context hashes real-KV sources: the writing kernels' kRealKv instance (without, their
    hashing code is compiled out)."""
    return int(ctx.source_table.shape[0]) > 0


def entry_args(batch) -> tuple:
    """input_ids, positions, out_cache_loc, the input assert's arrays (or nulls) and the entry count."""
    expected_tokens = batch.expected_input_tokens
    expected_positions = batch.expected_input_positions
    num_entries = min(int(batch.input_ids.shape[0]), int(batch.positions.shape[0]),
                      int(batch.out_cache_loc.shape[0]))
    if expected_tokens is not None and expected_positions is not None:
        num_entries = min(num_entries, int(expected_tokens.shape[0]), int(expected_positions.shape[0]))
    else:
        expected_tokens = expected_positions = None
    return (ptr(batch.input_ids), ptr(batch.positions), ptr(batch.out_cache_loc),
            ptr(expected_tokens), ptr(expected_positions), i64(num_entries))


def prepare(ctx, wplan, batch, *, packed: bool = False) -> Launch:
    device_id = ctx.device.index
    capacity = int(wplan.capacity)
    entries = entry_args(batch)
    real_kv = has_real_kv(ctx)
    args = (
        ptr(ctx.canary_buf), i64(ctx.num_slots), i64(ctx.slot_stride_bytes),
        ptr(wplan.offsets), ptr(wplan.seed_slot_indices), ptr(wplan.num_valid_reqs), i64(capacity),
        *entries, ptr(ctx.chain_position_assert), *context_args(ctx), i64(int(batch.tag)),
    )
    if decode_form(int(entries[-1]), capacity, real_kv):
        grid = max(1, -(-capacity * decode_lanes(real_kv) // _DECODE_BLOCK))
        return Launch(kernel("write_decode", decode_instance(ctx), device_id), grid, _DECODE_BLOCK, args, packed=packed)
    name = _loader.instance("kvc_write", vec16(ctx.canary_buf), paired(int(entries[-1]), capacity), real_kv)
    fn = kernel("write", name, device_id)
    resident = resident_grid("write", name, device_id, _BLOCK)
    if real_kv:
        grid = resident  # long requests hand their hashing to every block
    else:
        grid = max(1, min(resident, capacity))  # one chain per block while requests are few
    return Launch(fn, grid, _BLOCK, args, packed=packed)


def write(ctx, wplan, batch, *, stream) -> None:
    prepare(ctx, wplan, batch)(stream)

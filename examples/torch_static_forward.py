"""An engine's decode loop in PyTorch with the canary session bound to its static input tensors.

A serving engine that replays its decode forward as a CUDA graph keeps one set of input tensors per
captured batch size, pads each batch up to that size and refills the tensors in place before each
replay. ``kc.Canary.static_forward`` binds the canary to those tensors once; its ``before()`` and
``after()`` run inside the forward, so on a GPU they are captured in the same ``torch.cuda.graph``
as the model's KV writes. Here five requests are prefilled eagerly (paged bf16 K and V, two
layers), then decode in a batch padded to eight rows; after some clean steps one bit of a request's
cached V is flipped, and the next step's ``poll`` names the request and the position.

``python examples/torch_static_forward.py [--device cpu|cuda|cuda:N]``: on the CPU the same static
forward runs eagerly (no graph); on a GPU (CuPy and PyTorch with CUDA) every decode step after the
first is a graph replay.
"""

import argparse
import importlib.util

import numpy as np
try:
    import torch
except ImportError:
    raise SystemExit("torch_static_forward.py needs PyTorch: pip install torch (the test extra installs it)")

import kvcanary_cupy as kc

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
parser.add_argument("--steps", type=int, default=6, choices=range(1, 20), metavar="N",
                    help="clean decode steps before the bit flip, 1 to 19 (default 6)")
args = parser.parse_args()
try:
    device = torch.device(args.device)
except RuntimeError:  # torch's own words name every device type it knows; these are the ones that run here
    parser.error(f"argument --device: must be cpu, cuda or cuda:N, got {args.device!r}")
if device.type not in ("cpu", "cuda"):
    parser.error(f"argument --device: must be cpu, cuda or cuda:N, got {args.device!r}")
on_gpu = device.type == "cuda"
if on_gpu and not torch.cuda.is_available():
    parser.exit(2, f"--device {args.device} needs a CUDA GPU and PyTorch built with CUDA\n")
if on_gpu and importlib.util.find_spec("cupy") is None:  # else a traceback at the first allocation
    parser.exit(2, f"--device {args.device} needs CuPy: pip install -e '.[cuda12]' (or cuda13)\n")
if on_gpu:
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    torch.cuda.set_device(device)

requests, padded, prompt = 5, 8, 12          # five requests decode in a batch padded to eight rows
layers, pages, page_size, heads, head_dim = 2, 64, 16, 2, 32
rng = np.random.default_rng(0)
torch.manual_seed(0)


def tensor(values, dtype=torch.int64):
    return torch.as_tensor(np.asarray(values), dtype=dtype, device=device)


# The engine's memory: paged bf16 K and V per layer, and the request table (pool row r + 1 is
# request r; row 0 is the padding row). Each request owns two pages, handed out at random.
k_pools = [torch.zeros(pages, page_size, heads, head_dim, dtype=torch.bfloat16, device=device) for _ in range(layers)]
v_pools = [torch.zeros_like(k) for k in k_pools]
width = 2 * page_size                                                 # tokens a request can hold
pages_of = rng.permutation(np.arange(1, pages))[:2 * requests].reshape(requests, 2)
slots = (pages_of[:, :, None] * page_size + np.arange(page_size)).reshape(requests, width)  # [request, position]
req_to_token = torch.zeros(requests + 1, width, dtype=torch.int32, device=device)
req_to_token[1:] = tensor(slots, torch.int32)
tokens = rng.integers(1, 32_000, size=(requests, width))
names = [f"req{r}" for r in range(requests)]

canary = kc.Canary(
    pool_slot_count=pages * page_size, req_to_token=req_to_token, device=str(device),
    capacities=kc.Capacities.from_args(req_to_token_pool_size=requests + 1, max_seq_len_per_req=width,
                                       pool_slot_count=pages * page_size, max_prefill_tokens=requests * prompt,
                                       cuda_graph_max_bs=padded),
    real_kv_sources=kc.layouts.paged(k_pools, v_pools), hash_mode=kc.HashMode.ALL, mode="raise")


def write_kv(out_cache_loc) -> None:
    """The model's part: new K and V for each token of the batch, written into their slots."""
    pages_of, offsets = out_cache_loc // page_size, out_cache_loc % page_size
    for pool in k_pools + v_pools:
        pool[pages_of, offsets] = torch.randn(len(out_cache_loc), heads, head_dim, device=device).to(pool.dtype)


# Prefill, eagerly: every request's prompt in one forward of fresh tensors.
prefill = kc.ForwardBatch(
    req_pool_indices=tensor(np.arange(1, requests + 1)), prefix_lens=tensor(np.zeros(requests)),
    extend_seq_lens=tensor(np.full(requests, prompt)), input_ids=tensor(tokens[:, :prompt].ravel()),
    positions=tensor(np.tile(np.arange(prompt), requests)), out_cache_loc=tensor(slots[:, :prompt].ravel()),
    req_ids=names)
canary.before_forward(prefill)
write_kv(prefill.out_cache_loc)
canary.after_forward(prefill)

# Decode: the static inputs of batch size 8, padding rows (pool row 0) after the real ones.
static = {name: torch.zeros(padded, dtype=torch.int64, device=device)
          for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids", "positions",
                       "out_cache_loc")}
decode_ids = list(names)                     # updated in place with the batch, read by poll
decode = canary.static_forward(kc.ForwardBatch(**static, req_ids=decode_ids))


def refill(length: int) -> None:
    """The batch of every request's token at position ``length`` (its prefix: positions 0 .. length - 1)."""
    real = slice(0, requests)
    static["req_pool_indices"][real] = tensor(np.arange(1, requests + 1))
    static["prefix_lens"][real] = length
    static["extend_seq_lens"].fill_(1)
    static["input_ids"][real] = tensor(tokens[:, length])
    static["positions"][real] = length
    static["out_cache_loc"][real] = tensor(slots[:, length])


def forward() -> None:
    stream = torch.cuda.current_stream() if on_gpu else None
    decode.before(stream=stream)         # plan + HEAD verify of every cached slot the batch reads
    write_kv(static["out_cache_loc"])    # padding rows write slot 0, the padding slot
    decode.after(stream=stream)          # fingerprint the new tokens + TAIL verify


graph = None
length, clean = prompt, 0
for step in range(args.steps + 1):
    if step == args.steps:  # something flips one bit of req3's cached V at position 5, layer 1
        v_pools[1].view(torch.uint8)[int(pages_of[3, 0]), 5, 0, 7] ^= 0x04
    refill(length)
    if graph is not None:
        graph.replay()
    else:
        forward()                        # once eagerly: every kernel loaded before a capture
        if on_gpu:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
    length += 1
    try:
        report = canary.poll()           # waits for the device; names requests from the tensors now
    except kc.CanaryViolation as caught:  # an engine would abort the requests it names
        report = caught.report
    if step < args.steps:
        clean += report.total
    if step == args.steps - 1:
        replays = f" ({args.steps - 1} graph replays)" if on_gpu else ""
        print(f"after {args.steps} decode steps{replays}: {clean} violation(s)")

print(f"after the bit flip: {report.total} violation(s)")
for event in report:
    print(event.describe())

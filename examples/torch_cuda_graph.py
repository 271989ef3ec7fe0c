"""A decode step captured in a PyTorch CUDA graph with the canary inside it.

Engines replay their decode forward as a CUDA graph over static input tensors. The canary's part of
a forward, a ``kc.CanaryStep`` (HEAD verify of every cached slot the batch reads, then the
fingerprint of the new tokens), is bound to those same tensors when it is built, so it is captured
with the forward: launch it on ``torch.cuda.current_stream()`` inside ``torch.cuda.graph``. Each
replay then re-checks the whole prefix of every request and fingerprints the token the model has
just written, with no host work beyond refilling the inputs. Here the "model" writes random bf16
K and V for each new token; after some clean replays one bit of a cached K row is flipped, and the
next replay reports it.

Needs a CUDA GPU, CuPy and PyTorch: ``python examples/torch_cuda_graph.py [--device cuda:N]``.
"""

import argparse
import importlib.util

import numpy as np
try:
    import torch
except ImportError:
    raise SystemExit("torch_cuda_graph.py needs PyTorch: pip install torch (the test extra installs it)")

import kvcanary_cupy as kc

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--device", default="cuda", help="cuda or cuda:N (default cuda)")
parser.add_argument("--steps", type=int, default=16,
                    help="decode steps before the bit flip, the first eager and the rest graph replays (default 16; "
                         "6 to 63: the flip is at position 5, and one more step must fit in 64 positions)")
args = parser.parse_args()
if not 6 <= args.steps <= 63:
    parser.error(f"--steps must be 6 to 63, got {args.steps}")
if not torch.cuda.is_available():
    parser.exit(2, "torch_cuda_graph.py needs a CUDA GPU and PyTorch built with CUDA; "
                   "examples/torch_static_forward.py runs the same kind of loop on the CPU\n")
if importlib.util.find_spec("cupy") is None:  # else a traceback at the first allocation
    parser.exit(2, "torch_cuda_graph.py needs CuPy: pip install -e '.[cuda12]' (or cuda13)\n")
device = torch.device(args.device)
device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
torch.cuda.set_device(device)

bs, width, num_slots, heads, head_dim = 8, 64, 4096, 4, 32
rng = np.random.default_rng(0)
torch.manual_seed(0)

# The engine's KV pool (one layer, bf16 [slots, heads, head_dim]) and its request table: request r
# lives on pool row r + 1 and owns `width` random slots (slot 0 is the padding slot).
k_pool = torch.zeros(num_slots, heads, head_dim, dtype=torch.bfloat16, device=device)
v_pool = torch.zeros_like(k_pool)
req_to_token = torch.zeros(bs + 1, width, dtype=torch.int32, device=device)
slots = rng.permutation(np.arange(1, num_slots))[: bs * width].reshape(bs, width)
req_to_token[1:] = torch.as_tensor(slots, dtype=torch.int32, device=device)


def static(*shape, dtype=torch.int64):
    return torch.zeros(shape, dtype=dtype, device=device)


# The static inputs a graph-replaying engine refills before every replay.
req_pool_indices = torch.arange(1, bs + 1, device=device)
extend_seq_lens = torch.ones(bs, dtype=torch.int64, device=device)
prefix_lens, positions, input_ids, out_cache_loc = static(bs), static(bs), static(bs), static(bs)
new_k, new_v = static(bs, heads, head_dim, dtype=torch.bfloat16), static(bs, heads, head_dim, dtype=torch.bfloat16)

ctx = kc.CanaryContext.allocate(num_slots, device=f"cuda:{device.index}", hash_mode=kc.HashMode.ALL,
                                real_kv_sources=kc.layouts.per_layer([k_pool], [v_pool]))
step = kc.CanaryStep(ctx, verify_capacity=bs * width, verify_tag=kc.LaunchTag.HEAD_K_FULL,
                     write_tag=kc.LaunchTag.TAIL_K_FULL, req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
                     extend_seq_lens=extend_seq_lens, req_to_token=req_to_token, input_ids=input_ids,
                     positions=positions, out_cache_loc=out_cache_loc)


def forward():
    """The graph's work: the model writes the new tokens' K and V, then the canary step runs."""
    k_pool[out_cache_loc] = new_k
    v_pool[out_cache_loc] = new_v
    step.launch(stream=torch.cuda.current_stream())


def refill(t: int) -> None:
    """Decode step t: every request's token at position t (its prefix is positions 0 .. t - 1)."""
    prefix_lens.fill_(t)
    positions.fill_(t)
    input_ids.copy_(torch.randint(0, 32_000, (bs,), device=device))
    out_cache_loc.copy_(req_to_token[1:, t].to(torch.int64))
    new_k.normal_()
    new_v.normal_()


refill(0)
forward()  # one eager step: loads the kernels, which capture must not do
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    forward()
for t in range(1, args.steps):
    refill(t)
    graph.replay()
report = ctx.violations()  # the one call that waits for the device
print(f"after {args.steps} decode steps ({args.steps - 1} graph replays): {report.total} violation(s)")

# Something flips one bit of request 3's cached K at position 5; the next replay re-checks it.
flipped = int(slots[3, 5])
k_pool.view(torch.uint8)[flipped, 0, 0] ^= 0x04
refill(args.steps)
graph.replay()
report = ctx.violations()
print(f"after the bit flip in slot {flipped}: {report.total} violation(s)")
for violation in report:
    print(violation.describe())

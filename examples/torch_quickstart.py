"""The quickstart with PyTorch tensors: a bfloat16 KV pool as the real-KV source, one request's chain
written, a bit of its KV flipped, verify, the decoded violation printed.

CPU tensors by default; ``--device cuda`` uses CUDA tensors (the kernels need CuPy) and launches
every op on PyTorch's current stream. The tensors are used in place through DLPack, never copied.
"""

import argparse
import importlib.util

import numpy as np
try:
    import torch
except ImportError:
    raise SystemExit("torch_quickstart.py needs PyTorch: pip install torch (the test extra installs it)")

import kvcanary_cupy as kc

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
device = parser.parse_args().device
if device != "cpu" and not torch.cuda.is_available():
    parser.exit(2, f"--device {device} needs a CUDA GPU and PyTorch built with CUDA\n")
if device != "cpu" and importlib.util.find_spec("cupy") is None:  # else a traceback at the first allocation
    parser.exit(2, f"--device {device} needs CuPy: pip install -e '.[cuda12]' (or cuda13)\n")
# Ops on CUDA arrays take stream= (a CuPy stream, a raw handle, torch.cuda.Stream or any object with
# __cuda_stream__); host arrays run synchronously and ignore it.
stream = torch.cuda.current_stream(device) if device != "cpu" else None

rng = np.random.default_rng(0)
num_slots, prompt = 1024, 12
torch.manual_seed(0)
kv_pool = torch.randn(num_slots, 8, 8, dtype=torch.bfloat16, device=device)  # [slots, heads, dim]: 128 B a slot

ctx = kc.CanaryContext.allocate(
    num_slots, device=device, hash_mode=kc.HashMode.PARTIAL,
    real_kv_sources=[kc.RealKvSource(tensor=kv_pool, page_size=1, num_bytes_per_token=128, read_bytes=128)])
vplan = kc.VerifyPlan.allocate(4096, device=device)
wplan = kc.WritePlan.allocate(8, device=device)


def tensor(values, dtype=torch.int64):
    return torch.as_tensor(np.asarray(values), dtype=dtype, device=device)


# The engine's tables: request 1 (pool row 1) owns these slots for its 12 prompt tokens.
req_to_token = torch.zeros((2, 64), dtype=torch.int32, device=device)
slots = rng.permutation(np.arange(1, num_slots))[:prompt]
req_to_token[1, :prompt] = tensor(slots, torch.int32)
token_ids = tensor(rng.integers(0, 32_000, size=prompt))

# Prefill: plan (nothing cached yet), then fingerprint the 12 new tokens.
batch = dict(req_pool_indices=tensor([1]), prefix_lens=tensor([0]), extend_seq_lens=tensor([prompt]),
             req_to_token=req_to_token)
kc.plan(vplan, wplan, **batch, stream=stream)
kc.write(ctx, wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=token_ids, positions=tensor(np.arange(prompt)),
         out_cache_loc=tensor(slots), stream=stream)

# Something flips one bit of the bfloat16 KV of the token at position 7 (its bytes seen as uint8).
kv_pool.view(torch.uint8)[int(slots[7]), 0, 3] ^= 0x10

# Decode step: the 12 cached tokens are the prefix; HEAD verify re-checks them before the forward.
kc.plan(vplan, wplan, **dict(batch, prefix_lens=tensor([prompt]), extend_seq_lens=tensor([1])), stream=stream)
kc.verify(ctx, vplan, tag=kc.LaunchTag.HEAD_K_FULL, stream=stream)

report = ctx.violations()  # the one call that waits for the device
print(f"{report.total} violation(s), {report.dropped} dropped")
for violation in report:
    print(violation.describe())

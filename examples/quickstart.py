"""Write one request's chain, corrupt a slot, verify, print the decoded violation.

On the CPU by default; ``--device cuda`` runs it on a GPU (the kernels need CuPy).
"""

import argparse

import numpy as np

import kvcanary_cupy as kc

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
device = parser.parse_args().device
xp = np
if device != "cpu":
    try:
        import cupy as xp
    except ImportError:
        parser.exit(2, f"--device {device} needs CuPy: pip install -e '.[cuda12]' (or cuda13)\n")
    xp.cuda.Device(int(device.partition(":")[2] or 0)).use()  # the arrays below on that GPU

rng = np.random.default_rng(0)
num_slots, prompt = 1024, 12
kv_pool = xp.asarray(rng.integers(0, 256, size=(num_slots, 8, 16), dtype=np.uint8))  # [slots, heads, dim]

ctx = kc.CanaryContext.allocate(
    num_slots, device=device, hash_mode=kc.HashMode.PARTIAL,
    real_kv_sources=[kc.RealKvSource(tensor=kv_pool, page_size=1, num_bytes_per_token=128, read_bytes=128)])
vplan = kc.VerifyPlan.allocate(4096, device=device)
wplan = kc.WritePlan.allocate(8, device=device)

# The engine's tables: request 1 (pool row 1) owns these slots for its 12 prompt tokens.
req_to_token = xp.zeros((2, 64), dtype=xp.int32)
slots = rng.permutation(np.arange(1, num_slots))[:prompt]
req_to_token[1, :prompt] = xp.asarray(slots.astype(np.int32))
token_ids = xp.asarray(rng.integers(0, 32_000, size=prompt))

# Prefill: plan (nothing cached yet), then fingerprint the 12 new tokens.
batch = dict(req_pool_indices=xp.asarray([1]), prefix_lens=xp.asarray([0]), extend_seq_lens=xp.asarray([prompt]),
             req_to_token=req_to_token)
kc.plan(vplan, wplan, **batch)
kc.write(ctx, wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=token_ids,
         positions=xp.arange(prompt, dtype=xp.int64), out_cache_loc=xp.asarray(slots.astype(np.int64)))

# Something scribbles on the KV bytes of the token at position 7.
kv_pool[int(slots[7]), 0, 3] ^= 0x10

# Decode step: the 12 cached tokens are the prefix; HEAD verify re-checks them before the forward.
kc.plan(vplan, wplan, **dict(batch, prefix_lens=xp.asarray([prompt]), extend_seq_lens=xp.asarray([1])))
kc.verify(ctx, vplan, tag=kc.LaunchTag.HEAD_K_FULL)

report = ctx.violations()
print(f"{report.total} violation(s), {report.dropped} dropped")
for violation in report:
    print(violation.describe())

"""The numba CPU backend: host-memory KV tiers, machines without GPUs, and the GPU's oracle."""

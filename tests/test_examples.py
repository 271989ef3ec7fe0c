"""The examples in ``examples/`` run on the CPU and print the violation the README shows."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from _devices import requires_gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(script: str, device: str = "cpu") -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--device", device], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_quickstart():
    out = _run("quickstart.py")
    assert "1 violation(s), 0 dropped" in out
    assert ("HEAD_K_FULL: slot 655 position 7 [REAL_KV_HASH] token stored=18503 expected=-1 "
            "chain stored=0x9fcfebb3f18735e9 aux=0x9fcfebb3f18735e9") in out


def test_session():
    out = _run("session.py")
    assert "after 3 forwards: 0 violation(s)" in out
    assert ("[HEAD_K_FULL step 4] request 'b' position 3 slot 23: REAL_KV_HASH "
            "(stored token 19412 position 3)") in out
    assert ("[TAIL_K_FULL step 4] request 'b' position 3 slot 23: REAL_KV_HASH "
            "(stored token 19412 position 3)") in out


# What the engine examples print, the same on the CPU and on a GPU:
_FINDINGS = {
    # block tables, K/V stacked a layer, the table mirrored a block at a time: a block freed while
    # request a still holds it and rewritten by a new request is reported at a's positions in it
    # (stored positions of the new request) and the one after it
    "block_tables.py": [
        "after 5 forwards: 0 violation(s)",
        "after the bug: 10 violation(s), requests ['a']",
        "[HEAD_K_FULL step 7] request 'a' position 8 slot 12: CHAIN_HASH|POSITION (stored token 20052 position 0)",
        "[HEAD_K_FULL step 7] request 'a' position 11 slot 15: POSITION (stored token 2820 position 3)",
        "[HEAD_K_FULL step 7] request 'a' position 12 slot 20: CHAIN_HASH (stored token 24576 position 12)",
    ],
    # a request offloaded to a host tier and loaded back into other slots, its records carried with
    # kc.copy_records: clean, and a bit flipped in host memory meanwhile is reported at the next
    # forward's reads
    "kv_tiers.py": [
        "after offloading and reloading request a: 0 violation(s) over 4 forwards",
        "after a bit flip in host memory while a was offloaded: 2 violation(s)",
        "[HEAD_K_FULL step 5] request 'a' position 5 slot 30: REAL_KV_HASH (stored token 1312 position 5)",
        "[TAIL_K_FULL step 5] request 'a' position 5 slot 30: REAL_KV_HASH (stored token 1312 position 5)",
    ],
}


@pytest.mark.parametrize("script", sorted(_FINDINGS))
def test_engine_examples(script):
    out = _run(script)
    assert all(line in out for line in _FINDINGS[script]), out


@requires_gpu
@pytest.mark.parametrize("script", sorted(_FINDINGS))
def test_engine_examples_on_a_gpu(script):
    out = _run(script, "cuda")
    assert all(line in out for line in _FINDINGS[script]), out


def test_torch_quickstart():
    pytest.importorskip("torch")
    out = _run("torch_quickstart.py")
    assert "1 violation(s), 0 dropped" in out
    assert ("HEAD_K_FULL: slot 3 position 7 [REAL_KV_HASH] token stored=14933 expected=-1 "
            "chain stored=0xc258788ae6f55ecb aux=0xc258788ae6f55ecb") in out


@requires_gpu
def test_torch_cuda_graph():
    """The canary step captured with a decode forward in a torch CUDA graph: clean replays report
    nothing, and the replay after a bit flip in a cached K row reports that slot and position."""
    pytest.importorskip("torch")
    out = _run("torch_cuda_graph.py", "cuda")
    assert "after 16 decode steps (15 graph replays): 0 violation(s)" in out
    flipped = re.search(r"after the bit flip in slot (\d+): 1 violation\(s\)", out)
    assert flipped, out
    assert re.search(rf"HEAD_K_FULL: slot {flipped.group(1)} position 5 \[REAL_KV_HASH\]", out), out


def _static_forward_output(device: str) -> str:
    out = _run("torch_static_forward.py", device)
    assert "after the bit flip: 2 violation(s)" in out
    for tag in ("HEAD_K_FULL", "TAIL_K_FULL"):
        assert (f"[{tag} step 8] request 'req3' position 5 slot 853: REAL_KV_HASH "
                "(stored token 28566 position 5)") in out
    return out


def test_torch_static_forward():
    """An engine's decode loop over static torch tensors padded to eight rows, the canary bound once
    with kc.Canary.static_forward: clean steps report nothing, the step after a bit flip in a cached
    V row names the request and position (on the CPU the forward runs eagerly)."""
    pytest.importorskip("torch")
    assert "after 6 decode steps: 0 violation(s)" in _static_forward_output("cpu")


@requires_gpu
def test_torch_static_forward_in_a_cuda_graph():
    """The same loop on a GPU, the static forward captured with the model's KV writes in a torch CUDA
    graph and replayed: the same report, byte for byte, as on the CPU."""
    pytest.importorskip("torch")
    assert "after 6 decode steps (5 graph replays): 0 violation(s)" in _static_forward_output("cuda")


def test_torch_cuda_graph_without_a_gpu_says_why():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_cuda_graph.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "meta"])
def test_torch_static_forward_refuses_a_device_it_cannot_run_on(device):
    """A device torch cannot parse, or one that is neither the CPU nor a GPU, is refused by the
    argument parser in one line (exit 2), not a traceback from torch.device or from the first op."""
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_static_forward.py"), "--device", device],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"argument --device: must be cpu, cuda or cuda:N, got '{device}'" in done.stderr

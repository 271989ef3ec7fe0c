"""kc.Canary under speculative decoding: a target forward verifies drafted tokens (a chain or a
tree of them) and the engine keeps the path the target accepts, frees the other slots and reuses
them. Fingerprinting all the drafts of a chain, or only the accepted path of a tree, reports
nothing over many steps; a bit flipped in kept KV is reported at its position in the next step;
a freed draft slot is never read."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

import kvcanary_cupy as kc
from _devices import BACKENDS, to_device, to_numpy

SLOTS, ROWS, WIDTH, DRAFTS = 256, 4, 160, 3


class SpeculativeEngine:
    """Requests over a pool whose free list hands freed draft slots out again; K and V buffers of
    random bytes for every slot written. Each step drafts ``DRAFTS`` tokens a request, as a chain
    or as a tree whose nodes fork, runs the target over every draft (their KV written) and keeps
    a random accepted path."""

    def __init__(self, device, seed=0):
        self.device = device
        self.rng = np.random.default_rng(seed)
        self.table = np.zeros((ROWS, WIDTH), np.int32)
        self.table_dev = to_device(self.table, device)
        self.k = to_device(np.zeros((SLOTS, 2, 8), np.float32), device)
        self.v = to_device(np.zeros((SLOTS, 2, 8), np.float32), device)
        caps = kc.Capacities.from_args(req_to_token_pool_size=ROWS, max_seq_len_per_req=WIDTH, pool_slot_count=SLOTS,
                                       max_prefill_tokens=64, speculative_num_draft_tokens=4 * DRAFTS)
        self.canary = kc.Canary(pool_slot_count=SLOTS, capacities=caps, req_to_token=self.table_dev, device=device,
                                real_kv_sources=kc.layouts.per_layer([self.k], [self.v]), hash_mode=kc.HashMode.ALL,
                                chain_position_assert=True)
        self.free = collections.deque(range(1, SLOTS))
        self.rows = {"a": 1, "b": 2}
        self.lens = {rid: 0 for rid in self.rows}
        self.next_token = {rid: int(self.rng.integers(1, 50_000)) for rid in self.rows}  # sampled, no KV yet
        self.freed_drafts: list[int] = []

    def i64(self, values):
        return to_device(np.asarray(values, np.int64), self.device)

    def batch(self, rids, prefix, nodes) -> kc.ForwardBatch:
        """A forward over ``nodes[rid]`` (token, position, slot) of each request."""
        flat = [node for rid in rids for node in nodes[rid]]
        return kc.ForwardBatch(req_pool_indices=self.i64([self.rows[r] for r in rids]),
                               prefix_lens=self.i64([prefix[r] for r in rids]),
                               extend_seq_lens=self.i64([len(nodes[r]) for r in rids]),
                               input_ids=self.i64([n[0] for n in flat]), positions=self.i64([n[1] for n in flat]),
                               out_cache_loc=self.i64([n[2] for n in flat]), req_ids=list(rids))

    def write_kv(self, slots) -> None:
        for buf in (self.k, self.v):
            buf[self.i64(slots)] = to_device(self.rng.standard_normal((len(slots), 2, 8)).astype(np.float32),
                                             self.device)

    def prefill(self, tokens: int) -> None:
        nodes = {}
        for rid, row in self.rows.items():
            nodes[rid] = [(int(self.rng.integers(1, 50_000)), p, self.free.popleft()) for p in range(tokens)]
            self.table[row, :tokens] = [slot for *_, slot in nodes[rid]]
            self.lens[rid] = tokens
        self.table_dev[...] = to_device(self.table, self.device)
        batch = self.batch(list(self.rows), {rid: 0 for rid in self.rows}, nodes)
        self.canary.before_forward(batch)
        self.write_kv([slot for rid in nodes for *_, slot in nodes[rid]])
        self.canary.after_forward(batch)

    def draft(self, rid, tree: bool):
        """The request's pending token and its drafts as nodes ``(token, position, slot)`` in flat
        (breadth-first) order, with each node's parent index; the root is the pending token."""
        start = self.lens[rid]
        nodes, parents = [(self.next_token[rid], start, self.free.popleft())], [-1]
        frontier = [0]
        for depth in range(1, DRAFTS + 1):
            grown = []
            for parent in frontier:
                for _ in range(int(self.rng.integers(1, 3)) if tree else 1):
                    nodes.append((int(self.rng.integers(1, 50_000)), start + depth, self.free.popleft()))
                    parents.append(parent)
                    grown.append(len(nodes) - 1)
            frontier = grown[:2]  # at most two nodes a depth go on growing
        return nodes, parents

    def bind_chain_forward(self) -> tuple["kc.StaticForward", dict]:
        """After one eager chain step: a static forward over arrays shaped as its batch, to refill."""
        first = self.step(tree=False, keep_all_drafts=True)
        arrays = {name: to_device(to_numpy(getattr(first, name)), self.device) for name in
                  ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids", "positions", "out_cache_loc")}
        return self.canary.static_forward(kc.ForwardBatch(**arrays, req_ids=list(self.rows))), arrays

    def static_step(self, static: "kc.StaticForward", arrays: dict, *, keep_all_drafts: bool = True) -> None:
        """A chain step through ``static``, bound to ``arrays``, refilled in place: as a verify
        forward captured in a CUDA graph runs. Without ``keep_all_drafts`` the kept tokens are
        fingerprinted by an eager ``after_forward``."""
        fresh = self.step(tree=False, keep_all_drafts=True, run=False)
        for name, array in arrays.items():
            array[...] = getattr(fresh, name)
        static.before()
        self.write_kv(to_numpy(arrays["out_cache_loc"]).tolist())
        if keep_all_drafts:
            static.after()
        else:
            self.canary.after_forward(self.kept)

    def step(self, *, tree: bool, keep_all_drafts: bool = False, run: bool = True) -> kc.ForwardBatch:
        """One target forward over every request's drafts. With ``keep_all_drafts`` (a chain), the
        forward's own batch is fingerprinted; otherwise only each request's accepted path. Without
        ``run`` the canary is not called: the caller runs the returned batch (a chain's)."""
        rids = list(self.rows)
        drafted = {rid: self.draft(rid, tree) for rid in rids}
        prefix = dict(self.lens)
        forward = self.batch(rids, prefix, {rid: drafted[rid][0] for rid in rids})
        if run:
            self.canary.before_forward(forward)
            self.write_kv([slot for rid in rids for *_, slot in drafted[rid][0]])
        accepted, self.rejected = {}, {}
        for rid in rids:
            nodes, parents = drafted[rid]
            node = int(self.rng.integers(0, len(nodes)))  # the deepest accepted node
            path = []
            while node >= 0:
                path.append(node)
                node = parents[node]
            accepted[rid] = [nodes[i] for i in reversed(path)]
            self.rejected[rid] = [nodes[i] for i in range(len(nodes)) if i not in path]
            rejected = [slot for *_, slot in self.rejected[rid]]
            self.freed_drafts += rejected
            self.free.extendleft(rejected)  # handed out again first
        flat = [node for rid in rids for node in accepted[rid]]
        self.kept = dataclasses.replace(forward, extend_seq_lens=self.i64([len(accepted[r]) for r in rids]),
                                        input_ids=self.i64([n[0] for n in flat]),
                                        positions=self.i64([n[1] for n in flat]),
                                        out_cache_loc=self.i64([n[2] for n in flat]))
        if run:
            self.canary.after_forward(forward if keep_all_drafts else self.kept)
        for rid in rids:
            kept = accepted[rid]
            self.table[self.rows[rid], self.lens[rid]:self.lens[rid] + len(kept)] = [slot for *_, slot in kept]
            self.lens[rid] += len(kept)
            self.next_token[rid] = int(self.rng.integers(1, 50_000))  # the target's bonus token
        self.table_dev[...] = to_device(self.table, self.device)
        return forward

    def slot(self, rid, position) -> int:
        return int(self.table[self.rows[rid], position])


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("tree,keep_all_drafts", [(False, True), (False, False), (True, False)],
                         ids=["chain-all-drafts", "chain-accepted", "tree-accepted"])
def test_speculative_steps_report_nothing_and_count_one_forward_each(device, tree, keep_all_drafts):
    eng = SpeculativeEngine(device)
    eng.prefill(6)
    for _ in range(25):
        eng.step(tree=tree, keep_all_drafts=keep_all_drafts)
    report = eng.canary.poll()
    assert len(report) == 0 and report.total == 0
    assert report.forwards == 1 + 25  # after_forward with the accepted tokens is the same forward
    assert len(set(eng.freed_drafts)) < len(eng.freed_drafts)  # freed draft slots were handed out again
    eng.canary.sweep(kc.LiveRequests(req_pool_indices=eng.i64([1, 2]), seq_lens=eng.i64([eng.lens["a"],
                                                                                          eng.lens["b"]])))
    assert len(eng.canary.poll()) == 0


@pytest.mark.parametrize("device", BACKENDS)
def test_chain_steps_through_a_static_forward_report_nothing(device):
    """A chain's verify forward bound once (a static forward over arrays refilled in place, as a
    CUDA-graph engine's) fingerprints every draft it verifies; the kept ones chain as written."""
    eng = SpeculativeEngine(device, seed=4)
    eng.prefill(6)
    static, arrays = eng.bind_chain_forward()
    for _ in range(20):
        eng.static_step(static, arrays)
    assert len(eng.canary.poll()) == 0
    slot = eng.slot("a", eng.lens["a"] - 1)
    eng.v[slot, 0, 0] += 1.0
    eng.static_step(static, arrays)
    assert {(e.slot, e.reasons) for e in eng.canary.poll()} == {(slot, ("REAL_KV_HASH",))}
    static.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_a_static_forward_then_its_kept_tokens_eagerly_is_one_forward(device):
    """The verify forward's HEAD through a static forward run eagerly, its kept tokens through an
    eager after_forward: one forward, and a prefix row flipped before it is reported by HEAD and
    TAIL at that forward's step."""
    eng = SpeculativeEngine(device, seed=5)
    eng.prefill(6)
    static, arrays = eng.bind_chain_forward()
    for _ in range(5):
        eng.static_step(static, arrays, keep_all_drafts=False)
    assert len(eng.canary.poll()) == 0
    slot = eng.slot("b", 2)
    eng.k[slot, 0, 1] += 1.0
    eng.static_step(static, arrays, keep_all_drafts=False)
    report = eng.canary.poll()
    assert report.forwards == 1 + 1 + 6
    assert {(e.phase, e.step, e.request, e.position) for e in report} == {("head", 8, "b", 2), ("tail", 8, "b", 2)}
    static.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_a_tree_fingerprinted_in_flat_order_breaks_its_chains(device):
    """Why the accepted path is what a tree step fingerprints: written in the forward's flat order,
    a node's record chains to the node before it, not to its parent, and the positions it is given
    jump back at each fork, so a kept path that leaves the first branch reads back as corrupt."""
    eng = SpeculativeEngine(device, seed=3)
    eng.prefill(6)
    for _ in range(25):
        eng.step(tree=True, keep_all_drafts=True)
    reasons = {reason for event in eng.canary.poll() for reason in event.reasons}
    assert {"CHAIN_HASH", "WRITE_POSITION"} <= reasons


@pytest.mark.parametrize("device", BACKENDS)
def test_kept_kv_flipped_between_steps_is_reported_where_it_was(device):
    eng = SpeculativeEngine(device, seed=1)
    eng.prefill(6)
    for _ in range(10):
        eng.step(tree=True)
    assert len(eng.canary.poll()) == 0
    position = eng.lens["b"] - 2  # kept by a speculative step
    slot = eng.slot("b", position)
    eng.k[slot, 1, 3] += 1.0
    eng.step(tree=True)
    report = eng.canary.poll()
    found = {(e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in report}
    assert ("head", 12, "b", position, slot, ("REAL_KV_HASH",)) in found
    assert {e.slot for e in report} == {slot}


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("keep_all_drafts", [False, True], ids=["kept-only", "all-drafts"])
def test_a_rejected_draft_kept_by_mistake(device, keep_all_drafts):
    """The engine commits one token too many: the first rejected draft of a chain stays in
    ``req_to_token``. Fingerprinting only the kept tokens, the next forward reads a slot with no
    record of that token and reports it; fingerprinting every draft, the mistake reads as written."""
    eng = SpeculativeEngine(device, seed=6)
    eng.prefill(6)
    while True:
        eng.step(tree=False, keep_all_drafts=keep_all_drafts)
        if eng.rejected["a"]:
            break
    token, position, slot = eng.rejected["a"][0]
    assert position == eng.lens["a"]
    eng.free.remove(slot)
    eng.table[eng.rows["a"], position] = slot
    eng.lens["a"] += 1
    eng.table_dev[...] = to_device(eng.table, device)
    eng.step(tree=False, keep_all_drafts=keep_all_drafts)
    found = {(e.phase, e.request, e.position) for e in eng.canary.poll()}
    assert (("head", "a", position) in found) == (not keep_all_drafts)


@pytest.mark.parametrize("device", BACKENDS)
def test_a_freed_draft_slot_is_not_read(device):
    """Corrupting a rejected draft's slot after it was freed reports nothing: no request reads it,
    and the request it is handed to next writes it before reading it."""
    eng = SpeculativeEngine(device, seed=2)
    eng.prefill(6)
    eng.step(tree=True)
    slot = eng.freed_drafts[-1]
    eng.k[slot] = to_device(to_numpy(eng.k[slot]) + 1.0, device)
    for _ in range(10):
        eng.step(tree=True)
    assert slot in {eng.slot(rid, p) for rid in eng.rows for p in range(eng.lens[rid])} or slot in eng.free
    assert len(eng.canary.poll()) == 0

"""KV cache groups: atomic allocation, sliding-window release, leaks, prefix hits across groups."""

from __future__ import annotations

import math
import random
from collections import Counter

import torch

from heron.cache import (
    NULL_BLOCK_ID,
    CacheManager,
    FullAttentionSpec,
    KVCacheCoordinator,
    SlidingWindowSpec,
)
from heron.engine.request import Request
from heron.sampling_params import SamplingParams

from kv_invariants import InvariantChecked, cache_specs

FULL, SLIDING = 0, 1


class CheckedCoordinator(InvariantChecked, KVCacheCoordinator):
    """Checks every invariant after every public operation."""


def coordinator(sizes, block_size, windows=(None,), caching=True, cls=CheckedCoordinator):
    """A coordinator of one group per window (``None``: full attention), pools of ``sizes``."""
    return cls(cache_specs(block_size, windows), sizes, caching)


def make_request(request_id: str, tokens) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=None))


def state(kv: KVCacheCoordinator):
    return [
        (
            g.num_free_blocks,
            {rid: list(s.block_ids) for rid, s in g._requests.items()},
            list(g._pool.ref_cnt),
            dict(g._pool.cached),
        )
        for g in kv.groups
    ]


def assert_idle(kv: KVCacheCoordinator) -> None:
    kv.check_invariants()
    for g in kv.groups:
        assert g.num_free_blocks == g.num_blocks - 1
    assert kv.usage == 0.0


def live(table: list[int]) -> int:
    return sum(b != NULL_BLOCK_ID for b in table)


def test_one_group_behaves_like_a_manager():
    kv = coordinator([10], 4)
    r = make_request("a", range(10))
    hits, n = kv.get_computed_blocks(r)
    assert (hits, n) == (([],), 0)
    assert kv.allocate_slots(r, 10, hits)
    assert len(kv.block_table("a")) == 3 and kv.block_tables("a") == [kv.block_table("a")]
    assert kv.num_free_blocks == 6
    r.num_computed_tokens = 10
    kv.free(r)
    assert_idle(kv)


def test_allocation_is_atomic_across_groups():
    # The full group is the short one: 3 usable blocks of 2 tokens.
    kv = coordinator([4, 20], 2, [None, 4])
    a = make_request("a", range(8))
    before = state(kv)
    assert not kv.allocate_slots(a, 8)  # the full group needs 4 blocks
    assert state(kv) == before
    # Now the sliding group is the short one.
    kv = coordinator([20, 3], 2, [None, 4])
    before = state(kv)
    assert not kv.allocate_slots(a, 8)  # a whole prompt at once: 4 blocks in every group
    assert state(kv) == before
    assert kv.allocate_slots(a, 2) and kv.allocate_slots(a, 0) is True
    assert [live(t) for t in kv.block_tables("a")] == [1, 1]


def test_sliding_group_releases_blocks_outside_the_window():
    bs, window = 2, 4
    kv = coordinator([40, 40], bs, [None, window])
    sliding = kv.groups[SLIDING]
    r = make_request("a", range(6))
    assert kv.allocate_slots(r, 6)
    r.num_computed_tokens = 6
    bound = math.ceil((window + 1) / bs) + 1
    for step in range(30):
        r.append_output_token(100 + step)
        c = r.num_computed_tokens
        assert kv.allocate_slots(r, 1)
        full_table, sliding_table = kv.block_tables("a")
        assert len(full_table) == len(sliding_table) == c // bs + 1
        assert live(full_table) == len(full_table)  # full history kept
        first_kept = max(0, c - window)  # the key just before the window (c - W + 1 on)
        for i, block in enumerate(sliding_table):
            # Released exactly the blocks whose tokens all precede that key.
            assert (block == NULL_BLOCK_ID) == ((i + 1) * bs <= first_kept)
        assert live(sliding_table) <= bound
        assert sliding.num_free_blocks == sliding.num_blocks - 1 - live(sliding_table)
        r.num_computed_tokens += 1
    assert kv.groups[FULL].num_free_blocks < sliding.num_free_blocks
    kv.free(r)
    assert_idle(kv)


def test_async_decode_takes_the_full_path_once_per_block():
    """Decoding with each step's input token still being sampled (appended to the request only
    after the step is scheduled), a window that is a multiple of the block size and prefix
    caching: the full allocation path runs once per block, in the step whose token opens a
    new block. That step takes the block, registers the one just filled and releases the one
    that slid out; every other step is quiet."""
    bs, window = 4, 8
    kv = coordinator([40, 40], bs, [None, window])
    r = make_request("a", range(10))
    assert kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    full_path = []
    for group in kv.groups:
        commit = group.commit

        def counted(*args, commit=commit):
            full_path.append(r.num_computed_tokens)
            return commit(*args)

        group.commit = counted
    for step in range(40):
        assert len(r.all_token_ids) == r.num_computed_tokens  # the input token is pending
        assert kv.allocate_slots(r, 1)
        r.append_output_token(100 + step)  # read after the step was scheduled
        r.num_computed_tokens += 1
    opened = [c for c in range(10, 50) if c % bs == 0]
    assert sorted(set(full_path)) == opened
    first_kept = (r.num_computed_tokens - 1 - window) // bs
    _, sliding_table = kv.block_tables("a")
    assert live(sliding_table) == len(sliding_table) - first_kept
    kv.free(r)
    assert_idle(kv)


def test_released_blocks_are_reused_in_the_same_step():
    # 3 usable sliding blocks of 2 tokens, window 2: a decoding request never needs more.
    kv = coordinator([40, 4], 2, [None, 2])
    r = make_request("a", range(4))
    assert kv.allocate_slots(r, 4)
    r.num_computed_tokens = 4
    for step in range(20):
        r.append_output_token(7)
        assert kv.allocate_slots(r, 1), f"step {step}"
        r.num_computed_tokens += 1
    kv.free(r)
    assert_idle(kv)


def test_prefix_hit_is_the_minimum_over_groups():
    bs = 2
    kv = coordinator([30, 8], bs, [None, 4])
    a = make_request("a", range(12))
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.free(a)  # all 6 blocks cached in both groups; the tail ones are evicted first
    b = make_request("b", range(100, 106))
    assert kv.allocate_slots(b, 6)  # in the sliding group: the unused block and a's last two
    b.num_computed_tokens = 6
    kv.free(b)
    c = make_request("c", list(range(12)) + [55])
    full_chain = kv.groups[FULL].find_cached_chain(c)
    sliding_chain = kv.groups[SLIDING].find_cached_chain(c)
    assert (len(full_chain), len(sliding_chain)) == (6, 4)
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 4 * bs
    assert [len(h) for h in hits] == [4, 4]
    assert list(hits[FULL]) == full_chain[:4] and list(hits[SLIDING]) == sliding_chain
    assert kv.allocate_slots(c, c.num_tokens - num_hit, hits)
    c.num_computed_tokens = c.num_tokens
    # The sliding group took only the hit blocks inside the window of the first computed token.
    sliding_table = kv.block_table("c", SLIDING)
    assert sliding_table[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    assert kv.prefix_cache_hits == num_hit and kv.prefix_cache_queries == c.num_tokens
    kv.free(c)
    assert_idle(kv)


def test_blocks_released_by_sliding_still_hit():
    bs = 2
    kv = coordinator([40, 40], bs, [None, 4])
    a = make_request("a", range(16))
    for _ in range(4):  # chunks of 4: the sliding group releases blocks as the prefill goes
        assert kv.allocate_slots(a, 4)
        a.num_computed_tokens += 4
    assert kv.block_table("a", SLIDING)[0] == NULL_BLOCK_ID
    kv.free(a)
    c = make_request("c", list(range(16)) + [1])
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 16 and [len(h) for h in hits] == [8, 8]
    assert kv.allocate_slots(c, 1, hits)
    c.num_computed_tokens = c.num_tokens
    kv.free(c)
    assert_idle(kv)


def test_no_leaks_after_finish_abort_and_preemption():
    """A random workload in the scheduler's pattern; every group returns to its total."""
    rng = random.Random(0)
    bs = 4
    kv = coordinator([60, 25], bs, [None, 8])
    running: list[Request] = []
    prefixes = [list(range(20)), list(range(50, 70))]
    for i in range(300):
        if len(running) < 4 and rng.random() < 0.3:
            prompt = rng.choice(prefixes)[: rng.randint(1, 20)] + [rng.randint(0, 300)]
            r = make_request(f"r{i}", prompt)
            hits, num_hit = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, min(r.num_tokens - num_hit, 8), hits):
                r.num_computed_tokens = num_hit
                r._step = min(r.num_tokens - num_hit, 8)
                running.append(r)
            continue
        if not running:
            continue
        r = rng.choice(running)
        action = rng.random()
        if action < 0.1:  # abort or finish
            running.remove(r)
            kv.free(r)
        elif action < 0.15:  # preempted before its step ran
            running.remove(r)
            kv.free(r)
        else:  # the scheduled step runs; schedule the next
            r.num_computed_tokens += r._step
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token(rng.randint(0, 300))
            n = min(r.num_tokens - r.num_computed_tokens, 8)
            if kv.allocate_slots(r, n):
                r._step = n
            else:
                running.remove(r)
                kv.free(r)
    for r in running:
        kv.free(r)
    assert_idle(kv)


class SlowPathCoordinator(KVCacheCoordinator):
    """Plans and commits every group on every call: no headroom, the reference."""

    def allocate_slots(self, request, num_new_tokens, new_computed_blocks=()):
        hits = list(new_computed_blocks) or [()] * len(self.groups)
        for group, blocks in zip(self.groups, hits):
            group.check_hits(request, blocks)
        plans = [g.plan(request, num_new_tokens, b) for g, b in zip(self.groups, hits)]
        if any(plan.num_needed > g.num_free_blocks for g, plan in zip(self.groups, plans)):
            return False
        for group, blocks, plan in zip(self.groups, hits, plans):
            group.commit(request, num_new_tokens, blocks, plan)
        return True


def full_state(kv: KVCacheCoordinator):
    return [
        (
            list(g._pool.free_queue),
            list(g._pool.ref_cnt),
            dict(g._pool.cached),
            {
                rid: (list(s.block_ids), list(s.block_hashes), s.num_released, s.num_hit_blocks)
                for rid, s in g._requests.items()
            },
        )
        for g in kv.groups
    ]


def test_headroom_never_skips_a_needed_allocation():
    """Random schedules with chunked prefill, pending (asynchronously sampled) tokens, prefix
    hits and preemption: the coordinator, which skips steps within a request's headroom,
    ends every call in the same state as one that runs the full allocation every time."""
    for seed, windows, caching in [
        (0, [None, 8], True),
        (1, [None, 5], True),
        (2, [None], True),
        (3, [7, None, 12], False),
        (4, [None, 8], False),
    ]:
        rng = random.Random(seed)
        bs = rng.choice([2, 4])
        sizes = [rng.randint(20, 60) for _ in windows]
        kv = coordinator(sizes, bs, windows, caching)
        ref = coordinator(sizes, bs, windows, caching, cls=SlowPathCoordinator)
        running: list[Request] = []
        prefixes = [list(range(20)), list(range(50, 70))]
        for i in range(600):
            if len(running) < 4 and rng.random() < 0.2:
                prompt = rng.choice(prefixes)[: rng.randint(1, 20)] + [rng.randint(0, 300)]
                r = make_request(f"r{i}", prompt)
                hits, num_hit = kv.get_computed_blocks(r)
                ref_hits, _ = ref.get_computed_blocks(r)
                n = min(r.num_tokens - num_hit, rng.randint(1, 9))
                r.num_computed_tokens = num_hit
                ok = kv.allocate_slots(r, n, hits)
                assert ok == ref.allocate_slots(r, n, ref_hits)
                if ok:
                    r._step = n
                    running.append(r)
                else:
                    r.num_computed_tokens = 0
                assert full_state(kv) == full_state(ref)
                continue
            if not running:
                continue
            r = rng.choice(running)
            action = rng.random()
            if action < 0.08:  # finished, aborted or preempted
                running.remove(r)
                kv.free(r)
                ref.free(r)
            else:  # the scheduled step runs; maybe its token is read; schedule the next
                r.num_computed_tokens += r._step
                if r.num_computed_tokens == r.num_tokens:
                    r.num_pending_tokens += 1
                if r.num_pending_tokens and rng.random() < 0.7:
                    r.num_pending_tokens -= 1
                    r.append_output_token(rng.randint(0, 300))
                n = min(r.num_tokens - r.num_computed_tokens, rng.randint(1, 9))
                if n == 0:
                    r._step = 0
                    continue
                ok = kv.allocate_slots(r, n)
                assert ok == ref.allocate_slots(r, n)
                if ok:
                    r._step = n
                else:
                    running.remove(r)
                    kv.free(r)
                    ref.free(r)
            assert full_state(kv) == full_state(ref)


class InterfaceOnly(CacheManager):
    """Forwards exactly the :class:`CacheManager` interface to a paged manager and records the
    calls: a coordinator reaching past the interface fails with an ``AttributeError``."""

    def __init__(self, inner: CacheManager, calls: Counter) -> None:
        self._inner, self._calls = inner, calls
        self.spec, self.num_blocks = inner.spec, inner.num_blocks

    def _call(self, name, *args):
        self._calls[name] += 1
        return getattr(self._inner, name)(*args)

    @property
    def num_free_blocks(self):
        return self._inner.num_free_blocks

    def find_cached_chain(self, request, hashes=None):
        return self._call("find_cached_chain", request, hashes)

    def check_hits(self, request, hits):
        return self._call("check_hits", request, hits)

    def chunk_end(self, request, start, end):
        return self._call("chunk_end", request, start, end)

    def take_state_copies(self):
        return self._call("take_state_copies")

    def plan(self, request, num_new_tokens, hits):
        return self._call("plan", request, num_new_tokens, hits)

    def commit(self, request, num_new_tokens, hits, plan, chain=()):
        return self._call("commit", request, num_new_tokens, hits, plan, chain)

    def headroom(self, request_id):
        return self._call("headroom", request_id)

    def block_table(self, request_id):
        return self._call("block_table", request_id)

    def block_hashes(self, request_id):
        return self._call("block_hashes", request_id)

    def request_ids(self):
        return self._call("request_ids")

    def free(self, request, chain=()):
        return self._call("free", request, chain)

    def reset_prefix_cache(self):
        return self._call("reset_prefix_cache")

    def check_invariants(self):
        return self._call("check_invariants")


CALLS: Counter = Counter()


class _InterfaceOnlySpec:
    """Put before a spec class: its groups' managers are wrapped in :class:`InterfaceOnly`."""

    def make_manager(self, *args):
        return InterfaceOnly(super().make_manager(*args), CALLS)


class InterfaceOnlyFull(_InterfaceOnlySpec, FullAttentionSpec):
    pass


class InterfaceOnlySliding(_InterfaceOnlySpec, SlidingWindowSpec):
    pass


def test_the_coordinator_uses_managers_only_through_the_interface():
    """A coordinator over managers that expose only the interface behaves, call for call, as
    one over the paged managers themselves."""
    CALLS.clear()
    bs, window, sizes = 4, 8, [40, 20]
    wrapped_specs = [
        InterfaceOnlyFull(bs, torch.float16, 1, 8),
        InterfaceOnlySliding(bs, torch.float16, 1, 8, window),
    ]
    kv = CheckedCoordinator(wrapped_specs, sizes)
    ref = coordinator(sizes, bs, [None, window])
    assert all(isinstance(g, InterfaceOnly) for g in kv.groups)
    assert kv.specs == wrapped_specs

    def observed(c: KVCacheCoordinator, request_ids):
        usage = [(u.group, u.num_blocks, u.num_free_blocks, u.usage) for u in c.group_usage()]
        tables = {rid: [list(t) for t in c.block_tables(rid)] for rid in request_ids}
        counters = (c.prefix_cache_queries, c.prefix_cache_hits, c.num_free_blocks, c.usage)
        return usage, tables, counters

    rng = random.Random(0)
    running: list[Request] = []
    prefixes = [list(range(20)), list(range(50, 70))]
    for i in range(300):
        if len(running) < 4 and rng.random() < 0.3:
            prompt = rng.choice(prefixes)[: rng.randint(1, 20)] + [rng.randint(0, 300)]
            r = make_request(f"r{i}", prompt)
            (hits, num_hit), (ref_hits, ref_num_hit) = (
                kv.get_computed_blocks(r),
                ref.get_computed_blocks(r),
            )
            assert num_hit == ref_num_hit and [len(h) for h in hits] == [len(h) for h in ref_hits]
            n = kv.chunk_end(r, num_hit, min(r.num_tokens - num_hit, 8))
            assert n == ref.chunk_end(r, num_hit, min(r.num_tokens - num_hit, 8))
            r.num_computed_tokens = num_hit
            ok = kv.allocate_slots(r, n, hits)
            assert ok == ref.allocate_slots(r, n, ref_hits)
            if ok:
                r._step = n
                running.append(r)
            else:
                r.num_computed_tokens = 0
        elif running:
            r = rng.choice(running)
            if rng.random() < 0.1:
                running.remove(r)
                kv.free(r)
                ref.free(r)
            else:
                r.num_computed_tokens += r._step
                if r.num_computed_tokens == r.num_tokens:
                    r.append_output_token(rng.randint(0, 300))
                n = min(r.num_tokens - r.num_computed_tokens, 8)
                ok = kv.allocate_slots(r, n)
                assert ok == ref.allocate_slots(r, n)
                if ok:
                    r._step = n
                else:
                    running.remove(r)
                    kv.free(r)
                    ref.free(r)
        assert kv.take_state_copies() == ref.take_state_copies()
        ids = [r.request_id for r in running]
        assert observed(kv, ids) == observed(ref, ids)
    assert not kv.reset_prefix_cache() and running
    for r in running:
        kv.free(r)
        ref.free(r)
    assert kv.reset_prefix_cache() and ref.reset_prefix_cache()
    assert_idle(kv)
    # Every part of the interface was exercised (headroom and commit on every slow step).
    assert set(CALLS) == {
        "find_cached_chain", "check_hits", "plan", "commit", "headroom", "block_table",
        "block_hashes", "request_ids", "free", "reset_prefix_cache", "check_invariants",
        "chunk_end", "take_state_copies",
    }  # fmt: skip

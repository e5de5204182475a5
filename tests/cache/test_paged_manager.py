"""The paged block pool with prefix caching, through the real path: a coordinator of one group."""

from __future__ import annotations

import random
from collections import deque

import pytest

from heron.cache import NULL_BLOCK_ID, KVCacheCoordinator, PagedCacheManager
from heron.engine.request import Request
from heron.sampling_params import SamplingParams

from kv_invariants import InvariantChecked, cache_specs


class CheckedCoordinator(InvariantChecked, KVCacheCoordinator):
    """Checks every invariant after every public operation."""


def one_group(
    num_blocks: int, block_size: int, enable_prefix_caching: bool = True
) -> CheckedCoordinator:
    return CheckedCoordinator(cache_specs(block_size), [num_blocks], enable_prefix_caching)


def lookup(kv: KVCacheCoordinator, request: Request) -> tuple[list[int], int]:
    """The group's hit blocks for ``request`` and the tokens they hold."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    assert hits, "prefix caching is on"
    return hits[0], num_hit_tokens


def needed(kv: KVCacheCoordinator, request: Request, num_new_tokens: int, hit_blocks=()) -> int:
    """By how much ``allocate_slots`` with these arguments would lower ``num_free_blocks``
    (new blocks, plus hits taken off the free queue): the group's plan."""
    return kv.groups[0].plan(request, num_new_tokens, hit_blocks).num_needed


def make_request(request_id: str, tokens, prompt_logprobs: int | None = None) -> Request:
    params = SamplingParams(max_tokens=None, prompt_logprobs=prompt_logprobs)
    return Request(request_id, list(tokens), params)


def prefill(kv: KVCacheCoordinator, request: Request) -> list[int]:
    """Admit ``request`` the way the scheduler does, run its whole prompt, return its hits."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit_tokens
    assert kv.allocate_slots(request, num_new, hits)
    request.num_computed_tokens = request.num_tokens
    return hits[0] if hits else []


def pool(kv: KVCacheCoordinator):
    return kv.groups[0]._pool


def snapshot(kv: KVCacheCoordinator):
    group = kv.groups[0]
    pool = group._pool
    return (
        {rid: (list(s.block_ids), list(s.block_hashes)) for rid, s in group._requests.items()},
        list(pool.ref_cnt),
        list(pool.block_hash),
        dict(pool.cached),
        list(pool.free_queue),
        kv.prefix_cache_queries,
        kv.prefix_cache_hits,
    )


def test_allocation_covers_needed_tokens():
    kv = one_group(10, 4)
    assert kv.num_free_blocks == 9 and kv.usage == 0.0
    req = make_request("a", range(10))
    assert needed(kv, req, 10) == 3
    assert kv.allocate_slots(req, 10)
    table = kv.block_table("a")
    assert len(table) == 3 and NULL_BLOCK_ID not in table
    assert kv.num_free_blocks == 6 and kv.usage == pytest.approx(3 / 9)
    req.num_computed_tokens = 10
    # Growing within the last block needs nothing; crossing into a fourth block needs one.
    assert needed(kv, req, 2) == 0
    assert kv.allocate_slots(req, 2)
    assert len(kv.block_table("a")) == 3
    assert needed(kv, req, 3) == 1
    assert kv.allocate_slots(req, 3)
    assert len(kv.block_table("a")) == 4
    assert kv.block_table("unknown") == []


def test_atomic_failure_changes_nothing():
    kv = one_group(6, 2)
    a = make_request("a", range(6))
    prefill(kv, a)
    b = make_request("b", [9, 9, 9])
    before = snapshot(kv)
    assert needed(kv, b, 5) == 3 > kv.num_free_blocks == 2
    assert not kv.allocate_slots(b, 5)
    assert snapshot(kv) == before
    assert kv.block_table("b") == []

    # Hits on evictable blocks count against the free pool too: after `a` is freed, all 5 blocks
    # are free, but `c` needs 2 hit blocks (evictable) + 4 new ones.
    kv.free(a)
    c = make_request("c", list(range(6)) + [7] * 6)
    hit_blocks, num_hit_tokens = lookup(kv, c)
    assert num_hit_tokens == 6 and len(hit_blocks) == 3
    assert needed(kv, c, 6, hit_blocks) == 6 > kv.num_free_blocks
    before = snapshot(kv)
    assert not kv.allocate_slots(c, 6, [hit_blocks])
    assert snapshot(kv) == before
    # A smaller chunk fits.
    assert needed(kv, c, 2, hit_blocks) == 4
    assert kv.allocate_slots(c, 2, [hit_blocks])
    assert kv.block_table("c")[:3] == hit_blocks
    assert kv.num_free_blocks == 1


def test_free_returns_all_blocks_cached_and_uncached():
    kv = one_group(20, 4)
    a = make_request("a", range(10))
    b = make_request("b", list(range(8)) + [50, 51, 52])  # shares 2 blocks with a
    c = make_request("c", range(100, 103))  # never becomes a full block
    d = make_request("d", range(200, 230))  # aborted mid-prefill
    prefill(kv, a)
    assert prefill(kv, b) == kv.block_table("a")[:2]
    prefill(kv, c)
    assert kv.allocate_slots(d, 12)
    assert kv.usage > 0
    kv.free(d)
    kv.free(a)
    kv.free(c)
    kv.free(c)  # freeing twice (or an unknown id) is a no-op
    kv.free(make_request("never-seen", [1]))
    assert kv.num_free_blocks == 19 - len(kv.block_table("b"))
    kv.free(b)
    assert kv.num_free_blocks == 19 and kv.usage == 0.0


def test_prefix_reuse_two_and_a_half_blocks():
    kv = one_group(20, 4)
    a = make_request("a", range(10))
    assert prefill(kv, a) == []
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    b = make_request("b", list(range(10)) + [77, 78])  # shares a's 2.5 blocks
    hit_blocks, num_hit_tokens = lookup(kv, b)
    assert hit_blocks == kv.block_table("a")[:2] and num_hit_tokens == 8
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (22, 8)
    assert kv.allocate_slots(b, b.num_tokens - num_hit_tokens, [hit_blocks])
    table_b = kv.block_table("b")
    assert table_b[:2] == hit_blocks and len(table_b) == 3
    assert pool(kv).ref_cnt[hit_blocks[0]] == 2 and pool(kv).ref_cnt[table_b[2]] == 1
    # Taking blocks is the allocation's job, not the lookup's: looking up again changes nothing.
    assert lookup(kv, b) == (hit_blocks, 8)


def test_hit_leaves_at_least_one_token_to_compute():
    kv = one_group(20, 4)
    prefill(kv, make_request("a", range(8)))
    b = make_request("b", range(8))  # exactly two full blocks, identical to a
    hit_blocks, num_hit_tokens = lookup(kv, b)
    assert hit_blocks == kv.block_table("a")[:1] and num_hit_tokens == 4
    c = make_request("c", range(9))  # one more token: both blocks can hit
    assert lookup(kv, c) == (kv.block_table("a"), 8)


def test_hash_chain_different_first_block_misses():
    kv = one_group(20, 4)
    prefill(kv, make_request("a", range(12)))
    b = make_request("b", [99, 1, 2, 3] + list(range(4, 12)))  # only block 0 differs
    assert lookup(kv, b) == ([], 0)
    assert kv.prefix_cache_hits == 0


def test_hits_after_free_and_lru_eviction_order():
    kv = one_group(9, 2)  # 8 usable blocks
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    b = make_request("b", [7, 8, 9, 10, 11, 12])
    prefill(kv, a)
    prefill(kv, b)
    a_blocks, b_blocks = list(kv.block_table("a")), list(kv.block_table("b"))
    kv.free(a)
    kv.free(b)
    # Freed but still cached: a's whole prompt hits (a probe one token longer can use all 3).
    probe_a = make_request("pa", [1, 2, 3, 4, 5, 6, 0])
    probe_b = make_request("pb", [7, 8, 9, 10, 11, 12, 0])
    assert lookup(kv, probe_a) == (a_blocks, 6)
    # Queue: 2 never-used blocks, then a's blocks tail first, then b's tail first.
    assert list(pool(kv).free_queue) == [7, 8, *reversed(a_blocks), *reversed(b_blocks)]

    # Each allocation evicts the least recently freed block: never-used ones, then a's tail
    # block, then a's middle one, then a's head; b (freed later) is untouched meanwhile.
    filler = make_request("f", range(100, 116))
    for num_tokens, expected_hit_tokens in zip(range(2, 12, 2), [6, 6, 4, 2, 0], strict=True):
        assert kv.allocate_slots(filler, 2)
        filler.num_computed_tokens = num_tokens
        assert lookup(kv, probe_a)[1] == expected_hit_tokens
        assert lookup(kv, probe_b)[1] == 6
    # Now b's blocks go, tail first: the evicted content is no longer found.
    b_tail_hash = pool(kv).block_hash[b_blocks[2]]
    assert kv.allocate_slots(filler, 2)
    filler.num_computed_tokens = 12
    assert kv.block_table("f")[-1] == b_blocks[2]
    assert b_tail_hash not in pool(kv).cached
    assert lookup(kv, probe_b) == (b_blocks[:2], 4)


def test_hit_revives_a_free_block_out_of_the_queue():
    kv = one_group(9, 2)
    a = make_request("a", [1, 2, 3, 4, 5])
    prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 8
    b = make_request("b", [1, 2, 3, 4, 9, 9])
    hit_blocks = prefill(kv, b)
    assert hit_blocks == kv.block_table("b")[:2]
    assert all(blk not in pool(kv).free_queue for blk in hit_blocks)
    assert kv.num_free_blocks == 5  # 2 revived + 1 new
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_prefix_caching_off_never_hits_or_counts():
    kv = one_group(20, 4, enable_prefix_caching=False)
    prefill(kv, make_request("a", range(12)))
    assert pool(kv).cached == {}
    assert kv.get_computed_blocks(make_request("b", range(12))) == ((), 0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_prompt_logprobs_requests_do_not_hit():
    kv = one_group(20, 4)
    prefill(kv, make_request("a", range(12)))
    queries = kv.prefix_cache_queries
    wants_logprobs = make_request("b", range(12), prompt_logprobs=0)
    assert kv.get_computed_blocks(wants_logprobs) == ((), 0)
    assert kv.prefix_cache_queries == queries and kv.prefix_cache_hits == 0


def test_decode_growth_allocates_at_block_boundaries_and_registers_full_blocks():
    bs = 4
    kv = one_group(20, bs)
    a = make_request("a", range(6))
    prefill(kv, a)
    assert len(kv.block_table("a")) == 2
    a.append_output_token(1000)
    while a.num_tokens < 14:
        # Decode: the table must cover num_computed + 1 tokens; a block is added exactly when
        # that crosses a block boundary.
        table_len = len(kv.block_table("a"))
        expected_new = 1 if a.num_computed_tokens % bs == 0 else 0
        assert needed(kv, a, 1) == expected_new
        assert kv.allocate_slots(a, 1)
        assert (
            len(kv.block_table("a"))
            == table_len + expected_new
            == -(-(a.num_computed_tokens + 1) // bs)
        )
        a.num_computed_tokens += 1
        a.append_output_token(1000 + a.num_tokens)
    # 13 tokens computed: 3 full blocks, the two filled during decode included, are registered.
    assert a.num_computed_tokens == 13
    b = make_request("b", a.all_token_ids)  # prompt == a's prompt + output (14 tokens)
    assert lookup(kv, b) == (kv.block_table("a")[:3], 12)


def test_free_before_the_step_ran_drops_its_registrations():
    # A request preempted in the scheduling pass that allocated it never had its tokens written:
    # its blocks must not stay findable.
    kv = one_group(20, 4)
    a = make_request("a", range(13))
    hit_blocks, _ = lookup(kv, a)
    assert kv.allocate_slots(a, 13, [hit_blocks])
    assert len(pool(kv).cached) == 3  # registered at allocation
    kv.free(a)  # num_computed_tokens never advanced
    assert pool(kv).cached == {}
    assert lookup(kv, make_request("b", range(13))) == ([], 0)

    # Partially computed (chunked prefill, first 8 tokens ran, the next chunk did not): only the
    # blocks past the computed prefix are dropped.
    c = make_request("c", range(13))
    assert kv.allocate_slots(c, 8)
    c.num_computed_tokens = 8
    assert kv.allocate_slots(c, 5)
    assert len(pool(kv).cached) == 3
    kv.free(c)
    assert lookup(kv, make_request("d", range(13)))[1] == 8

    # Hit blocks hold valid content even if the request never ran: they stay.
    e = make_request("e", range(13))
    hit_blocks, num_hit_tokens = lookup(kv, e)
    assert num_hit_tokens == 8
    assert kv.allocate_slots(e, 5, [hit_blocks])
    kv.free(e)
    assert lookup(kv, make_request("f", range(13)))[1] == 8


def test_duplicate_content_keeps_the_first_registration():
    kv = one_group(20, 4)
    a = make_request("a", range(9))
    b = make_request("b", range(9))
    # Both scheduled before either registered (no hit for b): b's copies stay unregistered.
    assert kv.allocate_slots(a, 9) and kv.allocate_slots(b, 9)
    a.num_computed_tokens = b.num_computed_tokens = 9
    a_blocks = list(kv.block_table("a"))
    assert set(pool(kv).cached.values()) == set(a_blocks[:2])
    kv.free(a)
    kv.free(b)
    assert lookup(kv, make_request("p", range(9))) == (a_blocks[:2], 8)


def test_reset_prefix_cache():
    kv = one_group(20, 4)
    a = make_request("a", range(12))
    prefill(kv, a)
    assert not kv.reset_prefix_cache()
    assert len(pool(kv).cached) == 3
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert lookup(kv, make_request("b", range(12))) == ([], 0)
    assert kv.num_free_blocks == 19


def test_misuse_is_rejected():
    kv = one_group(4, 2)
    a = make_request("a", [1, 2, 3])
    prefill(kv, a)
    b = make_request("b", [1, 2, 5])
    hit_blocks, _ = lookup(kv, b)
    assert kv.allocate_slots(b, 1)
    with pytest.raises(ValueError, match="first allocation"):
        kv.allocate_slots(b, 1, [hit_blocks])
    kv.free(a)
    kv.free(b)
    # The hit block is evicted between lookup and allocation.
    c = make_request("c", [1, 2, 9])
    hit_blocks, _ = lookup(kv, c)
    filler = make_request("f", range(6))
    assert kv.allocate_slots(filler, 6)
    kv.free(filler)
    with pytest.raises(ValueError, match="evicted"):
        kv.allocate_slots(c, 1, [hit_blocks])
    with pytest.raises(ValueError, match="num_blocks"):
        PagedCacheManager(cache_specs(4)[0], num_blocks=1)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheCoordinator(cache_specs(4), [1])
    with pytest.raises(ValueError, match="one pool size per cache group"):
        KVCacheCoordinator(cache_specs(4, [None, 8]), [10])
    with pytest.raises(ValueError, match="one block size"):
        KVCacheCoordinator(cache_specs(4) + cache_specs(8), [10, 10])


def test_check_invariants_detects_corruption():
    kv = KVCacheCoordinator(cache_specs(2), [8])
    a = make_request("a", [1, 2, 3])
    assert kv.allocate_slots(a, 3)
    kv.check_invariants()
    pool(kv).ref_cnt[kv.block_table("a")[0]] += 1
    with pytest.raises(RuntimeError, match="ref counts"):
        kv.check_invariants()
    pool(kv).ref_cnt[kv.block_table("a")[0]] -= 1
    pool(kv).free_queue[NULL_BLOCK_ID] = None
    with pytest.raises(RuntimeError, match="free queue"):
        kv.check_invariants()
    del pool(kv).free_queue[NULL_BLOCK_ID]
    pool(kv).cached[12345] = kv.block_table("a")[1]
    with pytest.raises(RuntimeError, match="hash entry"):
        kv.check_invariants()


@pytest.mark.parametrize("seed", range(12))
def test_randomized_scheduler_simulation(seed):
    """Random admissions, chunked prefill, decode, preemption and aborts, like a scheduler.

    A shadow copy of every block's content checks that each prefix hit returns blocks whose KV
    was really written with the same tokens.
    """
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4, 8])
    num_blocks = rng.randint(6, 40)
    max_len = (num_blocks - 1) * bs  # a lone request always fits
    kv = one_group(num_blocks, bs, enable_prefix_caching=rng.random() < 0.85)
    shadow: dict[int, list[int | None]] = {}
    shared_prefixes = [[rng.randrange(4) for _ in range(rng.randint(0, 3 * bs))] for _ in range(3)]
    waiting: deque[Request] = deque()
    running: list[Request] = []
    next_id = 0
    total_hits = 0

    def note_new_blocks(request: Request, first_new: int) -> None:
        for block_id in kv.block_table(request.request_id)[first_new:]:
            shadow[block_id] = [None] * bs  # whatever a reused block held is not this request's

    for _ in range(250):
        if rng.random() < 0.4:
            tail = [rng.randrange(4) for _ in range(rng.randint(1, 3 * bs))]
            prompt = rng.choice(shared_prefixes) + tail
            prompt_logprobs = 0 if rng.random() < 0.1 else None
            waiting.append(make_request(f"r{next_id}", prompt[: max_len - 1], prompt_logprobs))
            next_id += 1

        scheduled: dict[str, tuple[Request, int, int]] = {}  # id -> (request, first pos, count)
        preempted = False
        for request in list(running):
            if request not in running:
                continue  # preempted earlier in this pass
            num_new = min(request.num_tokens - request.num_computed_tokens, rng.randint(1, 2 * bs))
            while True:
                first_new = len(kv.block_table(request.request_id))
                num_needed = needed(kv, request, num_new)
                free_before = kv.num_free_blocks
                if kv.allocate_slots(request, num_new):
                    assert kv.num_free_blocks == free_before - num_needed
                    note_new_blocks(request, first_new)
                    scheduled[request.request_id] = (request, request.num_computed_tokens, num_new)
                    break
                assert num_needed > free_before
                # FCFS preempts the newest request; a priority policy may pick one already
                # scheduled in this pass, whose blocks were then registered but never written.
                victim = running.pop(-1 if rng.random() < 0.5 else rng.randrange(len(running)))
                kv.free(victim)
                victim.num_computed_tokens = 0
                scheduled.pop(victim.request_id, None)
                waiting.appendleft(victim)
                preempted = True
                if victim is request:
                    break

        if scheduled and rng.random() < 0.1:
            # Preempted after its allocation in this pass (a priority policy can do that, with
            # no pressure, so it is readmitted at once and meets its own unwritten blocks).
            victim = rng.choice([r for r, _, _ in scheduled.values()])
            running.remove(victim)
            kv.free(victim)
            victim.num_computed_tokens = 0
            del scheduled[victim.request_id]
            waiting.appendleft(victim)
            preempted = True

        hits_to_verify: list[tuple[Request, list[int]]] = []
        while not preempted and waiting and rng.random() < 0.8:
            request = waiting[0]
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            hit_blocks = hits[0] if hits else []
            assert num_hit_tokens == len(hit_blocks) * bs < request.num_tokens
            num_new = min(request.num_tokens - num_hit_tokens, rng.randint(1, 3 * bs))
            num_needed = needed(kv, request, num_new, hit_blocks)
            free_before = kv.num_free_blocks
            ok = kv.allocate_slots(request, num_new, hits)
            assert ok == (num_needed <= free_before)
            if not ok:
                break
            assert kv.num_free_blocks == free_before - num_needed
            waiting.popleft()
            running.append(request)
            note_new_blocks(request, len(hit_blocks))
            hits_to_verify.append((request, hit_blocks))
            scheduled[request.request_id] = (request, num_hit_tokens, num_new)
            total_hits += len(hit_blocks)

        # Execute: every layer writes the step's KV before any attention reads it.
        for request, first, count in scheduled.values():
            table = kv.block_table(request.request_id)
            assert len(table) * bs >= first + count
            for pos in range(first, first + count):
                shadow[table[pos // bs]][pos % bs] = request.all_token_ids[pos]
        for request, hit_blocks in hits_to_verify:
            for i, block_id in enumerate(hit_blocks):
                assert shadow[block_id] == request.all_token_ids[i * bs : (i + 1) * bs]

        for request, first, count in scheduled.values():
            request.num_computed_tokens = first + count
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token(rng.randrange(4))
                if rng.random() < 0.15 or request.num_tokens >= max_len:
                    kv.free(request)
                    running.remove(request)

        if rng.random() < 0.05 and (running or waiting):
            queue = running if running and (not waiting or rng.random() < 0.5) else waiting
            victim = rng.choice(list(queue))
            queue.remove(victim)
            kv.free(victim)  # a waiting request holds nothing: a no-op

        held = {b for r in running for b in kv.block_table(r.request_id)}
        assert kv.usage == pytest.approx(len(held) / (num_blocks - 1))

    for request in running + list(waiting):
        kv.free(request)
    assert kv.num_free_blocks == num_blocks - 1 and kv.usage == 0.0
    assert kv.prefix_cache_hits <= kv.prefix_cache_queries
    if not kv.enable_prefix_caching:
        assert total_hits == 0 and kv.prefix_cache_queries == 0

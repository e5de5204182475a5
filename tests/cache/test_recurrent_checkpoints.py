"""State checkpoints of a recurrent group: where they are taken, which hits they serve, how
they are copied and evicted, and that nothing leaks (the model-level parity is in
tests/models/test_qwen3_5.py)."""

from __future__ import annotations

import random

import pytest
import torch

from heron.cache import FullAttentionSpec, KVCacheCoordinator
from heron.cache.layout import CacheLayout
from heron.cache.recurrent import NULL_SLOT, RecurrentStateSpec
from heron.engine.request import Request
from heron.sampling_params import SamplingParams

from kv_invariants import InvariantChecked

BS = 4
FULL = FullAttentionSpec(BS, torch.float16, 1, 8)
SPEC = RecurrentStateSpec(
    1, torch.float16, conv_dim=6, conv_kernel=3, num_heads=2, key_dim=2, value_dim=2
)


class CheckedCoordinator(InvariantChecked, KVCacheCoordinator):
    pass


def make_request(request_id: str, tokens) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=None))


def admit(kv: KVCacheCoordinator, request: Request, budget: int) -> bool:
    """The scheduler's admission: lookup, chunk, allocate; ``request._step`` is the chunk."""
    blocks, num_cached = kv.get_computed_blocks(request)
    n = kv.chunk_end(request, num_cached, min(request.num_tokens - num_cached, budget))
    if not kv.allocate_slots(request, n, blocks):
        return False
    request.num_computed_tokens, request._step = num_cached, n
    return True


def test_chunks_end_at_the_last_block_boundary_of_the_known_tokens():
    kv = CheckedCoordinator([SPEC, FULL], [6, 20])
    r = make_request("a", range(10))
    assert kv.chunk_end(r, 0, 10) == 8  # the prompt's last full block
    assert kv.chunk_end(r, 0, 6) == 4 and kv.chunk_end(r, 4, 3) == 3  # no boundary inside
    assert kv.chunk_end(r, 8, 2) == 2
    for token in (5, 6, 7):
        r.append_output_token(token)
    # a preempted request's recomputation: cut where its generated tokens fill a block
    assert kv.chunk_end(r, 8, 5) == 4 and kv.chunk_end(r, 0, 13) == 12
    r.num_pending_tokens = 4  # tokens being sampled are not known: no checkpoint among them
    assert kv.chunk_end(r, 13, 4) == 4
    off = CheckedCoordinator([SPEC, FULL], [6, 20], enable_prefix_caching=False)
    assert off.chunk_end(r, 0, 10) == 10


def test_a_saved_state_serves_later_prompts_not_the_same_pass():
    """The recurrent group is group 0 (as in Qwen3.5), so its checkpoints key by the chain
    the attention group registers in the same allocation."""
    kv = CheckedCoordinator([SPEC, FULL], [6, 20])
    a = make_request("a", range(10))
    assert admit(kv, a, 16) and a._step == 8
    slot_a = kv.block_tables("a")[0][0]
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert kv.get_computed_blocks(b)[1] == 0  # a's state at 8 is saved at the step's end
    (before, after, _, registered, _), (paged_before, paged_after, *_) = kv.take_state_copies()
    assert before == [] and len(after) == 1 and after[0][0] == slot_a
    assert paged_before == paged_after == []
    checkpoint = after[0][1]
    assert registered == [(checkpoint, kv.block_hashes("a")[1])]  # (what a connector saves)
    assert checkpoint not in (NULL_SLOT, slot_a)
    a.num_computed_tokens = 8
    blocks, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8 and blocks[0] == [NULL_SLOT, checkpoint] and len(blocks[1]) == 2
    assert admit(kv, b, 16) and b.num_computed_tokens == 8 and b._step == 3
    slot_b = kv.block_tables("b")[0][0]
    assert kv.take_state_copies()[0][:3] == ([(checkpoint, slot_b)], [], [])
    assert kv.prefix_cache_hits == 2 * 8  # the lookup above and admit's


def test_a_hit_is_the_longest_prefix_both_groups_hold_ending_at_a_checkpoint():
    kv = CheckedCoordinator([SPEC, FULL], [8, 30])
    a = make_request("a", range(17))
    assert admit(kv, a, 8)
    for end in (8, 16):  # chunks of 8 end on blocks: checkpoints at 8 and 16
        kv.take_state_copies()
        a.num_computed_tokens = end
        assert kv.allocate_slots(a, kv.chunk_end(a, end, min(17 - end, 8)))
    kv.take_state_copies()
    a.num_computed_tokens = 17
    kv.free(a)
    b = make_request("b", list(range(13)) + [99, 98])  # attention holds 3 blocks of it
    assert kv.get_computed_blocks(b)[1] == 8
    c = make_request("c", list(range(16)) + [99])
    assert kv.get_computed_blocks(c)[1] == 16


def test_a_request_freed_in_its_pass_saves_nothing():
    kv = CheckedCoordinator([SPEC, FULL], [6, 20])
    a = make_request("a", range(10))
    assert admit(kv, a, 16)
    kv.free(a)  # preempted before its step ran
    assert kv.take_state_copies()[0][:3] == ([], [], [])
    assert kv.groups[0].num_free_blocks == 5
    assert kv.get_computed_blocks(make_request("b", range(10)))[1] == 0


def test_two_recurrent_groups_hit_where_both_hold_a_checkpoint():
    """Group 2's small pool loses a's checkpoint at 8 to f's (its state at 4 was used by f's
    hit since), so the hit is 4 tokens, served in group 0 from its checkpoint at 4 (not the
    head of its one at 8)."""
    other = RecurrentStateSpec(1, torch.float16, 4, 2, 1, 2, 2)
    kv = CheckedCoordinator([SPEC, FULL, other], [8, 30, 4])
    a = make_request("a", range(13))
    assert admit(kv, a, 4)
    (_, [(_, at_4)], *_), _, _ = kv.take_state_copies()
    a.num_computed_tokens = 4
    assert kv.allocate_slots(a, 4)
    kv.take_state_copies()
    a.num_computed_tokens = 8
    kv.free(a)
    f = make_request("f", list(range(6)) + [90, 91, 92, 93])
    assert admit(kv, f, 4) and f.num_computed_tokens == 4
    kv.take_state_copies()
    blocks, num_cached = kv.get_computed_blocks(make_request("b", range(13)))
    assert num_cached == 4 and blocks[0] == [at_4] and len(blocks[1]) == len(blocks[2]) == 1


def test_checkpoints_yield_to_slots_least_recently_used_first():
    kv = CheckedCoordinator([SPEC, FULL], [4, 40])  # 3 entries for slots and checkpoints
    a, b = make_request("a", range(9)), make_request("b", range(100, 109))
    for r in (a, b):
        assert admit(kv, r, 16)
        kv.take_state_copies()
        r.num_computed_tokens = 8
        kv.free(r)
    assert kv.groups[0].num_free_blocks == 3  # two checkpoints, evictable
    c = make_request("c", range(200, 205))
    assert admit(kv, c, 16)
    kv.take_state_copies()
    assert kv.get_computed_blocks(make_request("a2", range(9)))[1] == 0  # a's: the oldest
    assert kv.get_computed_blocks(make_request("b3", range(100, 110)))[1] == 8
    d = make_request("d", range(300, 310))
    assert admit(kv, d, 16) and len(kv.take_state_copies()[0][1]) == 1
    # With no entry left beside its slot, a step still runs, its save skipped.
    f = make_request("f", range(400, 410))
    assert admit(kv, f, 16) and kv.take_state_copies()[0][:3] == ([], [], [])
    assert not kv.allocate_slots(make_request("g", range(3)), 3)


def test_a_hit_on_the_last_free_entry_takes_it_as_its_slot():
    kv = CheckedCoordinator([SPEC, FULL], [3, 40])
    a = make_request("a", range(9))
    assert admit(kv, a, 16)
    (_, [(_, checkpoint)], *_), _ = kv.take_state_copies()
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 1)
    kv.take_state_copies()
    b = make_request("b", range(10))
    assert admit(kv, b, 16) and b.num_computed_tokens == 8
    assert kv.block_tables("b")[0] == [checkpoint]  # the state is already in place: no copy
    assert kv.take_state_copies()[0][:3] == ([], [], [])


def test_entry_copies_read_every_source_before_writing():
    class Owner:
        layer_name, cache_spec = "g", SPEC

        def bind_cache(self, cache):
            self.cache = cache

    owner = Owner()
    layout = CacheLayout([owner])
    layout.allocate([4], torch.device("cpu"))
    conv, state = owner.cache
    for i in range(4):
        conv[i], state[i] = i, 10 * i
    layout.copy_entries(0, [1, 2], [2, 3])
    assert conv[:, 0, 0].tolist() == [0, 1, 1, 2] and state[:, 0, 0, 0].tolist() == [0, 10, 10, 20]
    paged = CacheLayout([type("P", (Owner,), {"cache_spec": FULL})()])
    paged.allocate([4], torch.device("cpu"))
    with pytest.raises(ValueError, match="no entry copies"):
        paged.copy_entries(0, [1], [2])


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", range(2))
def test_no_leaks_with_shared_prefixes_finish_abort_and_preemption(seed, prefix_caching):
    """A random workload in the scheduler's pattern over a few shared prefixes: hits happen
    (with prefix caching), every pass is sealed, and both groups return to their totals."""
    rng = random.Random(seed)
    kv = CheckedCoordinator([SPEC, FULL], [5, 30], enable_prefix_caching=prefix_caching)
    prefixes = [[rng.randint(0, 300) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    running: list[Request] = []
    for i in range(300):
        if len(running) < 4 and rng.random() < 0.3:
            tail = [rng.randint(0, 300) for _ in range(rng.randint(1, 6))]
            r = make_request(f"r{i}", rng.choice(prefixes) + tail)
            if admit(kv, r, 8):
                running.append(r)
        elif running:
            r = rng.choice(running)
            if rng.random() < 0.15:  # finished, aborted, or preempted before its step ran
                running.remove(r)
                kv.free(r)
            else:
                r.num_computed_tokens += r._step
                if r.num_computed_tokens == r.num_tokens:
                    r.append_output_token(rng.randint(0, 300))
                n = r.num_tokens - r.num_computed_tokens
                n = kv.chunk_end(r, r.num_computed_tokens, min(n, 8))
                if kv.allocate_slots(r, n):
                    r._step = n
                else:  # preempted: its blocks and its slot go back
                    running.remove(r)
                    kv.free(r)
                    r.num_computed_tokens = 0
        kv.take_state_copies()
    for r in running:
        kv.free(r)
    assert (kv.prefix_cache_hits > 0) == prefix_caching
    for group in kv.groups:
        assert group.num_free_blocks == group.num_blocks - 1
    assert kv.usage == 0.0 and kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("x", prefixes[0] + [1]))[1] == 0


def decoded(kv: KVCacheCoordinator, prompt_len: int, num_tokens: int, pending: bool = False):
    """A request of ``prompt_len`` tokens prefilled (chunks ending on blocks), then decoded one
    token a step until ``num_tokens`` are computed; every pass sealed. ``pending``: as with
    asynchronous scheduling, each step's input token is still being sampled when it is
    scheduled (it is known a step later)."""
    r = make_request("r", range(prompt_len))
    assert admit(kv, r, 16)
    kv.take_state_copies()
    while r.num_computed_tokens + r._step < num_tokens:
        r.num_computed_tokens += r._step
        if r.num_computed_tokens == r.num_tokens:
            r.num_pending_tokens = 1 if pending else 0
            if not pending:
                r.append_output_token(1000 + r.num_tokens)
        n = kv.chunk_end(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n)
        r._step = n
        kv.take_state_copies()
        if pending and r.num_computed_tokens >= prompt_len:  # the previous step is read
            r.num_pending_tokens = 0
            r.append_output_token(1000 + r.num_tokens)
    r.num_computed_tokens += r._step
    return r


def hit(kv: KVCacheCoordinator, tokens: list[int], length: int) -> int:
    """The cached prefix of a request whose first ``length`` tokens are ``tokens``'."""
    return kv.get_computed_blocks(make_request("probe", tokens[:length] + [-1]))[1]


@pytest.mark.parametrize(
    "interval, kept",
    [(0, [8, 8, 8, 24]), (2, [8, 16, 16, 24]), (1, [12, 16, 20, 24]), (-1, [8, 8, 8, 8])],
)
def test_decode_keeps_the_latest_boundary_and_every_intervalth(interval, kept):
    """Generated tokens are checkpointed at every boundary; the interval's grid stays, the
    rest only until the request's next checkpoint (the prompt's stays: 8 of its 10); -1 takes
    none."""
    kv = CheckedCoordinator([SPEC, FULL], [20, 60], decode_checkpoint_interval=interval)
    r = decoded(kv, 10, 25)
    tokens = r.all_token_ids
    assert [hit(kv, tokens, b) for b in (12, 16, 20, 24)] == kept
    kv.free(r)  # finished: its checkpoints stay, as its blocks do
    assert [hit(kv, tokens, b) for b in (12, 16, 20, 24)] == kept
    assert kv.groups[0].num_free_blocks == 19


def test_a_boundary_whose_token_is_being_sampled_is_findable_once_known():
    kv = CheckedCoordinator([SPEC, FULL], [20, 60], decode_checkpoint_interval=0)
    r = decoded(kv, 10, 12, pending=True)  # the step ending at 12 ran with token 11 pending
    assert r.num_computed_tokens == 12 and len(r.all_token_ids) == 12
    assert hit(kv, r.all_token_ids, 12) == 8  # saved, not findable: its hash was unknown
    r.num_pending_tokens = 1
    assert kv.allocate_slots(r, 1)  # the next step: the chain now has the block
    assert hit(kv, r.all_token_ids, 12) == 12
    kv.take_state_copies()
    r.num_computed_tokens, r.num_pending_tokens = 13, 0
    kv.free(r)
    # finishing right on a boundary whose token was pending: confirmed when freed
    s = decoded(kv, 9, 16, pending=True)
    assert hit(kv, s.all_token_ids, 16) == 8
    kv.free(s)
    assert hit(kv, s.all_token_ids, 16) == 16
    assert kv.groups[0].num_free_blocks == 19


def verify(kv: KVCacheCoordinator, r: Request, num_proposed: int):
    """Schedule a verification step of ``r``'s last token and ``num_proposed`` proposals;
    returns the recurrent group's copies."""
    assert kv.allocate_slots(r, 1 + num_proposed)
    copies = kv.take_state_copies()[0]
    r.num_computed_tokens += 1 + num_proposed
    return copies


def test_a_verification_saves_the_boundaries_its_tokens_cross_once_accepted():
    kv = CheckedCoordinator([SPEC, FULL], [20, 60], decode_checkpoint_interval=1)
    r = decoded(kv, 10, 10)
    r.append_output_token(500)  # 11 tokens, 10 computed
    free = kv.groups[0].num_free_blocks
    # tokens 10..15: boundary 12 after its token 1 (kept by the verification), 16 at its end
    copies = verify(kv, r, 5)
    (slot,) = kv.block_tables("r")[0]
    (_, _, at_12), (_, at_16) = copies.verified[0], copies.after[0]
    assert copies.verified == [("r", 1, at_12)] and copies.after == [(slot, at_16)]
    assert kv.groups[0].num_free_blocks == free - 2
    # one proposal accepted (token 11), four refused: 12 stays unfindable until known, 16 goes
    r.num_computed_tokens -= 4
    kv.truncate(r, r.num_computed_tokens)
    assert kv.groups[0].num_free_blocks == free - 1
    r.append_output_token(501)
    r.append_output_token(502)
    assert hit(kv, r.all_token_ids, 12) == 8
    assert kv.allocate_slots(r, 1)  # the next step: the chain has the block of 8..12
    assert hit(kv, r.all_token_ids, 12) == 12
    kv.take_state_copies()


def test_a_refused_proposal_across_a_boundary_leaves_no_checkpoint():
    kv = CheckedCoordinator([SPEC, FULL], [20, 60], decode_checkpoint_interval=1)
    r = decoded(kv, 10, 10)
    r.append_output_token(500)
    free = kv.groups[0].num_free_blocks
    assert len(verify(kv, r, 3).verified) == 1  # boundary 12 after its first proposal
    r.num_computed_tokens -= 3  # all refused
    kv.truncate(r, r.num_computed_tokens)
    assert kv.groups[0].num_free_blocks == free
    r.append_output_token(600)  # the token sampled instead
    r.append_output_token(601)
    assert kv.allocate_slots(r, 1) and hit(kv, r.all_token_ids, 12) == 8
    kv.take_state_copies()


@pytest.mark.parametrize("seed", range(3))
def test_no_leaks_through_decode_verification_pending_tokens_and_preemption(seed):
    """Requests over shared prefixes decode (their input token pending at random), verify
    proposals that are refused at random, finish, abort and are preempted; every pass sealed;
    both groups return to their totals."""
    rng = random.Random(seed)
    kv = CheckedCoordinator([SPEC, FULL], [7, 40], decode_checkpoint_interval=rng.randint(0, 2))
    prefixes = [[rng.randint(0, 300) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    running: list[Request] = []
    verified = 0  # checkpoints planned at a verification's boundaries
    for i in range(400):
        if len(running) < 4 and rng.random() < 0.3:
            r = make_request(f"r{i}", rng.choice(prefixes) + [rng.randint(0, 300)])
            if admit(kv, r, 8):
                r._proposed = 0
                running.append(r)
        elif running:
            r = rng.choice(running)
            r.num_computed_tokens += r._step
            r.num_pending_tokens = 0
            if r._proposed:  # a verification step: some refused
                refused = rng.randint(0, r._proposed)
                r.num_computed_tokens -= refused
                kv.truncate(r, r.num_computed_tokens)
                for _ in range(r._proposed - refused):
                    r.append_output_token(rng.randint(0, 300))
            if rng.random() < 0.1:
                running.remove(r)
                kv.free(r)
                continue
            if r.num_computed_tokens == r.num_tokens:
                if rng.random() < 0.5:
                    r.append_output_token(rng.randint(0, 300))
                else:
                    r.num_pending_tokens = 1
            n = kv.chunk_end(r, r.num_computed_tokens, min(r.num_tokens - r.num_computed_tokens, 8))
            r._proposed = rng.randint(1, 5) if n == 1 and not r.num_pending_tokens else 0
            if r._proposed and rng.random() < 0.5:
                r._proposed = 0
            if kv.allocate_slots(r, n + r._proposed):
                r._step = n + r._proposed
            else:
                running.remove(r)
                kv.free(r)
                r.num_computed_tokens, r.num_pending_tokens = 0, 0
        verified += len(kv.take_state_copies()[0].verified)
    for r in running:
        kv.free(r)
    assert kv.prefix_cache_hits > 0 and verified > 0
    for group in kv.groups:
        assert group.num_free_blocks == group.num_blocks - 1
    assert kv.reset_prefix_cache()


def test_a_turn_resumes_in_the_entry_its_previous_answer_left():
    """A hit on a request's latest checkpoint of generated tokens takes that entry as its
    slot where the prompt reaches the next boundary (no copy: the conversation goes on from
    it); one on a prompt's is copied, and stays for other prompts sharing it."""
    kv = CheckedCoordinator([SPEC, FULL], [20, 60], decode_checkpoint_interval=0)
    r = decoded(kv, 10, 25)
    kv.free(r)
    # a prompt short of the next boundary saves no state there: the checkpoint is copied
    short = make_request("short", r.all_token_ids[:25] + [9])
    assert admit(kv, short, 16) and short.num_computed_tokens == 24
    assert len(kv.take_state_copies()[0].before) == 1
    kv.free(short)
    turn = make_request("turn", r.all_token_ids[:25] + [7, 7, 7])
    blocks, num_cached = kv.get_computed_blocks(turn)
    assert num_cached == 24 and admit(kv, turn, 16)
    assert kv.block_tables("turn")[0] == blocks[0][-1:]
    assert kv.take_state_copies()[0].before == []
    assert hit(kv, turn.all_token_ids, 24) == 8  # consumed: the turn's own state now
    other = make_request("other", r.all_token_ids[:8] + [5, 5, 5])
    blocks, num_cached = kv.get_computed_blocks(other)
    assert num_cached == 8 and admit(kv, other, 16)
    (slot,) = kv.block_tables("other")[0]
    assert kv.take_state_copies()[0].before == [(blocks[0][-1], slot)]
    assert hit(kv, other.all_token_ids, 8) == 8

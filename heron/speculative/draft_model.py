"""Draft-model proposals: a smaller model with the target's tokenizer decodes greedily ahead of
the target, through a runner, a plan and caches of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from heron.cache.block_pool import ROOT_HASH
from heron.cache.coordinator import KVCacheCoordinator
from heron.cache.layout import CacheLayout
from heron.cache.paged import PagedSpec
from heron.config import ModelConfig, SpeculativeConfig, lacks_tokenizer
from heron.distributed.executor import RunnerArgs, make_model_runner
from heron.execution.launched import LaunchedStep
from heron.execution.model_runner import ModelRunner
from heron.execution.sampler import to_device
from heron.execution.step_plan import DeviceDrafts, NewRequest, Rollback, SentTables, StepPlan
from heron.loader.resolve import resolve_model_path
from heron.platforms import Platform
from heron.sampling_params import SamplingParams
from heron.speculative.proposer import Proposer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from heron.engine.request import Request

GREEDY = SamplingParams(temperature=0.0)


def load_draft_runner(
    spec: SpeculativeConfig,
    target: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    platform: Platform,
    block_size: int,
    attention_backend: str,
    dtype: str,
    kv_cache_dtype: str,
) -> ModelRunner:
    """The draft's runner, on the target's (first) device, context length, seed and load
    format; ``ValueError`` naming ``model`` if it cannot be loaded or does not share the
    target's vocabulary."""
    try:
        path = resolve_model_path(spec.model)
        config = ModelConfig.from_path(
            path,
            dtype,
            platform.device,
            target.max_model_len,
            target.load_format,
            target.seed,
            kv_cache_dtype=kv_cache_dtype,
        )
        runner = make_model_runner(
            1, RunnerArgs(config, block_size, attention_backend, target.seed), platform
        )
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config: model {spec.model!r} cannot be loaded: {e}") from e
    _check_vocabulary(spec.model, path, config, target, tokenizer)
    for cache in runner.cache_specs:
        if not isinstance(cache, PagedSpec):
            raise ValueError(
                f"speculative_config: model {spec.model!r} has a cache of kind "
                f"{cache.describe()}, whose draft tokens cannot be rolled back (a draft model "
                "needs paged attention caches only)"
            )
    return runner


def _check_vocabulary(
    name: str,
    path,
    draft: ModelConfig,
    target: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """The draft's token ids must mean the target's: the same vocabulary size and, where the
    draft ships a tokenizer, the same vocabulary."""
    from transformers import AutoTokenizer

    mismatch = None
    if draft.vocab_size != target.vocab_size:
        mismatch = f"vocabulary sizes differ ({draft.vocab_size} and {target.vocab_size})"
    elif not lacks_tokenizer(path):
        if AutoTokenizer.from_pretrained(path).get_vocab() != tokenizer.get_vocab():
            mismatch = "their tokenizers' vocabularies differ"
    if mismatch:
        raise ValueError(
            f"speculative_config: the draft model {name!r} and the target model "
            f"{str(target.path)!r} must share one tokenizer: {mismatch}"
        )


def split_kv_budget(
    budget: int, target: CacheLayout, draft: CacheLayout, max_model_len: int, max_tokens: int
) -> tuple[int, int]:
    """The target's and the draft's shares of ``budget`` bytes, in proportion to what a
    max-length sequence takes in each, so both pools hold the same number of sequences."""

    def bytes_per_seq(layout: CacheLayout) -> int:
        per_seq = layout.blocks_per_seq(max_model_len, max_tokens)
        return sum(b * n for b, n in zip(layout.bytes_per_block(), per_seq))

    t, d = bytes_per_seq(target), bytes_per_seq(draft)
    draft_share = budget * d // (t + d)
    return budget - draft_share, draft_share


class _DraftSequence:
    """What the draft's cache holds of one request; the cache coordinator reads it as it reads
    a request. ``all_token_ids`` is the request's own (accepted) list, so only accepted tokens
    are hashed; ``num_synced`` tokens are known to be accepted ones (those of the last pass's
    catch-up), the rest of ``num_computed_tokens`` are draft tokens of that pass."""

    __slots__ = (
        "request_id",
        "all_token_ids",
        "num_computed_tokens",
        "num_synced",
        "ingested",
    )
    wants_prompt_logprobs = False
    shift = 0  # the request's tokens this sequence's first one comes after
    prefix_root = ROOT_HASH  # (a draft runs no LoRA adapter)

    def block_extras(self, start: int, end: int) -> tuple[str, ...]:
        return ()  # (a draft reads no images)

    def __init__(self, request: Request) -> None:
        self.request_id = request.request_id
        self.all_token_ids = request.all_token_ids
        self.num_computed_tokens = 0
        self.num_synced = 0
        # The verification step whose block of this request (its row there) the last pass
        # ingested after ``num_synced``, and the block's tokens; None: it ingested none.
        self.ingested: tuple[LaunchedStep, int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer(Proposer):
    """Each pass, for the requests that propose: the draft catches up on the tokens it does
    not hold (the prompt, then those accepted since its last pass; chunks batched within the
    token budget), which samples the first proposal, then runs ``limit`` decode steps, each
    fed the previous step's token on the device and all read at the end. The last step only
    caches the last proposal, so that after full acceptance, as after a refusal, the next
    catch-up is one token: steady-state passes are decode steps (graph replays).

    The proposals stay on the device (each step's tokens are gathered as it is launched), so
    the target's verification step is launched with no read in between; the draft's runner
    reads its steps at the start of the next pass. It keeps each request's tokens (its
    proposals after the accepted ones); the next pass keeps the prefix they share with the
    request's, frees the blocks past it, and writes the request's tokens in.

    A pass may run while the target's verification of the last proposals is still on the
    device (``verifying``): a request with a row there ingests that row's emitted block, one
    step over all its positions from the device (the accepted tokens and the one after them;
    a refused position is overwritten by a later step), takes its first proposal at the
    accepted index, and its decode steps are moved back by the refusals on the device. The
    next pass then keeps the block's accepted tokens, as the request has them by then.
    """

    proposes_on_device = True
    # Whether a pass ends with a decode step of its last proposal (a subclass whose drafted
    # positions are never kept skips it).
    caches_last_proposal = True

    def __init__(
        self,
        runner: ModelRunner,
        kv_cache: KVCacheCoordinator,
        num_tokens: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.runner = runner
        self.kv_cache = kv_cache
        self.num_tokens = num_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self._sequences: dict[str, _DraftSequence] = {}
        self._sent = SentTables()
        self._forgotten: list[str] = []  # for the next plan's finished_ids
        self._unread: list[LaunchedStep] = []  # the last pass's steps
        runner.chain_decode_steps(num_tokens)

    def propose(
        self,
        requests: Sequence[Request],
        limits: Sequence[int],
        verifying: LaunchedStep | None = None,
    ) -> DeviceDrafts:
        for step in self._unread:
            step.result()  # (the target's verification, read since, waited for them)
        self._unread = []
        verifying = self._blocks_to_ingest(requests, verifying)
        block = None if verifying is None else verifying.emitted
        block_rows = {} if block is None else block.rows
        rows: list[tuple[int, _DraftSequence, int]] = []  # (index, sequence, limit)
        ingesting: dict[str, int] = {}  # request id -> the tokens of its verified block
        new_requests = []
        for i, (request, limit) in enumerate(zip(requests, limits)):
            row = block_rows.get(request.request_id)
            ingest = 0 if row is None else block.counts[row]
            seq = self._sequences.get(request.request_id)
            if seq is None:
                seq = self._new_sequence(request)
                hits, num_hit = self.kv_cache.get_computed_blocks(seq)
            else:
                self._sync(seq, bool(ingest))
                hits, num_hit = (), 0
            steps = limit - 1 + self.caches_last_proposal  # decode steps after the catch-up
            num_new = seq.num_tokens - seq.num_computed_tokens - num_hit + ingest + steps
            if not self.kv_cache.allocate_slots(seq, num_new, hits):
                continue  # no room in the draft's pool: no proposals this pass
            if ingest:
                ingesting[request.request_id] = ingest
            if request.request_id not in self._sequences:
                self._sequences[request.request_id] = seq
                seq.num_computed_tokens = num_hit
                new_requests.append(
                    NewRequest(
                        request.request_id,
                        list(seq.all_token_ids),
                        request.num_prompt_tokens - seq.shift,
                        GREEDY,
                        None,
                    )
                )
            rows.append((i, seq, limit))
        counts = [0] * len(requests)
        for i, _, limit in rows:
            counts[i] = limit
        width = max(limits, default=0)
        drafts = DeviceDrafts(
            [r.request_id for r in requests],
            counts,
            torch.zeros((len(requests), width), dtype=torch.int64, device=self.runner.device),
        )
        if not rows:
            return drafts
        plan = self._first_plan(new_requests)
        sequences = [seq for _, seq, _ in rows]
        launched = self._catch_up(sequences, plan, drafts, ingesting)
        rollback = None
        if ingesting:
            rollback = verifying.rollback
            plan = StepPlan() if launched else plan
            launched.append(self._ingest(sequences, ingesting, plan, verifying))
            _gather(drafts, launched[-1], 0)
        extra = self.caches_last_proposal
        for s in range(1, max(limit for _, _, limit in rows) + extra):
            decoding = [seq for _, seq, limit in rows if limit - 1 + extra >= s]
            plan = StepPlan(
                request_ids=[seq.request_id for seq in decoding],
                num_computed=[seq.num_computed_tokens for seq in decoding],
                num_new=[1] * len(decoding),
                samples=[True] * len(decoding),
            )
            # Each row's input is its previous proposal: the last step's own tokens where it
            # ran exactly these rows (the runner then advances that step on the device, its
            # rows already moved back), else the column the pass gathered.
            last = launched[-1].next_decode
            if last is not None and last.request_ids == plan.request_ids:
                launched.append(self._launch(plan, launched[-1]))
            else:
                launched.append(self._launch(plan, _ProposalColumn(drafts, s - 1), rollback))
            _gather(drafts, launched[-1], s)
            for seq in decoding:
                seq.num_computed_tokens += 1
        self._unread = launched
        self._end_pass([seq for _, seq, _ in rows])
        return drafts

    def _blocks_to_ingest(
        self, requests: Sequence[Request], verifying: LaunchedStep | None
    ) -> LaunchedStep | None:
        """Whose emitted blocks the pass ingests: the verification it runs past (a subclass
        may make blocks of its own)."""
        return verifying

    def _new_sequence(self, request: Request) -> _DraftSequence:
        return _DraftSequence(request)

    def _launch(
        self,
        plan: StepPlan,
        previous: LaunchedStep | _ProposalColumn | None = None,
        rollback: Rollback | None = None,
        block: DeviceDrafts | None = None,
    ) -> LaunchedStep:
        """One step of the draft's runner (a subclass adds its inputs); ``block``: the
        verified blocks its ``device_inputs`` rows ingest."""
        return self.runner.launch(plan, previous, block, rollback)

    def _ingest(
        self,
        sequences: list[_DraftSequence],
        ingesting: dict[str, int],
        plan: StepPlan,
        verifying: LaunchedStep,
    ) -> LaunchedStep:
        """One step over the verified blocks of the ``ingesting`` sequences, each at the
        sequence's end (the catch-up brought it to the request's last read token); a row's
        token is the first proposal after its accepted tokens."""
        rows = verifying.rows
        for seq in sequences:
            count = ingesting.get(seq.request_id)
            if count is None:
                continue
            plan.request_ids.append(seq.request_id)
            plan.num_computed.append(seq.num_computed_tokens)
            plan.num_new.append(count)
            plan.samples.append(True)
            plan.device_inputs[seq.request_id] = count
            self._took_block(seq, verifying, rows[seq.request_id], count)
        return self._launch(plan, None, verifying.rollback, verifying.emitted)

    def _took_block(
        self, seq: _DraftSequence, verifying: LaunchedStep, row: int, count: int
    ) -> None:
        """``seq`` ingests the ``count`` tokens of ``verifying``'s row ``row``, whose accepted
        ones the host learns when the verification is read (``_place_proposals``): until then
        the sequence counts them all as computed."""
        seq.num_synced = seq.num_computed_tokens
        seq.ingested = (verifying, row, count)
        seq.num_computed_tokens += count

    def _end_pass(self, sequences: list[_DraftSequence]) -> None:
        """After a pass's proposals were read (a subclass may cut its caches back)."""

    def _first_plan(self, new_requests: list[NewRequest]) -> StepPlan:
        """The pass's first plan, with what changed for the draft's runner since the last."""
        plan = StepPlan(finished_ids=self._forgotten, new_requests=new_requests)
        self._forgotten = []
        changed = self.kv_cache.changed_tables
        for request_id in changed:
            if request_id in self._sequences:
                plan.table_updates.extend(
                    self._sent.updates(request_id, self.kv_cache.block_tables(request_id))
                )
        changed.clear()
        return plan

    def _catch_up(
        self,
        sequences: list[_DraftSequence],
        plan: StepPlan,
        drafts: DeviceDrafts,
        ingesting: dict[str, int],
    ) -> list[LaunchedStep]:
        """Steps computing each sequence's missing tokens, within the token budget (the one
        that ends a sequence's gives its first proposal, unless it then ingests a verified
        block); every step but the last is read at once (the decode steps take their tokens
        from the last)."""
        launched = []
        pending = [seq for seq in sequences if seq.num_tokens > seq.num_computed_tokens]
        while pending:
            budget = self.max_num_batched_tokens
            for seq in pending:
                if budget == 0:
                    break
                remaining = seq.num_tokens - seq.num_computed_tokens
                num_new = min(remaining, budget)
                plan.request_ids.append(seq.request_id)
                plan.num_computed.append(seq.num_computed_tokens)
                plan.num_new.append(num_new)
                plan.samples.append(num_new == remaining and seq.request_id not in ingesting)
                budget -= num_new
            for seq, num_new in zip(pending, plan.num_new):
                seq.num_computed_tokens += num_new
                seq.num_synced = seq.num_computed_tokens
            pending = [seq for seq in pending if seq.num_computed_tokens < seq.num_tokens]
            launched.append(self._launch(plan))
            _gather(drafts, launched[-1], 0)
            if pending:
                launched[-1].result()
                plan = StepPlan()
        return launched

    def _sync(self, seq: _DraftSequence, ingests: bool) -> None:
        """Keep the draft tokens of the last pass that the request accepted (refused or
        unverified ones go, with their blocks), then give the runner the request's tokens.
        Unless this pass ingests a verified block, the last token is computed again (its
        logits give the first proposal)."""
        drafted = self.runner.requests[seq.request_id].all_token_ids
        tokens = seq.all_token_ids
        valid = seq.num_synced
        if seq.ingested is not None:
            self._place_proposals(seq, drafted)
            valid = seq.num_synced
        end = min(seq.num_computed_tokens, len(tokens))
        valid = min(valid, end)
        while valid < end and drafted[valid] == tokens[valid]:
            valid += 1
        if not ingests:
            valid = min(valid, len(tokens) - 1)
        if valid < seq.num_computed_tokens:
            self._truncate(seq, valid)
        seq.num_synced = valid
        drafted[valid:] = tokens[valid:]

    def _place_proposals(self, seq: _DraftSequence, drafted: list[int]) -> None:
        """After a pass that ingested a verified block (read since): the block's accepted
        tokens and the one after them are the request's, the draft's proposals follow them,
        and its computed tokens lose the block's refused ones (its steps were moved back)."""
        verifying, row, count = seq.ingested
        seq.ingested = None
        accepted = verifying.result().num_accepted[row]
        start = seq.num_synced
        drafted[:] = seq.all_token_ids[: start + accepted + 1] + drafted[start:]
        seq.num_synced = start + accepted + 1
        seq.num_computed_tokens -= count - 1 - accepted

    def _truncate(self, seq: _DraftSequence, num_tokens: int) -> None:
        self.kv_cache.truncate(seq, num_tokens)
        seq.num_computed_tokens = num_tokens
        self._sent.shrink(seq.request_id, self.kv_cache.block_tables(seq.request_id))

    def reject(self, request: Request) -> None:
        # (a pass run past the verification is rolled back by the next: _place_proposals)
        seq = self._sequences.get(request.request_id)
        if seq is None or seq.ingested is not None:
            return
        if seq.num_computed_tokens > request.num_computed_tokens:
            self._truncate(seq, request.num_computed_tokens)

    def settle(self) -> None:
        for step in self._unread:
            step.result()
        self._unread = []
        self.runner.launch(self._first_plan([]))  # (drops the forgotten requests' rows)

    def forget(self, request_id: str) -> None:
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return
        # Blocks past the accepted tokens hold no KV anyone may look up.
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_synced)
        self.kv_cache.free(seq)
        self._sent.forget(request_id)
        self._forgotten.append(request_id)


class _ProposalColumn:
    """Proposal ``column`` of a pass's rows, as the pending input of its next decode step
    (what ``ModelRunner.launch`` reads of a previous step: each request's row and the
    tokens)."""

    rollback = next_decode = None

    def __init__(self, drafts: DeviceDrafts, column: int) -> None:
        self.rows = drafts.rows
        self.token_ids = drafts.tokens[:, column]


def _gather(drafts: DeviceDrafts, step: LaunchedStep, column: int) -> None:
    """The step's sampled tokens become proposal ``column`` of their requests' rows (those
    that want that many), on the device and at once: a graph's outputs are overwritten by
    its next replay."""
    rows, counts = drafts.rows, drafts.counts
    pairs = [
        (j, rows[state.request_id])
        for j, state in enumerate(step.sample_states)
        if counts[rows[state.request_id]] > column
    ]
    if not pairs:
        return
    if all(j == row for j, row in pairs) and len(pairs) == len(step.sample_states):
        # every row in its own place (most decode steps): one copy, no index upload
        drafts.tokens[: len(pairs), column] = step.token_ids
        return
    index = to_device(pairs, drafts.tokens.device)
    drafts.tokens[index[:, 1], column] = step.token_ids[index[:, 0]].to(torch.int64)

"""Builds what an engine runs from a resolved config: the runners (target, and a draft model
or MTP head), the split of the KV budget, the captured graphs, the cache coordinators, the
proposer and the scheduler."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from heron.cache.coordinator import KVCacheCoordinator
from heron.cache.paged import FullAttentionSpec, PagedSpec
from heron.cache.recurrent import RecurrentStateSpec
from heron.config import SpeculativeConfig
from heron.distributed.executor import RunnerArgs, TensorParallelRunner, make_model_runner
from heron.engine.resolved_config import ResolvedConfig
from heron.engine.scheduler import Scheduler, SchedulerConfig
from heron.execution.model_runner import ModelRunner
from heron.kv_transfer import make_connector
from heron.multimodal.architectures import images_attend_whole
from heron.speculative import NgramProposer, Proposer, Speculator
from heron.speculative.draft_model import DraftModelProposer, load_draft_runner, split_kv_budget
from heron.speculative.mtp import MTPProposer, load_mtp_runner

logger = logging.getLogger(__name__)

# Verification graphs keep 1 + k logits rows per request each: captured up to this batch
# (or disable_by_batch_size), larger verification steps run eagerly.
VERIFY_GRAPH_MAX_BS = 64


@dataclass
class EngineParts:
    """What :func:`build_engine` makes; the engine holds each part."""

    tokenizer: PreTrainedTokenizerBase
    runner: ModelRunner | TensorParallelRunner
    draft_runner: ModelRunner | None  # a draft model's or an MTP head's
    kv_cache: KVCacheCoordinator
    proposer: Proposer | None
    speculator: Speculator | None  # asks the proposer before each scheduling pass
    scheduler: Scheduler
    verification_bytes: int  # reserved beside the caches for verification steps
    # Why steps are not scheduled past a verification on the device (None: they are).
    sync_verification_reason: str | None


def build_engine(config: ResolvedConfig) -> EngineParts:
    """Raises ``ValueError`` naming the model where it cannot be built as asked."""
    options, speculative = config.options, config.speculative
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    try:
        runner = make_model_runner(
            options.tensor_parallel_size,
            RunnerArgs(
                config.model,
                config.block_size,
                config.attention_backend,
                options.seed,
                options.lora,
                config.pooling,
            ),
            config.platform,
        )
    except ValueError as e:
        # Name what the user gave: a GGUF file's weights are read from its converted copy.
        raise ValueError(f"{options.model or config.model_path}: {e}") from e
    draft_runner = None if speculative is None else _draft_runner(config, runner, tokenizer)
    sync_reason = None
    if speculative is not None:
        sync_reason = _runs_past_verification(config, runner, draft_runner)
        if sync_reason is None:
            runner.async_verification = True
    verification_bytes = _reserve_verification(config, runner)
    num_blocks, draft_blocks = _num_kv_blocks(config, runner, draft_runner, verification_bytes)
    runner.allocate_kv_cache(num_blocks)
    if draft_runner is not None:
        draft_runner.allocate_kv_cache(draft_blocks)
    if config.cuda_graphs:
        _capture_graphs(config, runner, draft_runner, ingests=sync_reason is None)
    # Mean and CLS pooling read every token's hidden states: none may come from the cache.
    pools_all_tokens = config.pooling is not None and config.pooling.pooling_type != "last"
    kv_cache = KVCacheCoordinator(
        runner.cache_specs,
        num_blocks,
        options.enable_prefix_caching and not pools_all_tokens,
        options.decode_checkpoint_interval,
    )
    connector = None
    if options.kv_transfer is not None:
        if pools_all_tokens:
            raise ValueError(
                "kv_transfer_config: a KV connector keeps cached prefixes, and "
                f"{config.pooling.pooling_type} pooling reads every token's hidden states"
            )
        connector, worker = make_connector(
            options.kv_transfer, runner.cache, config.block_size, num_blocks
        )
        runner.set_kv_connector(worker)
    proposer = speculator = None
    if speculative is not None:
        proposer = _proposer(config, draft_runner, draft_blocks)
        speculator = Speculator(
            proposer,
            config.max_num_batched_tokens,
            config.model.max_model_len,
            speculative.disable_by_batch_size or options.max_num_seqs,
            runner.verify_graph_max_batch,
            drafts_on_device=isinstance(runner, ModelRunner),
        )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.model.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_num_partial_prefills=options.max_num_partial_prefills,
            max_long_partial_prefills=options.max_long_partial_prefills,
            max_loras=options.lora.max_loras if options.lora else 0,
            whole_images=images_attend_whole(config.model.architecture),
        ),
        kv_cache,
        proposer,
        connector,
    )
    parts = EngineParts(
        tokenizer,
        runner,
        draft_runner,
        kv_cache,
        proposer,
        speculator,
        scheduler,
        verification_bytes,
        sync_reason,
    )
    _log(config, parts)
    return parts


def _draft_runner(
    config: ResolvedConfig, runner: ModelRunner | TensorParallelRunner, tokenizer
) -> ModelRunner | None:
    """The runner of the model a proposer runs (None for n-gram lookup); refuses a target
    whose caches cannot roll refused proposals back."""
    speculative = config.speculative
    for spec in runner.cache_specs:
        if not isinstance(spec, (PagedSpec, RecurrentStateSpec)):
            raise ValueError(
                f"speculative_config: the cache kind {spec.describe()} cannot roll back "
                "refused proposals (paged attention caches and recurrent states can)"
            )
    if speculative.method == "draft_model":
        return load_draft_runner(
            speculative,
            config.model,
            tokenizer,
            config.platform,
            config.block_size,
            config.attention_backend,
            config.options.dtype,
            config.options.kv_cache_dtype,
        )
    if speculative.method == "mtp":
        head = load_mtp_runner(runner, config.attention_backend, config.max_num_batched_tokens)
        runner.keep_hidden_states = True
        return head
    return None


def _proposer(
    config: ResolvedConfig, draft_runner: ModelRunner | None, draft_blocks: list[int] | None
) -> Proposer:
    """The speculative method's proposer: n-gram lookup, or the model ``draft_runner`` runs
    (a draft model or an MTP head) over a pool of ``draft_blocks``."""
    speculative = config.speculative
    if draft_runner is None:
        return NgramProposer(
            speculative.num_speculative_tokens,
            speculative.prompt_lookup_min,
            speculative.prompt_lookup_max,
        )
    proposer_class = MTPProposer if speculative.method == "mtp" else DraftModelProposer
    return proposer_class(
        draft_runner,
        KVCacheCoordinator(
            draft_runner.cache_specs, draft_blocks, config.options.enable_prefix_caching
        ),
        speculative.num_speculative_tokens,
        config.max_num_batched_tokens,
    )


def _capture_graphs(
    config: ResolvedConfig,
    runner: ModelRunner | TensorParallelRunner,
    draft_runner: ModelRunner | None,
    ingests: bool,
) -> None:
    """Decode graphs up to the graph batch, verification graphs up to the batch proposals run
    at; a draft run past a verification (``ingests``) or an MTP head catching up after each
    ingests blocks of 1 + k tokens a row."""
    speculative, max_batch = config.speculative, config.max_graph_batch
    k = speculative.num_speculative_tokens if speculative else 0
    verify_batch = (
        min(max_batch, speculative.disable_by_batch_size or VERIFY_GRAPH_MAX_BS)
        if speculative
        else 0
    )
    runner.capture_graphs(max_batch, 1 + k, verify_batch)
    if draft_runner is not None:
        draft_batch = min(max_batch, speculative.disable_by_batch_size or max_batch)
        draft_runner.capture_graphs(
            draft_batch,
            1 + k if speculative.method == "mtp" or ingests else 1,
            min(draft_batch, VERIFY_GRAPH_MAX_BS),
        )


def _runs_past_verification(
    config: ResolvedConfig,
    runner: ModelRunner | TensorParallelRunner,
    draft_runner: ModelRunner | None,
) -> str | None:
    """None where steps may be scheduled past a verification still on the device: a draft
    model asked to (``async_verification``) beside a single-rank target, asynchronous
    scheduling on, and every operator of both reading lengths on the device only over
    full-attention caches (a row is then moved back on the device: positions, slots, KV
    lengths); else why not."""
    method = config.speculative.method
    if method != "draft_model":
        return (
            "n-gram proposals need the accepted tokens on the host"
            if method == "ngram"
            else f"{method} proposals are not made past an unread verification"
        )
    if not config.speculative.async_verification:
        return "speculative_config's async_verification is off"
    if not config.options.async_scheduling:
        return "async_scheduling is off"
    if not isinstance(runner, ModelRunner):
        return "a tensor-parallel target"
    for name, r in (("the target", runner), ("the draft", draft_runner)):
        for spec in r.cache_specs:
            if type(spec) is not FullAttentionSpec:
                return f"{name}'s cache {spec.describe()} is laid out from host lengths"
        for group in r.plan.groups:
            if not group.builder.lengths_on_device:
                return f"{name}'s {group.builder.describe()} reads host lengths"
    return None


def _reserve_verification(
    config: ResolvedConfig, runner: ModelRunner | TensorParallelRunner
) -> int:
    """Reserve what verification steps keep beside the caches, for as many verifying rows
    as may run (proposals stop past ``disable_by_batch_size`` running requests); its bytes."""
    speculative, max_seqs = config.speculative, config.options.max_num_seqs
    if speculative is None:
        return 0
    rows = min(max_seqs, speculative.disable_by_batch_size or max_seqs)
    return runner.reserve_verification(rows, speculative.num_speculative_tokens)


def kv_cache_budget(
    config: ResolvedConfig,
    runners: list[ModelRunner | TensorParallelRunner],
    verification_bytes: int,
) -> int:
    """Bytes for the KV caches (the target's and a draft model's): ``kv_cache_memory_bytes``
    when given; else measured on CUDA after a profiled forward of each runner (whose peak
    holds the weights and every reserved buffer; the smaller budget counts), the CPU
    platform's default less the reserved buffers elsewhere."""
    if config.options.kv_cache_memory_bytes is not None:
        return config.options.kv_cache_memory_bytes
    if config.device.type == "cuda":
        max_len, max_tokens = config.model.max_model_len, config.max_num_batched_tokens
        utilization = config.options.gpu_memory_utilization
        return min(r.kv_cache_budget(utilization, min(max_tokens, max_len)) for r in runners)
    return config.platform.host_kv_cache_budget() - verification_bytes


def _num_kv_blocks(
    config: ResolvedConfig,
    runner: ModelRunner | TensorParallelRunner,
    draft_runner: ModelRunner | None,
    verification_bytes: int,
) -> tuple[list[int], list[int] | None]:
    """Pool size (null block included) of each cache group of the target and of the draft
    model (None without one): the budget, split between the two so both hold the same
    number of max-length sequences, then by each cache layout (every group fits the same
    number of them); or an explicit ``num_kv_blocks`` for every group."""
    options = config.options
    runners = [runner] if draft_runner is None else [runner, draft_runner]
    layouts = [r.cache for r in runners]
    max_len, max_tokens = config.model.max_model_len, config.max_num_batched_tokens
    if options.num_kv_blocks is not None:
        sizes = [[options.num_kv_blocks] * layout.num_groups for layout in layouts]
    else:
        budget = kv_cache_budget(config, runners, verification_bytes)
        budgets = [budget]
        if draft_runner is not None:
            budgets = split_kv_budget(budget, *layouts, max_len, max_tokens)
            logger.info(
                "KV cache budget %.3f GiB: %.3f GiB for the target, %.3f GiB for the draft",
                *(b / 2**30 for b in (budget, *budgets)),
            )
        on_cuda = config.device.type == "cuda"
        sizes = [
            layout.split_budget(
                b,
                max_len,
                max_tokens,
                # the host budget is a default, not what is free: no more than the sequences use
                None if on_cuda else options.max_num_seqs,
                max_running=options.max_num_seqs,
                state_checkpoints=options.enable_prefix_caching,
            )
            for layout, b in zip(layouts, budgets)
        ]
    for layout, num_blocks in zip(layouts, sizes):
        layout.check_fits(num_blocks, max_len, max_tokens)
    return sizes[0], sizes[1] if draft_runner is not None else None


def describe_speculation(
    speculative: SpeculativeConfig, speculator: Speculator, ahead: str | None
) -> str:
    """How proposals reach the verification step, and when scheduling overlaps the device
    (``ahead``: None where the next step is scheduled past a verification still on the
    device, else why not)."""
    if speculative.method == "ngram":
        where = "looked up on the host in the accepted tokens"
    elif speculator.drafts_on_device:
        where = "kept on the device up to the verification step"
    else:
        where = "read on the host (a tensor-parallel target)"
    head = f"{speculative.method}, {speculative.num_speculative_tokens} proposals per step, {where}"
    if ahead is None:
        return (
            f"{head}; the next step and its proposals are scheduled while a verification step "
            "runs, as if it accepted every proposal, and moved back on the device by its "
            "refusals (asynchronous verification)"
        )
    limit = speculative.disable_by_batch_size
    return (
        f"{head}; each verification step is read before the next proposals ({ahead}), so "
        "scheduling overlaps the device only while speculation is off "
        f"({f'more than {limit} requests' if limit else 'never'})"
    )


def _log(config: ResolvedConfig, parts: EngineParts) -> None:
    scheme = config.model.quantization
    logger.info(
        "model %s (%s), dtype %s, device %s, %s",
        config.model_path,
        config.model.architecture,
        config.model.dtype,
        config.device,
        scheme.describe() if scheme else "unquantised weights",
    )
    if config.speculative is not None:
        logger.info(
            "speculative decoding: %s",
            describe_speculation(
                config.speculative, parts.speculator, parts.sync_verification_reason
            ),
        )
    caches = [("", parts.kv_cache)]
    if parts.draft_runner is not None:
        caches.append(("draft ", parts.proposer.kv_cache))
    for name, kv in caches:
        for g, group in enumerate(kv.groups):
            logger.info(
                "%scache group %d (%s): %s", name, g, group.spec.describe(), group.describe_pool()
            )
    if parts.scheduler.connector is not None:
        logger.info("KV connector: %s", parts.scheduler.connector.describe())

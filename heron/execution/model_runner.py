"""ModelRunner: one step of the model, from scheduler output to sampled tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from heron.config import ModelConfig
from heron.engine.request import Logprob, Request
from heron.engine.scheduler import SchedulerOutput
from heron.execution.sampler import Sampler, prompt_logprobs
from heron.metadata import SequenceMetadata, StepBatch, StepMetaPlan
from heron.models.build import build_model
from heron.ops.attention.base import AttentionOperator
from heron.platforms import Platform


@dataclass(frozen=True)
class PreparedStep:
    """A step ready for the forward pass: shared metadata plus how to read its logits."""

    seq: SequenceMetadata
    sample_requests: list[Request]
    sample_rows: torch.Tensor  # rows of the step's logits that are sampled
    prompt_rows: list[tuple[Request, int, int, int]]  # request, first row, first position, count


@dataclass(frozen=True)
class StepResult:
    sampled: list[tuple[Request, int, Logprob | None]]
    prompt_logprobs: list[tuple[Request, list[Logprob]]]


class ModelRunner:
    """Owns the model, its metadata plan and its KV caches; runs one step at a time."""

    def __init__(
        self,
        model_config: ModelConfig,
        platform: Platform,
        block_size: int,
        attention_backend: str,
        seed: int,
    ) -> None:
        self.model_config = model_config
        self.platform = platform
        self.device = platform.device
        self.block_size = block_size
        self.plan: StepMetaPlan | None = None
        self.model = build_model(model_config, platform, self, attention_backend, block_size)
        self.attention_ops = [m for m in self.model.modules() if isinstance(m, AttentionOperator)]
        self.sampler = Sampler()
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.num_blocks = 0

    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.model_config.dtype).element_size()
        return sum(
            2 * self.block_size * op.spec.num_kv_heads * op.spec.head_dim * elem
            for op in self.attention_ops
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        for op in self.attention_ops:
            op.bind_kv_cache(
                torch.zeros(
                    2,
                    num_blocks,
                    self.block_size,
                    op.spec.num_kv_heads,
                    op.spec.head_dim,
                    dtype=self.model_config.dtype,
                    device=self.device,
                )
            )

    def prepare(
        self, output: SchedulerOutput, block_table: Callable[[str], list[int]]
    ) -> PreparedStep:
        """Host work of a step: the packed StepBatch, its one copy, every group's view."""
        items = output.scheduled
        bs = self.block_size
        tables = [block_table(item.request.request_id) for item in items]
        sample_requests: list[Request] = []
        prompt_spans: list[tuple[Request, int, int, int]] = []  # request, token offset, pos, count
        num_tokens = 0
        for item in items:
            r, c = item.request, item.request.num_computed_tokens
            if r.wants_prompt_logprobs and c < r.num_prompt_tokens - 1:
                count = min(c + item.num_new_tokens, r.num_prompt_tokens - 1) - c
                prompt_spans.append((r, num_tokens, c, count))
            if item.samples:
                sample_requests.append(r)
            num_tokens += item.num_new_tokens
        num_prompt_rows = sum(span[3] for span in prompt_spans)
        batch = StepBatch(
            len(items),
            num_tokens,
            num_prompt_rows + len(sample_requests),
            max(map(len, tables), default=0),
            bs,
        )
        offset = 0
        rows = num_prompt_rows
        for i, (item, table) in enumerate(zip(items, tables)):
            r, c, n = item.request, item.request.num_computed_tokens, item.num_new_tokens
            batch.query_lens[i] = n
            batch.kv_lens[i] = c + n
            batch.block_tables[i, : len(table)] = table
            if n == 1:  # decode: scalar writes are cheaper than array ops
                batch.token_ids[offset] = r.all_token_ids[c]
                batch.positions[offset] = c
                batch.slot_mapping[offset] = table[c // bs] * bs + c % bs
            else:
                positions = np.arange(c, c + n, dtype=np.int32)
                batch.token_ids[offset : offset + n] = r.all_token_ids[c : c + n]
                batch.positions[offset : offset + n] = positions
                batch.slot_mapping[offset : offset + n] = (
                    batch.block_tables[i, positions // bs] * bs + positions % bs
                )
            offset += n
            if item.samples:
                batch.logits_indices[rows] = offset - 1
                rows += 1
        row = 0
        prompt_rows = []
        for r, token_offset, position, count in prompt_spans:
            batch.logits_indices[row : row + count] = np.arange(
                token_offset, token_offset + count, dtype=np.int32
            )
            prompt_rows.append((r, row, position, count))
            row += count
        batch.finish()

        seq = SequenceMetadata.from_step_batch(batch, self.device)
        self.plan.build_views(seq)
        sample_rows = torch.arange(num_prompt_rows, rows, device=self.device)
        return PreparedStep(seq, sample_requests, sample_rows, prompt_rows)

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput, block_table: Callable[[str], list[int]]
    ) -> StepResult:
        step = self.prepare(output, block_table)
        seq = step.seq
        hidden = self.model(seq.token_ids, seq.positions)
        logits = self.model.compute_logits(hidden[seq.logits_indices.long()]).float()
        sampled = []
        if step.sample_requests:
            result = self.sampler(logits[step.sample_rows], step.sample_requests, self.generator)
            sampled = list(zip(step.sample_requests, result.token_ids, result.logprobs))
        prompt_lps = []
        for r, row, position, count in step.prompt_rows:
            next_ids = r.all_token_ids[position + 1 : position + 1 + count]
            top = r.sampling_params.prompt_logprobs
            prompt_lps.append((r, prompt_logprobs(logits[row : row + count], next_ids, top)))
        return StepResult(sampled, prompt_lps)

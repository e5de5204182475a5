"""What a CUDA graph replay computes, without the graph, so the CPU (Triton's interpreter) can
run it: the capture's dummy steps fill each builder's graph buffers and give the buckets' views
(warm-up forward included), and a "replay" fills the step into the buffers, puts the bucket's
views back and runs the forward on them. Only what a graph adds is missing (replaying no
Python), so ``before_capture`` runs before every replay, as the captured planning would."""

from __future__ import annotations

import bisect

import torch

from heron.execution.cuda_graph import CudaGraphRunner, _dummy_step


class ViewReplay(CudaGraphRunner):
    @torch.inference_mode()
    def capture(self, block_size, group_parts) -> None:
        self.views = {}
        for q in reversed(self.query_lens):
            for batch in reversed(self.buckets_of[q]):
                dummy = _dummy_step(batch, q, block_size, self.device, group_parts)
                self._fill(dummy, batch)
                views = [
                    g.builder.graph_view(dummy, self.buffers[id(g)], batch)
                    for g in self.plan.groups
                ]
                self.views[batch, q] = views
                self._forward(batch, q)  # the warm-up

    def _forward(self, batch: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        for group, view in zip(self.plan.groups, self.views[batch, q]):
            group.builder.before_capture(self.buffers[id(group)])
            group.view = view
        hidden = self.model(self.token_ids[: batch * q])
        return hidden, self.model.compute_logits(hidden)

    def run(self, seq):
        n, q = seq.num_reqs, seq.max_query_len
        buckets = self.buckets_of[q]
        batch = buckets[bisect.bisect_left(buckets, n)]
        self.token_ids[: n * q].copy_(seq.token_ids)
        self._fill(seq, batch)
        hidden, logits = (t[: n * q] for t in self._forward(batch, q))
        self.replayed.append((n, q))
        return hidden, logits, logits.argmax(-1)


def replay_views(llm, max_batch: int = 2) -> ViewReplay:
    """Make ``llm``'s engine replay (emulated) decode graphs up to ``max_batch`` rows, and
    under speculation verification graphs, with proposals padded to ``k`` as real
    verification graphs have them; a model proposer's runner (a draft's, an MTP head's)
    replays its decode graphs and those of its ``1 + k``-token catch-ups
    (``ViewReplay.replayed`` of the returned target's and of ``draft_runner.graphs``)."""
    engine = llm.engine
    spec = engine.config.speculative
    query_len = 1 if spec is None else 1 + spec.num_speculative_tokens
    graphs = _replay_views(engine.runner, max_batch, query_len)
    if engine.draft_runner is not None:
        _replay_views(engine.draft_runner, max_batch, query_len)
    if engine.speculator is not None:
        engine.speculator.uniform_up_to = max_batch
    return graphs


def _replay_views(runner, max_batch: int, query_len: int) -> ViewReplay:
    graphs = ViewReplay(runner.model, runner.plan, runner.device, max_batch, {query_len: max_batch})
    graphs.replayed = []
    graphs.capture(runner.block_size, runner.inputs.parts)
    runner.graphs = graphs
    return graphs

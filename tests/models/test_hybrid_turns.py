"""Conversations on hybrid models (Qwen3.5, Qwen3-Next): each turn's prompt is the previous
prompt, the previous answer and a new message, so with prefix caching a turn resumes from the
recurrent-state checkpoint at the last block boundary of the previous answer (the state after
exactly those tokens), not only from the previous prompt's. Outputs equal HF transformers' and
the same engine's without prefix caching, with speculative decoding too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf
from test_mtp import save_with_mtp
from test_qwen3_5 import moe_variant, save_qwen3_5

from heron import LLM, SamplingParams
from heron.cache.recurrent import RecurrentStateManager

from tiny_models import hf_greedy, make_tokenizer

FIRST_PROMPTS = [
    [(i * 37) % 300 + 5 for i in range(100)],
    [(i * 53) % 290 + 7 for i in range(40)],
]
ANSWERS = [37, 37, 5]  # tokens per answer, by turn
MESSAGES = [  # each turn's new message, per conversation
    [[(i * 13 + t) % 290 + 3 for i in range(20)], [(i * 7 + t) % 280 + 9 for i in range(13)]]
    for t in range(len(ANSWERS) - 1)
]


def converse(llm: LLM, n: int = 1) -> tuple[list[list[list[int]]], list[list[int]], list]:
    """Both conversations turn by turn: per turn the prompts, the answers (each request's
    first sample) and each answer's cached prompt tokens."""
    prompts, turns = FIRST_PROMPTS, []
    for t, max_tokens in enumerate(ANSWERS):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
        outs = llm.generate(prompts, params, use_tqdm=False)
        answers = [o.outputs[0].token_ids for o in outs]
        assert all(len(set(map(tuple, (s.token_ids for s in o.outputs)))) == 1 for o in outs)
        turns.append((prompts, answers, [o.num_cached_tokens for o in outs]))
        if t < len(MESSAGES):
            prompts = [p + a + m for p, a, m in zip(prompts, answers, MESSAGES[t])]
    return turns


def last_boundary(prompt: list[int], answer: list[int], block_size: int) -> int:
    """The last block boundary of a turn's computed tokens (its last token is sampled, never
    fed back): where the next turn resumes."""
    return (len(prompt) + len(answer) - 1) // block_size * block_size


def assert_resumed(turns, block_size: int) -> None:
    """Every turn after the first resumed at the last boundary of the previous one's computed
    tokens (with speculation the answer's last token, verified as a proposal, may be computed
    too)."""
    for (prompts, answers, _), (_, _, cached) in zip(turns, turns[1:]):
        for p, a, c in zip(prompts, answers, cached):
            assert c in (
                last_boundary(p, a, block_size),
                (len(p) + len(a)) // block_size * block_size,
            )


def assert_idle(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    kv.check_invariants()
    assert all(g.num_free_blocks == g.num_blocks - 1 for g in kv.groups)


def save_qwen3_next(path: Path) -> Path:
    model = moe_variant(tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, seed=3, decoder_sparse_step=2)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid(request, tmp_path_factory):
    """A saved tiny hybrid model and HF's greedy answers of every turn."""
    path = tmp_path_factory.mktemp(request.param)
    (save_qwen3_5 if request.param == "qwen3_5" else save_qwen3_next)(path)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs, prompts = [], FIRST_PROMPTS
    for t, max_tokens in enumerate(ANSWERS):
        answers = hf_greedy(hf, prompts, max_tokens)
        refs.append(answers)
        if t < len(MESSAGES):
            prompts = [p + a + m for p, a, m in zip(prompts, answers, MESSAGES[t])]
    return str(path), refs


@pytest.mark.parametrize("block_size", [16, 64])
def test_turns_resume_after_the_previous_answer(hybrid, block_size):
    """Turn ``t`` finds the state at the last boundary of turn ``t - 1``'s answer; tokens are
    HF's, with prefix caching on and off."""
    path, refs = hybrid
    for caching in (True, False) if block_size == 16 else (True,):
        llm = LLM(path, max_model_len=320, block_size=block_size, enable_prefix_caching=caching)
        turns = converse(llm)
        assert [answers for _, answers, _ in turns] == refs
        want = [[0, 0]] + [
            [last_boundary(p, a, block_size) if caching else 0 for p, a in zip(prompts, answers)]
            for prompts, answers, _ in turns[:-1]
        ]
        assert [cached for _, _, cached in turns] == want
        assert_idle(llm)
        if caching:  # beyond the previous prompt's last boundary: into its answer
            assert want[1][0] > len(FIRST_PROMPTS[0]) // block_size * block_size


def test_chunks_preemption_and_two_samples_reuse_and_equal_hf(hybrid):
    """16-token chunks, a pool that preempts, two (greedy) samples per request saving the same
    states, synchronous steps: HF's tokens, later turns hit, nothing leaks."""
    path, refs = hybrid
    llm = LLM(
        path,
        max_model_len=256,
        block_size=16,
        max_num_batched_tokens=16,
        num_kv_blocks=20,
        async_scheduling=False,
    )
    turns = converse(llm, n=2)
    assert [answers for _, answers, _ in turns] == refs
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(cached[0] > 0 for _, _, cached in turns[1:])
    assert_idle(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("speculation", [None, "ngram"])
def test_turns_on_the_gpu_with_graphs_equal_hf(hybrid, speculation):
    """fp32 on the GPU, CUDA graphs and Triton kernels (verification steps through their
    graphs with n-gram proposals): decode checkpoints saved beside graph replays, from the
    slot or the verification buffers, give HF's tokens in the next turns."""
    path, refs = hybrid
    spec = None
    if speculation:
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(
        path,
        device="cuda",
        dtype="float32",
        max_model_len=320,
        block_size=16,
        speculative_config=spec,
    )
    assert llm.engine.runner.graphs is not None
    turns = converse(llm)
    assert [answers for _, answers, _ in turns] == refs
    assert_resumed(turns, 16)


def count_refused_checkpoints(llm: LLM) -> list[int]:
    """From now on, how many checkpoint entries each refusal gave back (planned at a block
    boundary among refused proposals), in a list the engine's truncations append to."""
    kv, counts = llm.engine.kv_cache, []
    recurrent = [g for g in kv.groups if isinstance(g, RecurrentStateManager)]
    truncate = kv.truncate

    def counted(request, num_tokens):
        before = sum(g.num_free_blocks for g in recurrent)
        truncate(request, num_tokens)
        counts.append(sum(g.num_free_blocks for g in recurrent) - before)

    kv.truncate = counted
    return counts


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculative_turns_equal_plain_greedy_without_caching(method, tmp_path):
    """n-gram proposals (the messages quote the answers, so some are accepted) or a Qwen3.5
    MTP head, with prefix caching: every turn's tokens are plain greedy decoding's without
    it; states saved at boundaries among proposals are kept only where accepted."""
    if method == "mtp":
        save_with_mtp("qwen3_5", tmp_path, predictive=True)
        spec = {"method": "mtp", "num_speculative_tokens": 2}
    else:
        save_qwen3_5(tmp_path)
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    options = dict(max_model_len=320, block_size=8)  # (more boundaries among proposals)
    plain = converse(LLM(str(tmp_path), **options, enable_prefix_caching=False))
    llm = LLM(str(tmp_path), **options, speculative_config=spec)
    refused = count_refused_checkpoints(llm)
    turns = converse(llm)
    assert [answers for _, answers, _ in turns] == [answers for _, answers, _ in plain]
    assert_resumed(turns, 8)
    stats = llm.spec_decode_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if method == "ngram":  # (the head is refused too rarely to cross a boundary surely)
        assert sum(refused) > 0
    assert_idle(llm)

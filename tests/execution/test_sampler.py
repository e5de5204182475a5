"""Sampler against plain reference implementations (numpy, float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heron.execution import sampler as sampler_module
from heron.execution.request_state import RequestState
from heron.execution.sampler import (
    Sampler,
    apply_min_tokens,
    apply_penalties,
    prompt_logprobs,
    sampling_probs,
)
from heron.execution.step_plan import NewRequest
from heron.sampling_params import SamplingParams

VOCAB = 1000  # not a multiple of a SIMD width, so rows sit at different alignments
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def make_request(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    device: str = "cpu",
) -> RequestState:
    prompt = prompt or [5, 6, 7]
    new = NewRequest("r", prompt + (output or []), len(prompt), params, params.seed)
    return RequestState(new, torch.device(device))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature, then top-k, top-p (smallest set reaching top_p), min-p, written plainly."""
    x = logits.astype(np.float64) / p.temperature
    if p.top_k:
        kth = np.sort(x)[::-1][min(p.top_k, len(x)) - 1]
        x = np.where(x < kth, -np.inf, x)
    if p.top_p < 1.0:
        probs = softmax(x)
        order = np.argsort(-probs)
        keep = np.searchsorted(np.cumsum(probs[order]), p.top_p) + 1
        masked = np.full_like(x, -np.inf)
        masked[order[:keep]] = x[order[:keep]]
        x = masked
    if p.min_p > 0.0:
        probs = softmax(x)
        x = np.where(probs < p.min_p * probs.max(), -np.inf, x)
    return softmax(x)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_probs_match_reference(device):
    rng = np.random.default_rng(0)
    combos = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
        for t in (0.5, 1.0, 1.7)
        for k in (0, 1, 5, 50, 5000)
        for p in (1.0, 0.9, 0.5, 0.05)
        for m in (0.0, 0.05, 0.3)
    ]
    logits = rng.normal(scale=3.0, size=(len(combos), VOCAB)).astype(np.float32)
    probs = sampling_probs(torch.tensor(logits, device=device), combos).cpu().numpy()
    for row, params in enumerate(combos):
        expected = reference_probs(logits[row], params)
        np.testing.assert_array_equal(probs[row] > 0, expected > 0, err_msg=str(params))
        np.testing.assert_allclose(probs[row], expected, atol=1e-6, err_msg=str(params))


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    penalised = make_request(
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        prompt=[0, 1],
        output=[1, 3, 3],
    )
    plain = make_request(SamplingParams(), prompt=[0, 1], output=[1, 3, 3])
    out = apply_penalties(logits.clone(), [penalised, plain])
    # Repetition (seen: 0, 1, 3): 2 / 2, -1 * 2, 3 / 2. Then output counts {1: 1, 3: 2}:
    # token 1 -= 0.5 * 1 + 0.25, token 3 -= 0.5 * 2 + 0.25.
    expected = torch.tensor([1.0, -2.0 - 0.75, 0.5, 1.5 - 1.25, -2.0])
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(out[1], logits[1])


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    request = make_request(SamplingParams(presence_penalty=1.0), prompt=[0, 1], output=[2])
    out = apply_penalties(logits, [request])
    torch.testing.assert_close(out[0], torch.tensor([0.0, 0.0, -1.0, 0.0]))


def test_min_tokens_masks_eos_and_stop_tokens():
    params = SamplingParams(
        temperature=0.0, min_tokens=2, stop_token_ids=[1], eos_token_ids=frozenset({0})
    )
    logits = torch.tensor([[9.0, 8.0, 1.0, 0.0]])
    early = make_request(params, output=[3])
    done = make_request(params, output=[3, 3])
    masked = logits.clone()
    apply_min_tokens(masked, [early])
    assert masked[0, :2].tolist() == [float("-inf")] * 2
    sampled = Sampler()(logits.repeat(2, 1), [early, done])
    assert sampled.token_ids == [2, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_argmax_in_a_mixed_batch(device):
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3)] * 3
    requests = [make_request(p) for p in params]
    out = Sampler()(logits.to(device), requests, torch.Generator(device).manual_seed(1))
    argmax = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0::2] == argmax[0::2]
    top3 = logits.topk(3, dim=-1).indices.tolist()
    assert all(out.token_ids[i] in top3[i] for i in (1, 3, 5))
    assert out.logprobs == [None] * 6


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -4.0, 2.0, 0.2])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95)
    rows = 20000
    out = Sampler()(
        logits.repeat(rows, 1),
        [make_request(params)] * rows,
        torch.Generator().manual_seed(0),
    )
    counts = np.bincount(out.token_ids, minlength=len(logits))
    expected = reference_probs(logits.numpy(), params) * rows
    assert counts[expected == 0].sum() == 0
    kept = expected > 0
    chi2 = (((counts[kept] - expected[kept]) ** 2) / expected[kept]).sum()
    assert chi2 < 25.0  # p ~ 1e-4 at <= 6 degrees of freedom


def _seeded_tokens(device: str, position: int, batch_size: int, others_seed: int) -> list[int]:
    """Tokens of a seeded request over 8 steps, placed at ``position`` among other rows."""
    target = make_request(SamplingParams(seed=1234, top_p=0.9, presence_penalty=0.5), device=device)
    logits_stream = torch.Generator().manual_seed(7)
    others_stream = torch.Generator().manual_seed(others_seed)
    kinds = [
        lambda i: SamplingParams(temperature=0.0),
        lambda i: SamplingParams(seed=others_seed + i),
        lambda i: SamplingParams(top_k=20, repetition_penalty=1.2),
    ]
    others = [make_request(kinds[i % 3](i), device=device) for i in range(batch_size - 1)]
    sampler = Sampler()
    for _ in range(8):
        target_logits = torch.randn(1, VOCAB, generator=logits_stream)
        other_logits = torch.randn(batch_size - 1, VOCAB, generator=others_stream)
        logits = torch.cat([other_logits[:position], target_logits, other_logits[position:]])
        requests = [*others[:position], target, *others[position:]]
        shared = torch.Generator(device).manual_seed(others_seed)
        out = sampler(logits.to(device), requests, shared)
        for request, token in zip(requests, out.token_ids):
            request.all_token_ids.append(token)
    return target.output_token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_seed_gives_same_tokens_whatever_the_batch(device):
    alone = _seeded_tokens(device, position=0, batch_size=1, others_seed=0)
    assert len(set(alone)) > 1
    for position, batch_size, others_seed in [(0, 4, 1), (3, 4, 2), (5, 9, 3), (2, 5, 4)]:
        assert _seeded_tokens(device, position, batch_size, others_seed) == alone


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_from_raw_logits(dtype, device):
    torch.manual_seed(0)
    logits = (torch.randn(3, VOCAB) * 2).to(dtype)
    requests = [
        make_request(SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5)),
        make_request(SamplingParams(logprobs=0, temperature=0.0, frequency_penalty=1.0)),
        make_request(SamplingParams(top_k=10)),
    ]
    out = Sampler()(logits.to(device), requests)
    raw = np.log(np.apply_along_axis(softmax, 1, logits.double().numpy()))
    for row, n in ((0, 5), (1, 0)):
        entry = out.logprobs[row]
        token = out.token_ids[row]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(raw[row, token], abs=1e-5)
        # Ties (bfloat16) share the best rank.
        assert entry.rank == (raw[row] > raw[row, token]).sum() + 1
        assert len(entry.top) == n
        assert sorted(entry.top.values(), reverse=True) == pytest.approx(
            np.sort(raw[row])[::-1][:n], abs=1e-5
        )
        for token_id, value in entry.top.items():
            assert value == pytest.approx(raw[row, token_id], abs=1e-5)
    assert out.logprobs[2] is None


def test_prompt_logprobs(monkeypatch):
    monkeypatch.setattr(sampler_module, "_PROMPT_LOGPROBS_CHUNK", 3)  # cross chunk boundaries
    torch.manual_seed(0)
    logits = torch.randn(7, 50)
    next_ids = torch.randint(0, 50, (7,))
    entries = prompt_logprobs(logits, next_ids.tolist(), num_top=2)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(entries) == 7
    for row, entry in enumerate(entries):
        token = next_ids[row].item()
        order = raw[row].argsort(descending=True).tolist()
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert entry.rank == order.index(token) + 1
        assert list(entry.top) == order[:2]

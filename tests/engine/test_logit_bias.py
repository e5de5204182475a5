"""logit_bias against HF transformers' logits plus the bias, decoded greedily by hand."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from heron import LLM, SamplingParams

PROMPT = [7, 8, 9, 10, 11]
NEW = 6


def _hf_greedy(hf, bias: dict[int, float]) -> list[int]:
    dense = torch.zeros(hf.config.vocab_size)
    for token, value in bias.items():
        dense[token] = value
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int((hf(torch.tensor([ids])).logits[0, -1].float() + dense).argmax()))
    return ids[len(PROMPT) :]


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"]
)
def test_logit_bias_equals_hf_logits_plus_bias(tiny_model_dir, device):
    """Biased and unbiased requests in one batch; on CUDA the decode steps replay graphs, whose
    own greedy tokens a biased request must not take."""
    path = tiny_model_dir("qwen2")
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    plain = _hf_greedy(hf, {})
    bias = {plain[0]: -100.0, plain[1]: -100.0, 42: 2.5}
    llm = LLM(str(path), device=device, dtype="float32", max_model_len=64, num_kv_blocks=16)
    greedy = dict(temperature=0, max_tokens=NEW, ignore_eos=True)
    params = [
        SamplingParams(**greedy),
        SamplingParams(**greedy, logit_bias=bias),
        SamplingParams(**greedy, logit_bias=bias, logprobs=1),  # sampled on the host
    ]
    outputs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens == [plain, _hf_greedy(hf, bias), _hf_greedy(hf, bias)]
    assert tokens[1] != plain


def test_logit_bias_is_validated(tiny_model_dir):
    with pytest.raises(ValueError, match="logit_bias must be"):
        SamplingParams(logit_bias={3: 101.0})
    llm = LLM(str(tiny_model_dir("qwen2")), max_model_len=64, num_kv_blocks=16)
    (out,) = llm.generate(PROMPT, SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert "logit_bias token id 1000000 is outside the vocabulary" in out.error

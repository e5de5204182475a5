"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): it answers a known question,
and its greedy chat completions equal HF transformers' on the same weights."""

import pytest
import torch
import transformers as tf

from heron import LLM, SamplingParams
from heron.loader.gguf import default_model_file, resolve_gguf

NEW_TOKENS = 32
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Write a Python function that returns the factorial of n.",
    "List three primary colors.",
    "What is 17 plus 25?",
    "Translate to French: The cat is sleeping on the sofa.",
    "Continue the story: Once upon a time, in a small village by the mountains,",
    "Who wrote the play Romeo and Juliet?",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The default model converted once for this module, from scratch (not the user's cache);
    ``LLM()`` finds the conversion through HERON_CACHE_DIR."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HERON_CACHE_DIR", str(tmp_path_factory.mktemp("heron-cache")))
        yield resolve_gguf(default_model_file())


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(checkpoint):
    llm = LLM()
    assert llm.engine.model_config.path == checkpoint
    assert llm.engine.model_config.architecture == "LlamaForCausalLM"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its turn by itself


def heron_top5(llm: LLM, prefix: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    return list(llm.generate(prefix, params, use_tqdm=False)[0].outputs[0].logprobs[0].top)


def hf_top5(hf, prefix: list[int]) -> list[int]:
    with torch.no_grad():
        return hf(torch.tensor([prefix])).logits[0, -1].topk(5).indices.tolist()


@pytest.mark.slow
def test_greedy_chat_equals_hf_on_the_same_weights(checkpoint):
    """Both sides load Heron's conversion of the GGUF (dequantised to fp32), so a difference is
    the engine's: eight chat prompts batched in one generate call, fp32, token for token."""
    llm = LLM(str(checkpoint), max_model_len=256, max_num_seqs=len(PROMPTS))
    assert llm.engine.model_config.dtype == torch.float32
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    hf = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: all NEW_TOKENS are produced
    for prompt, heron_ids in zip(prompts, got):
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
        want = out[0, len(prompt) :].tolist()
        assert len(heron_ids) == len(want) == NEW_TOKENS
        # DESIGN §6's near-tie rule: at a first difference, each side's token is in the other's
        # top-5 there, and the comparison stops.
        step = next((i for i, (a, b) in enumerate(zip(heron_ids, want)) if a != b), None)
        if step is not None:
            prefix = prompt + want[:step]
            assert heron_ids[step] in hf_top5(hf, prefix), (prompt, step)
            assert want[step] in heron_top5(llm, prefix), (prompt, step)


EDITED_TEXT = (
    "The heron stood still in the shallow water of the river. It waited for a fish to swim "
    "past its long legs, and when one came close, it struck with its sharp beak."
)
EDIT_PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{EDITED_TEXT}",
    f"Rewrite the following text, replacing 'heron' with 'crane':\n\n{EDITED_TEXT}",
    f"Copy this text and put it in capital letters at the end:\n\n{EDITED_TEXT}",
]


@pytest.mark.slow
def test_ngram_acceptance_on_repeat_and_edit_prompts(checkpoint):
    """Prompt lookup pays off where the answer repeats the prompt: a measured property of the
    model, not a timing."""
    speculation = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    llm = LLM(str(checkpoint), max_model_len=512, speculative_config=speculation)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in EDIT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=64)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.spec_decode_stats
    print(
        f"mean acceptance length {stats.mean_acceptance_length:.2f} "
        f"({stats.num_accepted_tokens} of {stats.num_draft_tokens} proposed tokens accepted)"
    )
    assert all(o.outputs[0].token_ids for o in outputs)
    assert stats.mean_acceptance_length > 1.5

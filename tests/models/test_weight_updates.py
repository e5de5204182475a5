"""Weight updates in place: after an update the engine generates what HF transformers does on
the new weights (whole checkpoints, subsets, an MTP head's and a draft model's tensors among
them); prefixes cached under the old weights are not hit; bad updates change nothing."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from test_mtp import save_with_mtp
from test_speculative_parity import assert_equal_up_to_exact_ties

from heron import LLM, SamplingParams

from tiny_models import (
    BASE,
    greedy_tokens,
    hf_greedy,
    hf_on_weights,
    save_random_model,
    save_tiny_model,
    save_truncated_draft,
)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(10, 30)), [3, 4, 5]]
OPTIONS = dict(max_model_len=64, num_kv_blocks=24, block_size=16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two random checkpoints of one tiny config, and HF's model of the second."""
    first = save_tiny_model("qwen3", tmp_path_factory.mktemp("first"), seed=0)
    second = save_tiny_model("qwen3", tmp_path_factory.mktemp("second"), seed=1)
    hf = tf.AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32).eval()
    return first, second, hf


def _state(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm.engine.runner.model.named_parameters()}


def test_level2_sleep_then_update_equals_hf_on_the_new_weights(checkpoints):
    first, second, hf = checkpoints
    llm = LLM(str(first), enable_sleep_mode=True, **OPTIONS)
    greedy_tokens(llm, PROMPTS, GREEDY)
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0

    llm.sleep(level=2)
    llm.wake_up(["weights"])
    tensors = load_file(second / "model.safetensors")
    assert llm.update_weights(tensors.items()) == len(tensors)
    llm.wake_up(["kv_cache"])
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf, PROMPTS, GREEDY.max_tokens)
    assert outputs[0].num_cached_tokens == 0


def test_update_resets_the_prefix_cache_and_takes_a_subset(checkpoints):
    """One layer's tensors (q, k, v packed into one projection among them), awake."""
    first, second, _ = checkpoints
    llm = LLM(str(first), **OPTIONS)
    greedy_tokens(llm, PROMPTS, GREEDY)
    layer = {n: t for n, t in load_file(second / "model.safetensors").items() if ".layers.1." in n}
    llm.update_weights(layer.items())
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    hf = hf_on_weights(first, layer)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf, PROMPTS, GREEDY.max_tokens)
    assert outputs[0].num_cached_tokens == 0
    assert llm.reload_weights() == len(load_file(first / "model.safetensors"))
    refs = hf_greedy(tf.AutoModelForCausalLM.from_pretrained(first), PROMPTS, GREEDY.max_tokens)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs


@pytest.mark.parametrize(
    "config",
    [
        tf.Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=True),
        tf.Qwen3MoeConfig(
            **BASE | dict(intermediate_size=64, moe_intermediate_size=64, num_hidden_layers=2),
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=32,
            mlp_only_layers=[1],
        ),  # fmt: skip
    ],
    ids=["dense", "moe"],
)
def test_fp8_weights_quantised_at_load_are_quantised_again_into_their_tensors(config, tmp_path):
    """``quantization="fp8"``: an update loads the new tensors in the dtype the checkpoint
    loaded in and quantises them again (linear layers and expert banks) into the tensors the
    model held, so captured graphs stay valid: the engine then is one built on the new
    checkpoint."""
    first, second = (
        save_random_model(config, tmp_path / n, seed) for n, seed in (("a", 0), ("b", 1))
    )
    llm = LLM(str(first), quantization="fp8", **OPTIONS)
    model = llm.engine.runner.model
    held = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    greedy_tokens(llm, PROMPTS, GREEDY)
    tensors = load_file(second / "model.safetensors")
    assert llm.update_weights(tensors.items()) == len(tensors)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == held
    fresh = LLM(str(second), quantization="fp8", **OPTIONS)
    want = _state(fresh)
    got = _state(llm)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n].float(), want[n].float()) for n in want)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == greedy_tokens(fresh, PROMPTS, GREEDY)


@pytest.mark.parametrize(
    "bad, message",
    [
        (("model.layers.0.mlp.gate.weight", torch.zeros(4, 4)), "'model.layers.0.mlp.gate.weight'"),
        (("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 64)), "shape \\(3, 64\\)"),
        (("model.norm.weight", torch.ones(64, dtype=torch.int64)), "dtype torch.int64"),
        (("model.norm.weight", [1.0] * 64), "'model.norm.weight': expected a tensor"),
    ],
)
def test_a_bad_tensor_changes_no_weight(checkpoints, bad, message):
    """The good tensors before the bad one (packed, copied whole) are not written either."""
    first, second, _ = checkpoints
    llm = LLM(str(first), **OPTIONS)
    before = _state(llm)
    good = [
        ("model.layers.0.self_attn.q_proj.weight", torch.ones(128, 64)),
        ("model.norm.weight", torch.ones(64)),
    ]
    with pytest.raises(ValueError, match=message):
        llm.update_weights([*good, bad])
    after = _state(llm)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_update_is_refused_while_requests_are_kept(checkpoints):
    first, second, hf = checkpoints
    llm = LLM(str(first), **OPTIONS)
    want = greedy_tokens(llm, PROMPTS[:1], GREEDY)
    llm.add_request("kept", PROMPTS[0], GREEDY, stream=False)
    llm.step()
    assert llm.pause_generation(mode="keep") == []
    assert llm.step() == []  # (paused: nothing runs)
    before = _state(llm)
    with pytest.raises(RuntimeError, match="cannot update weights: 1 requests are unfinished"):
        llm.update_weights(load_file(second / "model.safetensors").items())
    assert all(torch.equal(t, _state(llm)[n]) for n, t in before.items())
    llm.resume_generation()
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert outputs[0].outputs[0].token_ids == want[0]


def test_two_ranks_sleep_and_update_their_shards(checkpoints):
    """Tensor parallelism: the workers sleep and wake with rank 0; each rank writes its shards
    of an update; a refused update leaves every rank's weights (the outputs) as they were."""
    first, second, hf = checkpoints
    with LLM(str(first), tensor_parallel_size=2, enable_sleep_mode=True, **OPTIONS) as llm:
        before = greedy_tokens(llm, PROMPTS, GREEDY)
        llm.sleep(level=1)
        llm.wake_up()
        assert greedy_tokens(llm, PROMPTS, GREEDY) == before

        llm.sleep(level=2)
        llm.wake_up(["weights"])
        assert llm.update_weights(load_file(second / "model.safetensors").items()) > 0
        llm.wake_up(["kv_cache"])
        want = hf_greedy(hf, PROMPTS, GREEDY.max_tokens)
        assert greedy_tokens(llm, PROMPTS, GREEDY) == want

        bad = ("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 64))
        with pytest.raises(ValueError, match="shape \\(3, 64\\)"):
            llm.update_weights([("model.norm.weight", torch.ones(64)), bad])
        assert greedy_tokens(llm, PROMPTS, GREEDY) == want
        assert llm.reload_weights() == len(load_file(first / "model.safetensors"))
        assert greedy_tokens(llm, PROMPTS, GREEDY) == before


def _perturbed_copy(src, dst) -> dict[str, torch.Tensor]:
    """A copy of the checkpoint at ``src`` with every tensor moved a little: its tensors."""
    shutil.copytree(src, dst)
    torch.manual_seed(1)
    tensors = {
        n: t + 0.05 * torch.randn_like(t) for n, t in load_file(src / "model.safetensors").items()
    }
    save_file(tensors, dst / "model.safetensors")
    return tensors


def test_mtp_head_is_updated_with_the_target(tmp_path):
    """Qwen3.5: its MTP head's tensors (in the target's checkpoint) go to the head, and the
    gated attention's loaded row order is redone over the new rows."""
    save_with_mtp("qwen3_5", tmp_path / "old")
    tensors = _perturbed_copy(tmp_path / "old", tmp_path / "new")
    options = dict(OPTIONS, block_size=4, max_num_batched_tokens=16)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(str(tmp_path / "old"), speculative_config=spec, **options)
    greedy_tokens(llm, PROMPTS, GREEDY)
    head = llm.engine.draft_runner.model
    before = [p.clone() for p in head.parameters()]
    llm.update_weights(tensors.items())
    assert not any(torch.equal(a, b) for a, b in zip(before, head.parameters()))
    want = greedy_tokens(LLM(str(tmp_path / "new"), **options), PROMPTS, GREEDY)
    assert_equal_up_to_exact_ties(str(tmp_path / "new"), greedy_tokens(llm, PROMPTS, GREEDY), want)


def test_draft_model_is_updated_apart(checkpoints, tmp_path):
    """``draft=True`` writes the draft model's tensors (named as its own checkpoint); the
    target's outputs stay plain greedy decoding's (HF's), across a sleep of both models."""
    first, _, _ = checkpoints
    draft = save_truncated_draft(first, tmp_path / "draft")
    tensors = _perturbed_copy(draft, tmp_path / "new_draft")
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    llm = LLM(str(first), speculative_config=spec, enable_sleep_mode=True, **OPTIONS)
    assert llm.update_weights(tensors.items(), draft=True) == len(tensors)
    llm.sleep(level=1)
    llm.wake_up()
    held = dict(llm.engine.draft_runner.model.named_parameters())
    assert torch.equal(held["model.norm.weight"], tensors["model.norm.weight"])
    hf = tf.AutoModelForCausalLM.from_pretrained(first, dtype=torch.float32)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == hf_greedy(hf, PROMPTS, GREEDY.max_tokens)
    plain = LLM(str(first), **OPTIONS)
    with pytest.raises(
        ValueError, match="cannot update weights of a draft model: the engine runs none"
    ):
        plain.update_weights(tensors.items(), draft=True)

"""Pooling models against sentence-transformers and HF transformers: embeddings (last-token and
mean pooling, normalisation, Matryoshka dimensions) and a sequence classifier's scores, over
chunked prefills, batched and one at a time."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from heron import LLM
from heron.pooler_config import PoolerConfig, pooler_config
from heron.pooling_params import PoolingParams

from tiny_models import CORPUS, POOLING, save_classifier, save_embedding_model, save_random_model

TEXTS = CORPUS[:4] + ["hi"]
QUERY = "What is the capital of France?"


def assert_close(got, want) -> None:
    got, want = (
        torch.as_tensor(got, dtype=torch.float32),
        torch.as_tensor(want, dtype=torch.float32),
    )
    assert F.cosine_similarity(got, want, dim=-1).min() >= 0.9999
    assert (got - want).abs().max() <= 1e-4


def assert_same(got, want) -> None:
    """Equal up to float32 rounding of another batch shape."""
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-6, rtol=0)


def vectors(outputs) -> list[list[float]]:
    assert all(o.error is None for o in outputs)
    return [o.data for o in outputs]


@pytest.fixture(scope="module")
def last_token(tmp_path_factory):
    """The engine (auto-detected as pooling; steps of 8 tokens, so prompts run in chunks) of a
    last-token, normalised embedding model, and its sentence-transformers reference."""
    path, pipeline = save_embedding_model(tmp_path_factory.mktemp("last"), "lasttoken", True)
    with LLM(str(path), max_num_batched_tokens=8) as llm:
        yield llm, pipeline


def test_last_token_embeddings_equal_sentence_transformers(last_token):
    llm, pipeline = last_token
    assert llm.engine.pooling.pooling_type == "last" and llm.engine.pooling.normalize
    want = pipeline.encode(TEXTS, convert_to_tensor=True)
    batched = vectors(llm.embed(TEXTS, use_tqdm=False))
    assert_close(batched, want)
    for i in (1, 4):  # one at a time (the second time from the prefix cache): the same
        assert_same(vectors(llm.embed(TEXTS[i])), batched[i : i + 1])
    # Matryoshka: the first 16 values, normalised again.
    short = vectors(llm.embed(TEXTS, dimensions=16, use_tqdm=False))
    assert_close(short, F.normalize(want[:, :16], dim=-1))
    raw = vectors(llm.embed(TEXTS[:1], normalize=False))
    assert abs(torch.tensor(raw).norm() - 1) > 1e-3
    assert_close(F.normalize(torch.tensor(raw), dim=-1), want[:1])


def test_embedding_model_scores_by_cosine(last_token):
    llm, pipeline = last_token
    query, docs = (pipeline.encode(t, convert_to_tensor=True) for t in ([QUERY], TEXTS))
    want = pipeline.similarity(query, docs)
    assert_close(llm.score(QUERY, TEXTS, use_tqdm=False), want[0])


def test_pooling_refusals(last_token, tiny_model_dir):
    llm, _ = last_token
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hi")
    with pytest.raises(ValueError, match="dimensions must be <= the embedding size 64"):
        llm.embed("hi", dimensions=65)
    with pytest.raises(ValueError, match="task 'classify' is not supported"):
        llm.classify("hi")
    (rejected,) = llm.embed([[]])
    assert rejected.error == "the prompt is empty"
    with LLM(str(tiny_model_dir("qwen3"))) as generator:
        with pytest.raises(ValueError, match="runner='pooling'"):
            generator.embed("hi")


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_mean_and_cls_pooling_equal_sentence_transformers(tmp_path, mode):
    """Pooling over chunks, without Normalize; a repeated prompt is computed again (these
    read every token, so nothing comes from the prefix cache)."""
    path, pipeline = save_embedding_model(tmp_path, mode, False, seed=1)
    texts = TEXTS + TEXTS[:1]
    with LLM(str(path), max_num_batched_tokens=8) as llm:
        assert llm.engine.pooling.pooling_type == mode and not llm.engine.pooling.normalize
        got = vectors(llm.embed(texts, use_tqdm=False))
        assert_same(vectors(llm.embed(texts[0])), got[:1])
    assert_close(got, pipeline.encode(texts, convert_to_tensor=True))


def test_causal_lm_checkpoint_as_embedding_model(tiny_model_dir):
    """A causal LM asked to pool: its last token's final hidden state, normalised; the LM
    head is not read."""
    path = tiny_model_dir("qwen3")
    hf = tf.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    with LLM(str(path), runner="pooling") as llm:
        got = vectors(llm.embed(TEXTS[:2], use_tqdm=False))
    with torch.no_grad():
        want = [hf(torch.tensor([tokenizer.encode(t)])).last_hidden_state[0, -1] for t in TEXTS[:2]]
    assert_close(got, F.normalize(torch.stack(want), dim=-1))


def test_classifier_scores_equal_hf_logits(tmp_path):
    path = save_classifier(tmp_path / "reranker", num_labels=1)
    hf = tf.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        logits = torch.stack(
            [hf(torch.tensor([tokenizer(QUERY, d)["input_ids"]])).logits[0, 0] for d in TEXTS]
        )
    with LLM(str(path), max_num_batched_tokens=8) as llm:
        assert llm.engine.pooling.num_labels == 1
        scores = llm.score(QUERY, TEXTS, use_tqdm=False)
        assert_same(llm.score(QUERY, TEXTS[1]), scores[1:2])
        rewards = vectors(llm.reward(TEXTS[:2], use_tqdm=False))
        with pytest.raises(ValueError, match="task 'embed' is not supported"):
            llm.embed("hi")
    assert_close(scores, logits.sigmoid())
    assert (
        sorted(range(len(TEXTS)), key=lambda i: -scores[i])
        == logits.argsort(descending=True).tolist()
    )
    with torch.no_grad():
        want = [hf(torch.tensor([tokenizer.encode(t)])).logits[0] for t in TEXTS[:2]]
    assert_close(rewards, torch.stack(want))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_classifier_probabilities_equal_hf(tmp_path, family):
    path = save_classifier(tmp_path / "classifier", num_labels=3, seed=2, family=family)
    hf = tf.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    with LLM(str(path)) as llm:
        got = vectors(llm.classify(TEXTS, use_tqdm=False))
    with torch.no_grad():
        want = [hf(torch.tensor([tokenizer.encode(t)])).logits[0].softmax(-1) for t in TEXTS]
    assert_close(got, torch.stack(want))


def save_reward_model(path):
    """A tiny reward model as Qwen2.5-Math-RM is saved (``Qwen2ForRewardModel``, whose code is
    remote: a Qwen2 decoder and ``score``: Linear, ReLU, Linear), and its head in plain torch."""
    from safetensors.torch import load_file, save_file

    save_random_model(tf.Qwen2Config(**POOLING), path, seed=3, auto_class="AutoModel")
    torch.manual_seed(4)
    hidden = POOLING["hidden_size"]
    head = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
    )
    weights = load_file(path / "model.safetensors")
    weights.update({f"score.{k}": v.clone() for k, v in head.state_dict().items()})
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen2ForRewardModel"]
    config["auto_map"] = {"AutoModel": "modeling_qwen2_rm.Qwen2ForRewardModel"}
    (path / "config.json").write_text(json.dumps(config))
    return head


def test_reward_model_head_equals_hf_hidden_states_through_it(tmp_path):
    """The reward: the head over HF's last hidden state at the last token (fp32); the model is
    detected as a pooling one, has one output, and serves its reward only."""
    head = save_reward_model(tmp_path)
    hf = tf.Qwen2Model.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        want = [
            head(hf(torch.tensor([tokenizer.encode(t)])).last_hidden_state[0, -1]) for t in TEXTS
        ]
    with LLM(str(tmp_path), max_num_batched_tokens=8) as llm:
        assert llm.engine.pooling.num_labels == 1 and llm.engine.pooling.reward_head
        got = vectors(llm.reward(TEXTS, use_tqdm=False))
        assert_same(vectors(llm.reward(TEXTS[2])), got[2:3])
        for refused in (llm.classify, llm.embed):
            with pytest.raises(ValueError, match="it serves encode"):
                refused("hi")
    assert_close(got, torch.stack(want))
    assert torch.tensor(got).std() > 1e-2  # rewards that differ between inputs


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # tied LM head, untied
def test_yes_no_reranker_scores_equal_hf_token_probabilities(tiny_model_dir, family):
    """A causal LM served as a reranker (Qwen3-Reranker's recipe, through ``hf_overrides``):
    its score is P(true) over the true and false tokens' logits at the pair's last token,
    HF's causal LM's; the LM head's other rows are not held."""
    path = tiny_model_dir(family)
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    false, true = tokenizer.convert_ids_to_tokens([40, 41])
    overrides = {
        "architectures": [f"{family.capitalize()}ForSequenceClassification"],
        "classifier_from_token": [false, true],
        "is_original_qwen3_reranker": True,
    }
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = torch.stack(
            [hf(torch.tensor([tokenizer(QUERY, d)["input_ids"]])).logits[0, -1] for d in TEXTS]
        )
    want = logits[:, [40, 41]].softmax(-1)[:, 1]
    with LLM(str(path), hf_overrides=overrides, max_num_batched_tokens=8) as llm:
        assert llm.engine.pooling.classifier_token_ids == (40, 41)
        assert llm.engine.runner.model.lm_head.weight.shape[0] == 2
        scores = llm.score(QUERY, TEXTS, use_tqdm=False)
    assert_close(scores, want)


def test_yes_no_reranker_options_are_checked(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    config = tf.AutoConfig.from_pretrained(path)
    for overrides, error in [
        ({"classifier_from_token": ["a", "b"]}, "with is_original_qwen3_reranker"),
        ({"classifier_from_token": ["a"], "is_original_qwen3_reranker": True}, "needs a"),
        (
            {
                "architectures": ["Qwen3ForSequenceClassification"],
                "classifier_from_token": ["not-a-token", "no"],
                "is_original_qwen3_reranker": True,
            },
            "'not-a-token' is not one token",
        ),
    ]:
        with pytest.raises(ValueError, match=error):
            pooler_config(path, tf.PretrainedConfig.from_dict({**config.to_dict(), **overrides}))
    with pytest.raises(ValueError, match="hf_overrides must map config attribute names"):
        LLM(str(path), hf_overrides=["architectures"])


def test_pooler_config_refuses_what_it_cannot_pool(tmp_path, tiny_model_dir):
    config = tf.BertConfig()
    config.architectures = ["BertModel"]
    with pytest.raises(ValueError, match="pooling is not supported for BertModel"):
        pooler_config(tmp_path, config)
    qwen3 = tf.AutoConfig.from_pretrained(tiny_model_dir("qwen3"))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="module sentence_transformers.models.Dense"):
        pooler_config(tmp_path, qwen3)
    # An older checkpoint's boolean pooling keys.
    modules[1] = {
        "idx": 1,
        "name": "1",
        "path": "1_Pooling",
        "type": "sentence_transformers.models.Pooling",
    }
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    assert pooler_config(tmp_path, qwen3).pooling_type == "cls"


def test_matryoshka_dimensions_the_config_lists():
    pooler = PoolerConfig("last", True, None, 64, matryoshka_dimensions=(16, 32))
    pooler.check(PoolingParams("embed", dimensions=32))
    with pytest.raises(ValueError, match="one of the model's Matryoshka dimensions 16, 32"):
        pooler.check(PoolingParams("embed", dimensions=24))
    with pytest.raises(ValueError, match="dimensions applies to task 'embed'"):
        PoolingParams("classify", dimensions=16)

"""A model registered from outside the package (``heron.models.register_model``) whose attention
operator declares no metadata builder: it runs on the compatibility fallback, says so in
``heron plan`` and the start-up log, and matches HF transformers."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
import transformers as tf
from torch import nn

from heron import LLM, SamplingParams
from heron.cli import main
from heron.models import register_model
from heron.ops.attention.base import AttentionSpec
from heron.ops.attention.reference import ReferenceAttention

from tiny_models import greedy_tokens, hf_greedy

ARCHITECTURE = "OutOfTreeMistralForCausalLM"
MAX_NEW = 12
# The last prompt crosses the model's 24-token window several times.
PROMPTS = [[3, 4], list(range(10, 50)), [(i * 37) % 300 + 5 for i in range(70)]]


class PlainAttention(ReferenceAttention):
    """Attention written against the paged view, declaring no builder of its own."""

    def metadata_builder(self):
        return None


class Layer(nn.Module):
    def __init__(self, config, runtime, prefix: str) -> None:
        super().__init__()
        from heron.layers.rotary import QKTransform, RotaryEmbedding

        hidden, heads, kv_heads = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        self.head_dim = hidden // heads
        self.input_layernorm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = nn.Module()
        for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads), ("o", None)):
            width = (rows or heads) * self.head_dim
            shape = (width, hidden) if rows else (hidden, width)
            setattr(self.self_attn, f"{name}_proj", nn.Linear(*shape[::-1], bias=False))
        spec = AttentionSpec(
            heads, kv_heads, self.head_dim, self.head_dim**-0.5, config.sliding_window
        )
        rotary = RotaryEmbedding(config, self.head_dim, config.max_position_embeddings)
        self.self_attn.attn = PlainAttention(
            f"{prefix}.self_attn.attn",
            spec,
            runtime.block_size,
            runtime.max_model_len,
            qk_transform=QKTransform(rotary),
            build_context=runtime.build_context,
        )
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        h = self.input_layernorm(x)
        qkv = torch.cat([a.q_proj(h), a.k_proj(h), a.v_proj(h)], dim=-1)
        x = x + a.o_proj(a.attn(qkv))
        h = self.post_attention_layernorm(x)
        m = self.mlp
        return x + m.down_proj(nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))


class OutOfTreeMistral(nn.Module):
    """Mistral written with plain torch modules, outside Heron's model families."""

    def __init__(self, config, runtime) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(
            Layer(config, runtime, f"model.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.model.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(token_ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


@pytest.fixture(scope="module")
def out_of_tree_dir(tiny_model_dir, tmp_path_factory):
    source = tiny_model_dir("mistral")
    path = tmp_path_factory.mktemp("out_of_tree")
    shutil.copytree(source, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [ARCHITECTURE]
    (path / "config.json").write_text(json.dumps(config))
    register_model(ARCHITECTURE, OutOfTreeMistral)
    return source, path


def test_runs_on_the_fallback_and_matches_hf(out_of_tree_dir, caplog):
    source, path = out_of_tree_dir
    hf = tf.MistralForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with caplog.at_level(logging.WARNING, logger="heron"):
        llm = LLM(str(path), max_model_len=128, max_num_seqs=4)
    assert "compatibility fallback" in caplog.text and "PlainAttention" in caplog.text
    (group,) = llm.engine.runner.plan.groups
    assert group.is_fallback and len(group.layers) == 3
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    assert greedy_tokens(llm, PROMPTS, params) == hf_greedy(hf, PROMPTS, MAX_NEW)


def test_plan_names_the_fallback_and_its_reason(out_of_tree_dir, capsys):
    _, path = out_of_tree_dir
    assert main(["plan", "--model", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert "PlainAttention" in plan["fallback_reason"]
    assert [g["fallback"] for g in plan["groups"]] == [True]


def test_registering_something_else_is_refused():
    with pytest.raises(TypeError, match="not an nn.Module class"):
        register_model("Nothing", object)

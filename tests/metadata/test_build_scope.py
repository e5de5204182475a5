"""The model-build scope: registration rules, worker threads, build_model returns its plan
beside the model (a build that raises returns none, and holds no runner to leave one in), and the no-op platform that runs every operator on the compatibility fallback."""

from __future__ import annotations

import json
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

from heron.config import ModelConfig
from heron.metadata import (
    GraphSupport,
    MetadataOperator,
    ModelBuildContext,
    StepMetadataError,
    StepMetaPlan,
    current_build_context,
)
from heron.models.build import build_model
from heron.ops.attention.base import AttentionSpec
from heron.ops.attention.reference import ReferenceAttention
from heron.platforms import CpuPlatform, Platform

CPU = torch.device("cpu")
SPEC = AttentionSpec(4, 2, 16, 0.25)


def make_attention(name: str) -> ReferenceAttention:
    return ReferenceAttention(name, SPEC, 16, 64)


# --------------------------------------------------------------------------- registration


def test_construction_outside_a_scope_raises_naming_the_layer():
    with pytest.raises(StepMetadataError, match=r"model\.layers\.3\.self_attn\.attn"):
        make_attention("model.layers.3.self_attn.attn")

    class Custom(MetadataOperator):
        pass

    with pytest.raises(StepMetadataError, match="custom.layer"):
        Custom("custom.layer")


def test_scope_is_gone_after_exit_and_cannot_be_reentered():
    with ModelBuildContext() as scope:
        inside = make_attention("layers.0.attn")
        assert current_build_context("x") is scope
    assert scope.operators == [inside]
    with pytest.raises(StepMetadataError, match="layers.1.attn"):
        make_attention("layers.1.attn")
    with scope, pytest.raises(StepMetadataError, match="entered twice"):
        scope.__enter__()


def test_explicit_build_context_needs_no_ambient_scope():
    scope = ModelBuildContext()
    op = ReferenceAttention("layers.0.attn", SPEC, 16, 64, build_context=scope)
    assert scope.operators == [op]


def test_nested_scopes_register_in_the_innermost_and_restore_the_outer():
    with ModelBuildContext() as outer:
        a = make_attention("a")
        with ModelBuildContext() as inner:
            b = make_attention("b")
        c = make_attention("c")
    assert outer.operators == [a, c] and inner.operators == [b]


def test_non_collecting_scope_accepts_and_records_nothing():
    with ModelBuildContext(collecting=False) as scope:
        make_attention("layers.0.attn")
    assert scope.operators == []


# --------------------------------------------------------------------------- worker threads


def test_operators_built_in_thread_pool_workers_land_in_the_scope():
    with ModelBuildContext() as scope, ThreadPoolExecutor(max_workers=2) as pool:
        main = make_attention("layers.0.attn")
        submitted = [scope.submit(pool, make_attention, f"layers.{i}.attn") for i in (1, 2)]
        wrapped = pool.submit(scope.wrap(make_attention), "layers.3.attn")
        workers = [f.result() for f in submitted] + [wrapped.result()]
        # The same pool without the scope attached: the worker's context has no scope.
        plain = pool.submit(make_attention, "layers.4.attn")
        with pytest.raises(StepMetadataError, match=r"layers\.4\.attn"):
            plain.result()
    registered = scope.operators
    assert set(map(id, registered)) == set(map(id, [main, *workers]))
    assert sorted(op.layer_name for op in registered) == [f"layers.{i}.attn" for i in range(4)]
    plan = StepMetaPlan.from_operators(registered)
    assert all(op.group is plan.groups[0] for op in [main, *workers])


def test_wrap_outside_the_scope_raises():
    scope = ModelBuildContext()
    with pytest.raises(StepMetadataError, match="inside the scope"):
        scope.wrap(make_attention)


# --------------------------------------------------------------------------- build_model


def _copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def _model_config(path) -> ModelConfig:
    return ModelConfig.from_path(path, "float32", CPU, 64)


def test_successful_build_returns_a_covering_plan(tiny_model_dir):
    model, plan = build_model(
        _model_config(tiny_model_dir("llama")), CpuPlatform(CPU), "reference", 16
    )
    assert plan is not None
    assert plan.fallback_reason is None and len(plan.groups) == 1
    assert plan.groups[0].layers == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    plan.check_coverage(model)


def test_broken_checkpoint_leaves_no_plan(tiny_model_dir, tmp_path):
    path = _copy_model(tiny_model_dir("llama"), tmp_path / "broken")
    tensors = load_file(path / "model.safetensors")
    dropped = "model.layers.1.mlp.down_proj.weight"
    del tensors[dropped]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        build_model(_model_config(path), CpuPlatform(CPU), "reference", 16)


def test_failure_while_constructing_operators_leaves_no_plan(tiny_model_dir):
    config = _model_config(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="attention_backend .no-such-backend. has no attention"):
        build_model(config, CpuPlatform(CPU), "no-such-backend", 16)
    # ... and the failed build's scope did not leak into this thread.
    with pytest.raises(StepMetadataError):
        make_attention("after.failure")


def test_unsupported_architecture_lists_supported_and_leaves_no_plan(tiny_model_dir, tmp_path):
    path = _copy_model(tiny_model_dir("llama"), tmp_path / "alien")
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["AlienForCausalLM"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="AlienForCausalLM") as info:
        build_model(_model_config(path), CpuPlatform(CPU), "reference", 16)
    message = str(info.value)
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert supported in message


# --------------------------------------------------------------------------- no-op platform


def test_base_platform_runs_every_operator_on_the_fallback(tiny_model_dir, caplog):
    from heron.execution.model_runner import ModelRunner

    config = _model_config(tiny_model_dir("mistral"))
    with caplog.at_level(logging.WARNING, logger="heron"):
        runner = ModelRunner(config, Platform(CPU), 16, "reference", seed=0)
    plan = runner.plan
    assert len(plan.groups) == 1
    (group,) = plan.groups
    assert group.is_fallback
    assert group.layers == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert "'base'" in plan.fallback_reason
    # The compatibility builder takes the window from the model configuration.
    assert group.builder.sliding_window == 24 and group.builder.block_size == 16
    assert plan.graph_support is GraphSupport.DECODE_ONLY
    assert plan.describe()["fallback_reason"] == plan.fallback_reason
    plan.check_coverage(runner.model)
    assert [r.getMessage() for r in caplog.records if plan.fallback_reason in r.getMessage()]

    cpu_runner = ModelRunner(config, CpuPlatform(CPU), 16, "reference", seed=0)
    assert cpu_runner.plan.fallback_reason is None
    assert not any(g.is_fallback for g in cpu_runner.plan.groups)


def test_generation_on_the_base_platform_matches_the_cpu_platform(tiny_model_dir, monkeypatch):
    import heron.engine.resolved_config as resolved_config
    from heron import LLM, SamplingParams

    path = str(tiny_model_dir("mistral"))
    # Longer than Mistral's 24-token window: the fallback's window is exercised.
    prompts = [[(i * 37) % 300 + 5 for i in range(40)], [3, 4, 5]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    options = dict(device="cpu", max_model_len=64, max_num_seqs=4, enable_prefix_caching=False)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = tokens(LLM(path, **options))
    monkeypatch.setattr(resolved_config, "platform_for", lambda device: Platform(device))
    llm = LLM(path, **options)
    assert type(llm.engine.platform) is Platform
    assert llm.engine.runner.plan.groups[0].is_fallback
    assert tokens(llm) == expected

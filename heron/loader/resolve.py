"""From what a user passes as ``model`` to a local HF-format directory."""

from __future__ import annotations

from pathlib import Path

from heron.loader.gguf import default_model_file, resolve_gguf
from heron.loader.hub import download, is_hub_id


def resolve_model_path(model: str | Path | None, revision: str | None = None) -> Path:
    """``None``: the embedded default model; a ``.gguf`` file: its converted (cached) copy;
    a directory: itself; a Hugging Face Hub id (``owner/name``, ``owner/name:file.gguf``) that
    is no local path: its files through the hub cache (``revision`` applies to hub ids only).
    Anything else is an error that says what is accepted."""
    if model is None:
        return resolve_gguf(default_model_file())
    path = Path(model).expanduser()
    if not path.exists() and is_hub_id(str(model)):
        path = download(str(model), revision)
    if path.is_file() and path.suffix == ".gguf":
        return resolve_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {str(model)!r} is neither a Hugging Face model directory (with config.json), "
        "a .gguf file, nor a Hugging Face Hub id (owner/name or owner/name:file.gguf)"
    )

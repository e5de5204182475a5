"""From what a user passes as ``model`` to a local HF-format directory."""

from __future__ import annotations

from pathlib import Path

from heron.loader.gguf import default_model_file, resolve_gguf


def resolve_model_path(model: str | Path | None) -> Path:
    """``None``: the embedded default model; a ``.gguf`` file: its converted (cached) copy;
    a directory: itself. Anything else is an error that says what is accepted."""
    if model is None:
        return resolve_gguf(default_model_file())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return resolve_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {str(model)!r} is neither a Hugging Face model directory (with config.json) nor "
        "a .gguf file; Heron loads local checkpoints only (no hub downloads)"
    )

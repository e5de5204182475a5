"""Reading HF safetensors checkpoints, single-file or sharded with an index."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.glob("*.bin")) or sorted(
            p.name for p in path.iterdir()
        )
        raise ValueError(
            f"no *.safetensors checkpoint in {path} (found: {', '.join(others) or 'nothing'}); "
            "Heron loads safetensors and GGUF files"
        )
    return files


def iterate_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint in ``path``, one file open at a time."""
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from e

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


class LazyTensor:
    """A checkpoint tensor not read yet: :meth:`narrow` as a tensor's, then :meth:`load` reads
    only the part left (a tensor-parallel rank's rows), straight from the file."""

    def __init__(self, source, index: tuple[slice, ...] | None = None) -> None:
        self._source = source  # a safetensors slice, valid while its file is open
        self._index = index or tuple(slice(0, n) for n in source.get_shape())

    @property
    def shape(self) -> torch.Size:
        return torch.Size(s.stop - s.start for s in self._index)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(
                f"rows [{start}, {start + length}) of dimension {dim} are outside a checkpoint "
                f"tensor of shape {tuple(self.shape)}"
            )
        first = self._index[dim].start + start
        index = list(self._index)
        index[dim] = slice(first, first + length)
        return LazyTensor(self._source, tuple(index))

    def load(self) -> torch.Tensor:
        return self._source[self._index]


def materialize(tensor: torch.Tensor | LazyTensor | tuple) -> torch.Tensor:
    """The tensor, read if lazy; a tuple of parts (runs of one tensor's rows) read and joined."""
    if isinstance(tensor, tuple):
        return torch.cat([materialize(part) for part in tensor])
    return tensor.load() if isinstance(tensor, LazyTensor) else tensor


def iterate_weights(
    path: Path, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Every (name, tensor) of the checkpoint in ``path``, one file open at a time; ``lazy``
    tensors are read only as far as the loader takes them (tensor-parallel shards)."""
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, LazyTensor(f.get_slice(name)) if lazy else f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from e

"""Weight updates in place (a trainer's new weights, a re-read checkpoint): tensors in the
checkpoint's naming written into a built model and its MTP head, every tensor checked before
any is written.

The check is a dry run of the loading itself (names, renames, packing, shapes) under
:class:`FakeTensorMode`, where copies into the parameters change nothing; only a run that
raised nothing is repeated for real. Parameters keep their storage (graphs stay valid)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from heron.loader.safetensors import LazyTensor, iterate_weights
from heron.loader.weights import load_weights

Weights = Iterable[tuple[str, torch.Tensor | LazyTensor]]


@dataclass(frozen=True)
class WeightSource:
    """Where an update's tensors come from: ``tensors`` (full ones, in the checkpoint's
    naming) or a checkpoint directory ``path``, read lazily. Plain data, so tensor-parallel
    ranks receive it and each writes its own shards."""

    tensors: list[tuple[str, torch.Tensor]] | None = None
    path: str | None = None

    def read(self) -> Weights:
        if self.path is not None:
            return iterate_weights(Path(self.path), lazy=True)
        return iter(self.tensors or ())

    def only(self, names: set[str]) -> WeightSource:
        """The tensors named ``names`` (all of a directory's that another model does not take:
        a reader skips the names it does not load), on the host."""
        if self.path is not None:
            return self
        return WeightSource([(n, t.cpu()) for n, t in self.tensors or () if n in names])


def update_weights(models: Sequence[nn.Module], source: Callable[[], Weights]) -> int:
    """Write the tensors ``source()`` yields (a subset of the checkpoint's, full tensors)
    into ``models`` (the target first: each tensor goes to the first model that loads it, so
    an MTP head takes its own), then redo the ``finish_loading`` layouts of the modules they
    touched. Raises ``ValueError`` naming the first unknown, misshapen or non-floating tensor
    with every weight left as it was. ``source`` is called twice (the check, the writes).
    Returns the number of tensors written."""
    routes = plan_update(models, source())
    apply_update(models, routes, source)
    return sum(len(route.names) for route in routes)


def plan_update(models: Sequence[nn.Module], weights: Weights) -> list[UpdateRoute]:
    """The dry run: which model loads each tensor; raises as the real loading would."""
    routes = []
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        # Fakes of the given tensors too: a copy between two real tensors would be real.
        pending = [(name, _checked(name, tensor, mode)) for name, tensor in weights]
        for model in models:
            loaded = load_weights(model, pending, complete=False)
            skipped = set(loaded.skipped)
            routes.append(
                UpdateRoute({n for n, _ in pending if n not in skipped}, loaded.parameters)
            )
            pending = [(n, t) for n, t in pending if n in skipped]
            _finishing_modules(_touched(model, loaded.parameters))  # (refuses what it cannot redo)
    return routes


def apply_update(
    models: Sequence[nn.Module], routes: Sequence[UpdateRoute], source: Callable[[], Weights]
) -> None:
    """The writes :func:`plan_update` checked."""
    for model, route in zip(models, routes):
        if not route.names:
            continue
        touched = _touched(model, route.parameters)
        finishing = _finishing_modules(touched)
        requantized = [
            (module, module.weight_block, dict(module.named_parameters(recurse=False)))
            for _, module in touched
            if getattr(module, "loaded_dtype", None) is not None
        ]
        for module in finishing:
            module.undo_finish_loading()
        for module, _, _ in requantized:
            module.dequantize_fp8(module.loaded_dtype)
        load_weights(model, ((n, t) for n, t in source() if n in route.names), complete=False)
        for module in finishing:
            module.finish_loading()
        for module, block, held in requantized:
            _quantize_into(module, block, held)


def _quantize_into(module: nn.Module, block: tuple[int, int] | None, held: dict) -> None:
    """Quantise ``module``'s updated weights to FP8 again, into the tensors it ``held``
    before the update (graphs captured over them stay valid)."""
    module.quantize_fp8(block)
    for name, param in held.items():
        new = getattr(module, name)
        if new is not param:
            param.data.copy_(new.data)
            setattr(module, name, param)


class UpdateRoute:
    """The tensors (checkpoint names) one model loads, and its parameters they fill."""

    def __init__(self, names: set[str], parameters: set[str]) -> None:
        self.names = names
        self.parameters = parameters


def _checked(name: str, tensor: object, mode: FakeTensorMode) -> torch.Tensor:
    """``tensor`` as the dry run reads it: a fake of its shape and dtype."""
    if isinstance(tensor, LazyTensor):
        return torch.empty(tensor.shape)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"weight {name!r}: expected a tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(f"weight {name!r}: dtype {tensor.dtype} is not a floating-point type")
    return mode.from_tensor(tensor)


def _touched(model: nn.Module, parameters: set[str]) -> list[tuple[str, nn.Module]]:
    """The modules holding any of ``parameters`` (or holding modules that do), by name."""
    return [
        (prefix, module)
        for prefix, module in model.named_modules()
        if any(p.startswith(f"{prefix}.") for p in parameters)
    ]


def _finishing_modules(touched: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The ``touched`` modules (:func:`_touched`) with a ``finish_loading`` layout."""
    found = []
    for prefix, module in touched:
        if hasattr(module, "finish_loading"):
            if not hasattr(module, "undo_finish_loading"):
                raise ValueError(
                    f"{prefix} ({type(module).__name__}) cannot be updated in place: its "
                    "loaded layout has no inverse"
                )
            found.append(module)
    return found

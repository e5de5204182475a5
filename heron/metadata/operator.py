"""Base class of operators that own per-step metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from heron.metadata.errors import StepMetadataError
from heron.metadata.scope import ModelBuildContext, current_build_context

if TYPE_CHECKING:
    from heron.cache.spec import CacheSpec
    from heron.metadata.builder import MetadataBuilder
    from heron.metadata.plan import MetadataGroup


class MetadataOperator(nn.Module):
    """An operator that reads its per-step metadata from its group's view.

    It registers with the build scope on construction (explicitly passed or the ambient one),
    and is bound to a group once the plan validated. ``metadata_builder`` returns the builder
    describing what metadata it needs; an operator that returns ``None`` runs on the
    compatibility fallback.
    """

    def __init__(self, layer_name: str, build_context: ModelBuildContext | None = None) -> None:
        super().__init__()
        self.layer_name = layer_name
        self._group: MetadataGroup | None = None
        (build_context or current_build_context(layer_name)).register(self)

    def metadata_builder(self) -> MetadataBuilder | None:
        return None

    @property
    def cache_spec(self) -> CacheSpec | None:
        """The cache this operator needs (``None``: none); equal specs share one cache group."""
        return None

    def bind_cache(self, cache: Any) -> None:
        """Receive the cache tensor sized by the spec's pool (``None`` unbinds it)."""
        raise NotImplementedError(f"{type(self).__name__} declares a cache but takes none")

    def bind(self, group: MetadataGroup) -> None:
        self._group = group

    @property
    def group(self) -> MetadataGroup | None:
        return self._group

    @property
    def view(self) -> Any:
        """This step's metadata for this operator's group."""
        if self._group is None:
            raise StepMetadataError(f"operator of layer {self.layer_name!r} is not bound to a plan")
        return self._group.view

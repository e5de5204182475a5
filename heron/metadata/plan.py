"""StepMetaPlan: operators grouped by metadata configuration, one builder per group."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from torch import nn

from heron.metadata.builder import GraphSupport, MetadataBuilder
from heron.metadata.errors import StepMetadataError
from heron.metadata.group import MetadataGroup
from heron.metadata.operator import MetadataOperator
from heron.metadata.sequence import SequenceMetadata


class StepMetaPlan:
    """The resolved plan: which group (and builder) serves which operator."""

    def __init__(self, groups: list[MetadataGroup], fallback_reason: str | None = None) -> None:
        self.groups = groups
        self.fallback_reason = fallback_reason

    @classmethod
    def from_operators(
        cls,
        operators: Iterable[MetadataOperator],
        fallback_builder: Callable[[], MetadataBuilder] | None = None,
        fallback_reason: str | None = None,
    ) -> StepMetaPlan:
        """Group ``operators`` by builder key, validate, then bind each to its group.

        Operators without a builder (or every operator, when ``fallback_reason`` is given)
        go to one fallback group whose builder derives metadata from the model configuration.
        Nothing is bound unless the whole set validated.
        """
        operators = list(operators)
        by_key: dict[Hashable, MetadataGroup] = {}
        assignment: list[tuple[MetadataOperator, MetadataGroup | None]] = []
        seen_layers: set[str] = set()
        for op in operators:
            if op.layer_name in seen_layers:
                raise StepMetadataError(f"two operators registered for layer {op.layer_name!r}")
            seen_layers.add(op.layer_name)
            builder = None if fallback_reason else op.metadata_builder()
            if builder is None:
                assignment.append((op, None))
                continue
            if not isinstance(builder, MetadataBuilder):
                raise StepMetadataError(
                    f"layer {op.layer_name!r}: metadata_builder() returned "
                    f"{type(builder).__name__}, not a MetadataBuilder"
                )
            key = builder.key
            try:
                hash(key)
            except TypeError as e:
                raise StepMetadataError(
                    f"layer {op.layer_name!r}: builder key {key!r} is not hashable"
                ) from e
            group = by_key.get(key)
            if group is None:
                group = by_key[key] = MetadataGroup(len(by_key), builder)
            assignment.append((op, group))

        groups = list(by_key.values())
        orphans = [op for op, group in assignment if group is None]
        if orphans:
            if fallback_builder is None:
                names = ", ".join(op.layer_name for op in orphans)
                raise StepMetadataError(f"no builder and no fallback for layers: {names}")
            fallback = MetadataGroup(len(groups), fallback_builder(), is_fallback=True)
            groups.append(fallback)
            if fallback_reason is None:
                kinds = sorted({type(op).__name__ for op in orphans})
                fallback_reason = (
                    f"{len(orphans)} operator(s) of type {', '.join(kinds)} have no metadata "
                    "builder; their metadata is derived from the model configuration"
                )

        # Everything validated: only now bind.
        for op, group in assignment:
            group = group or groups[-1]
            group.layers.append(op.layer_name)
            op.bind(group)
        return cls(groups, fallback_reason if orphans else None)

    @property
    def graph_support(self) -> GraphSupport:
        """The weakest graph support over all groups (``NEVER`` for an empty plan)."""
        return min((g.builder.graph_support for g in self.groups), default=GraphSupport.NEVER)

    def check_coverage(self, model: nn.Module) -> None:
        """Raise naming the layer if any operator in ``model`` is not bound to this plan."""
        own = set(map(id, self.groups))
        for module in model.modules():
            if isinstance(module, MetadataOperator) and id(module.group) not in own:
                raise StepMetadataError(
                    f"operator of layer {module.layer_name!r} ({type(module).__name__}) is not "
                    "bound to the model's metadata plan; was it built outside the build scope?"
                )

    def build_views(self, seq: SequenceMetadata) -> None:
        """Eager step: every group's builder turns ``seq`` into that group's view."""
        for group in self.groups:
            group.view = group.builder.build(seq)

    def describe(self) -> dict[str, Any]:
        return {
            "groups": [g.describe() for g in self.groups],
            "fallback_reason": self.fallback_reason,
        }

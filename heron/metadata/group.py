"""A metadata group: operators sharing one metadata configuration, and their step's view."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from heron.metadata.builder import MetadataBuilder


def _json_value(value: Any) -> Any:
    """``value`` as JSON data: sequences become lists, what JSON lacks becomes its repr."""
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


@dataclass(eq=False)
class MetadataGroup:
    """Operators sharing one metadata configuration; ``view`` is this step's metadata."""

    group_id: int
    builder: MetadataBuilder
    layers: list[str] = field(default_factory=list)
    is_fallback: bool = False
    view: Any = None

    def describe(self) -> dict[str, Any]:
        """JSON data; ``cache_group`` is the cache group whose tables the builder reads."""
        return {
            "group": self.group_id,
            "builder": self.builder.describe(),
            "key": _json_value(self.builder.key),
            "cache_group": getattr(self.builder, "cache_group", None),
            "layers": list(self.layers),
            "graph_support": self.builder.graph_support.name,
            "fallback": self.is_fallback,
        }

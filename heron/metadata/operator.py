"""Operators that own per-step metadata, and the model-build scope they register with while a
model is built."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any, TypeVar

from torch import nn

from heron.metadata.errors import StepMetadataError

if TYPE_CHECKING:
    from heron.cache.spec import CacheSpec
    from heron.metadata.builder import MetadataBuilder
    from heron.metadata.group import MetadataGroup

T = TypeVar("T")

# The one deliberate module-level context variable (DESIGN §7): it is set only inside
# ``with ModelBuildContext()`` and reset on exit, so nothing leaks between builds.
_current_scope: contextvars.ContextVar[ModelBuildContext | None] = contextvars.ContextVar(
    "heron_model_build_scope", default=None
)


class ModelBuildContext:
    """Collects the operators a model instantiates while it is being built.

    Use it as a context manager around model construction; operators find it through
    :func:`current_build_context` or receive it explicitly. Work in other threads sees the scope
    only when started through :meth:`submit` or :meth:`wrap` (a copy of the current context runs
    the function), because a plain thread starts with an empty context and would otherwise lose
    its registrations; those raise :class:`StepMetadataError` instead of vanishing.

    A context with ``collecting=False`` accepts registrations and records none: platforms
    without metadata support use it, and the engine then runs every operator on the
    compatibility fallback.
    """

    def __init__(self, collecting: bool = True) -> None:
        self.collecting = collecting
        self._operators: list[MetadataOperator] = []
        self._lock = threading.Lock()
        self._token: contextvars.Token | None = None

    def __enter__(self) -> ModelBuildContext:
        if self._token is not None:
            raise StepMetadataError("a ModelBuildContext cannot be entered twice")
        self._token = _current_scope.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _current_scope.reset(self._token)
        self._token = None

    @property
    def operators(self) -> list[MetadataOperator]:
        with self._lock:
            return list(self._operators)

    def register(self, operator: MetadataOperator) -> None:
        if self.collecting:
            with self._lock:
                self._operators.append(operator)

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` bound to a copy of the current context, to run in any thread."""
        if self._token is None:
            raise StepMetadataError("ModelBuildContext.wrap must be called inside the scope")
        context = contextvars.copy_context()
        return lambda *args, **kwargs: context.run(fn, *args, **kwargs)

    def submit(self, executor: Executor, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
        """Run ``fn`` in ``executor`` with this scope attached."""
        return executor.submit(self.wrap(fn), *args, **kwargs)


def current_build_context(operator_name: str) -> ModelBuildContext:
    """The active build scope; raises naming the operator when there is none."""
    scope = _current_scope.get()
    if scope is None:
        raise StepMetadataError(
            f"operator {operator_name!r} was constructed outside a model build scope; build "
            "models inside `with ModelBuildContext():` (in worker threads use "
            "ModelBuildContext.submit/wrap) so that its step metadata is not lost"
        )
    return scope


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

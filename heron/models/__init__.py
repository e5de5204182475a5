"""Model families, and the registry that maps a checkpoint's architecture to one."""

from heron.models.registry import register_model

__all__ = ["register_model"]

"""Operator-owned step metadata: build scope, registration, plan, shared sequence metadata."""

from heron.metadata.builder import GraphSupport, MetadataBuilder
from heron.metadata.errors import StepMetadataError
from heron.metadata.group import MetadataGroup
from heron.metadata.operator import MetadataOperator, ModelBuildContext, current_build_context
from heron.metadata.plan import StepMetaPlan
from heron.metadata.sequence import SequenceMetadata, StepBatch

__all__ = [
    "GraphSupport",
    "MetadataBuilder",
    "MetadataGroup",
    "MetadataOperator",
    "ModelBuildContext",
    "SequenceMetadata",
    "StepBatch",
    "StepMetaPlan",
    "StepMetadataError",
    "current_build_context",
]

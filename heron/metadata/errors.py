"""Errors of the step-metadata machinery."""


class StepMetadataError(RuntimeError):
    """An operator's metadata cannot be provided: lost registration, unbound operator, bad plan."""

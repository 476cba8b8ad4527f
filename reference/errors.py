"""Typed errors raised by the reference for bad user input.

Contract: every error a user can cause (a missing or malformed checkpoint, mismatched draft and
target, a bad budget, an unknown model type, a prompt longer than the context) raises a subclass
of :class:`ReferenceInputError` with a message that names the offending path or value. Bugs in
the reference itself are not wrapped: they surface as ordinary exceptions.
"""

from __future__ import annotations


class ReferenceInputError(ValueError):
    """Base class: the inputs given to the reference are unusable."""


class CheckpointError(ReferenceInputError):
    """A model or draft checkpoint directory is missing, incomplete or malformed."""


class ModelMismatchError(ReferenceInputError):
    """Draft and target disagree (vocabulary, hidden size, layer ids)."""


class UnsupportedModelError(ReferenceInputError):
    """The checkpoint's model type is not one the reference implements."""


class PromptError(ReferenceInputError):
    """A prompt is empty, has out-of-vocabulary ids, or does not fit the context."""


class BudgetError(ReferenceInputError):
    """A node budget or block size is out of range."""


class SamplingError(ReferenceInputError):
    """Sampling parameters out of range: temperature < 0, top-p outside (0, 1], top-k < 0, a bad seed."""

"""Typed errors raised by the reference for bad user input.

Contract: every error a user can cause (a missing or malformed checkpoint, one whose tensors do not
match its model, mismatched draft and target, a bad budget, an unknown model type, a prompt longer than the context) raises a subclass
of :class:`ReferenceInputError` with a message that names the offending path or value. Bugs in
the reference itself are not wrapped: they surface as ordinary exceptions.
"""

from __future__ import annotations

from collections.abc import Sequence


class ReferenceInputError(ValueError):
    """Base class: the inputs given to the reference are unusable."""


class CheckpointError(ReferenceInputError):
    """A model or draft checkpoint directory is missing, incomplete or malformed."""


class CheckpointTensorsError(CheckpointError):
    """A checkpoint's tensors do not match its model: missing, unexpected, of the wrong shape or of a
    non-floating-point dtype (ddtree_reference/checkpoint.py); the lists name them, the message the first few."""

    def __init__(self, message: str, missing: Sequence[str] = (), unexpected: Sequence[str] = (),
                 wrong_shape: Sequence[str] = (), wrong_dtype: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.missing, self.unexpected = list(missing), list(unexpected)
        self.wrong_shape, self.wrong_dtype = list(wrong_shape), list(wrong_dtype)


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

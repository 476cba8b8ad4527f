"""User-facing errors of refcheck and their exit codes.

Contract: every failure a user can cause maps to one :class:`RefcheckError` subclass with a
specific message and a distinct exit code; the CLI prints the message (no traceback) and exits
with the code. Codes follow pytest's spirit:

==== =====================================================================
0    pass
1    mismatch found (tokens, logprobs, acceptance, state) / AR check failed
2    usage: bad option, malformed prompts file (text prompts for a model
     directory without a tokenizer or chat template: :class:`TokenizerError`), bad budget (also one too big
     for the context or the memory), bad prompt, a case name that is not a
     plain name, an output path or golden directory that cannot be written
     (:class:`OutputPathError`, checked before any work); sampling parameters
     out of range (temperature < 0, top-p outside (0, 1], top-k < 0:
     ``ddtree_reference.errors.SamplingError``); temperature > 0 for an engine that
     cannot sample
3    missing or stale golden trace; a golden directory locked by another
     writer past the wait (:class:`GoldenLockError`)
4    corrupt trace: bad magic, truncated, checksum mismatch (naming the
     record batch), schema error, malformed content (tree, step numbers,
     token ids: naming request, step and node), malformed manifest/journal
5    nothing compared; or a statistical verdict is INCONCLUSIVE: the sample
     cannot reach the stated power (``refcheck diff`` at temperature > 0 on an
     engine that hides its randomness: refcheck/diff/distribution.py;
     ``refcheck baseline``). A failure (1) takes precedence.
6    model error: checkpoint missing or malformed (garbage safetensors),
     draft/target mismatch (layer count, layer ids, widths, vocabulary),
     unsupported model type, NaN/Inf in weights or log-probs
     (:class:`NonFiniteError`, naming the model and tensor or the prompt)
7    a worker process refcheck started died while it ran (killed by a signal:
     the kernel's out-of-memory killer sends SIGKILL): :class:`WorkerDiedError`,
     naming the processes and how each ended; nothing is judged
==== =====================================================================
"""

from __future__ import annotations

from ddtree_reference.errors import (
    BudgetError,
    CheckpointError,
    ModelMismatchError,
    PromptError,
    ReferenceInputError,
    UnsupportedModelError,
)

EXIT_PASS, EXIT_MISMATCH, EXIT_USAGE, EXIT_GOLDEN, EXIT_CORRUPT, EXIT_NOTHING, EXIT_MODEL, EXIT_WORKER = range(8)


class RefcheckError(Exception):
    exit_code = EXIT_USAGE


class UsageError(RefcheckError):
    exit_code = EXIT_USAGE


class PromptsFileError(UsageError):
    """The prompts file is missing or not valid JSONL of the documented shape."""


class TokenizerError(UsageError):
    """A prompts file gives text (``prompt`` / ``messages``) but the target's directory has no tokenizer
    (or no chat template) to turn it into ids; names the directory and the files looked for."""


class ModelError(RefcheckError):
    exit_code = EXIT_MODEL


class GoldenError(RefcheckError):
    exit_code = EXIT_GOLDEN


class GoldenLockError(GoldenError):
    """Another process holds the golden directory's writer lock past the wait timeout."""


class CorruptTraceError(RefcheckError):
    exit_code = EXIT_CORRUPT


class SchemaVersionError(CorruptTraceError):
    """A trace or golden manifest written with a newer major version than this refcheck reads."""


class NonFiniteError(ModelError):
    """NaN or Inf in a model's weights or in the logits it produced (names the model, tensor or step)."""


class OutputPathError(UsageError):
    """An output path (--save-trace, --out, --cache-dir) that cannot be written, or that holds something other than
    a regular file (a directory, device, FIFO or socket, never replaced), found before any work."""


class NothingComparedError(RefcheckError):
    exit_code = EXIT_NOTHING


class WorkerDiedError(RefcheckError):
    """A worker process died while it ran a job (a signal, an abrupt exit): not a verdict on the engine."""

    exit_code = EXIT_WORKER


def exit_code_for(exc: BaseException) -> int | None:
    """Exit code for a known user error (refcheck's own or the reference's), else None."""
    if isinstance(exc, RefcheckError):
        return exc.exit_code
    if isinstance(exc, (CheckpointError, ModelMismatchError, UnsupportedModelError)):
        return EXIT_MODEL
    if isinstance(exc, (PromptError, BudgetError, ReferenceInputError)):
        return EXIT_USAGE
    return None

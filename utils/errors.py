"""Clear errors for bad input.

Every check the workbook makes on what a learner passes in raises one of these,
with a message that says what was wrong and what to do instead, before anything
reaches torch.
"""

from __future__ import annotations


class WorkbookError(ValueError):
    """Base class: bad input to a workbook helper."""


class UnknownModelError(WorkbookError):
    """The named model is neither embedded, a local folder, nor reachable on the hub."""


class UnsupportedArchitectureError(WorkbookError):
    """The model's architecture is not one the hand-written forward pass implements."""


class PromptTooLongError(WorkbookError):
    """The prompt (plus the tokens asked for) does not fit in the context."""


class EmptyPromptError(WorkbookError):
    """The prompt has no tokens."""


class InvalidTokenCountError(WorkbookError):
    """A token count that must be positive was not."""


class UnsupportedDtypeError(WorkbookError):
    """The dtype is unknown or the device cannot run it."""


class UnsupportedDeviceError(WorkbookError):
    """The device is unknown or not available on this machine."""


class OutOfMemoryError(WorkbookError):
    """What was asked for (weights, KV cache, batch) will not fit in the device's memory."""


def check_token_count(n: int, name: str = "max_new_tokens") -> int:
    """Return ``n`` if it is a positive int, else raise :class:`InvalidTokenCountError`."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise InvalidTokenCountError(f"{name} must be a positive integer, got {n!r}.")
    return n


def check_prompt_length(n_prompt: int, max_context: int, n_new: int = 0) -> None:
    """Raise if a prompt of ``n_prompt`` tokens plus ``n_new`` new ones is empty or too long."""
    if n_prompt <= 0:
        raise EmptyPromptError(
            "The prompt is empty: give at least one token of text to prefill."
        )
    if n_prompt + n_new > max_context:
        raise PromptTooLongError(
            f"The prompt has {n_prompt} tokens and {n_new} more were asked for, "
            f"{n_prompt + n_new} in all, but the context holds {max_context}. "
            "Shorten the prompt, ask for fewer tokens, or use a model (or cache) "
            "with a longer context."
        )

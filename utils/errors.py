"""Clear errors for bad input, and the one validator that raises them.

Every check the workbook makes on what a learner passes in raises one of these,
with a message that says what was wrong and what to do instead, before anything
reaches torch. Counts, sizes and fractions are all checked by the functions at the
bottom of this module (:func:`check_count`, :func:`check_number`,
:func:`check_fraction`), so ``20e3`` tokens means the same everywhere.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


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


class InvalidTokenIdError(WorkbookError):
    """A token id outside the model's vocabulary."""


class UnsupportedDtypeError(WorkbookError):
    """The dtype is unknown or the device cannot run it."""


class UnsupportedDeviceError(WorkbookError):
    """The device is unknown or not available on this machine."""


class OutOfMemoryError(WorkbookError):
    """What was asked for (weights, KV cache, batch) will not fit in the device's memory."""


# ----------------------------------------------------------------------------- the validator


def check_count(value: Any, name: str, *, allow_zero: bool = False,
                error: type[WorkbookError] = WorkbookError) -> int:
    """Return ``value`` as an int if it is a whole number >= 1 (or >= 0), else raise ``error``.

    A float with no fractional part is accepted (``20e3`` tokens is fine; ``1.5`` is not);
    ``True``/``False`` are not counts.
    """
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    ok = (isinstance(value, numbers.Integral) and not isinstance(value, bool)
          and (value > 0 or (allow_zero and value == 0)))
    if not ok:
        need = "zero or a positive whole number" if allow_zero else "a positive whole number"
        raise error(f"{name} must be {need}, got {value!r}.")
    return int(value)


def check_number(value: Any, name: str, unit: str = "", *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float if it is a finite positive (or zero) real number."""
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value) and (value > 0 or (allow_zero and value == 0)))
    if not ok:
        need = "zero or a positive number" if allow_zero else "a positive number"
        raise WorkbookError(f"{name} must be {need}{f' (in {unit})' if unit else ''}, got {value!r}.")
    return float(value)


def check_fraction(value: Any, name: str) -> float:
    """Return ``value`` if it lies in [0, 1)."""
    if (not isinstance(value, numbers.Real) or isinstance(value, bool)
            or not 0 <= value < 1):
        raise WorkbookError(f"{name} must be a fraction in [0, 1), got {value!r}.")
    return float(value)


def check_token_count(n: Any, name: str = "max_new_tokens") -> int:
    """A positive number of tokens, else :class:`InvalidTokenCountError`."""
    return check_count(n, name, error=InvalidTokenCountError)


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


def check_prompt_batch(input_ids: Any, attention_mask: Any = None, batch: int | None = None) -> tuple[Any, Any]:
    """A prompt as ``[B, T]`` ids and its mask as ``[B, T]`` bool (None when none was given), checked the same
    way for both backends: not empty, no row all padding, the padding on the left (where every decode step
    appends), and ``B`` rows when the cache was made for ``batch``."""
    ids = input_ids if input_ids.dim() == 2 else input_ids.view(1, -1)
    rows, length = ids.shape
    if length == 0:
        raise EmptyPromptError("The prompt is empty: give at least one token of text to prefill.")
    if batch is not None and rows != batch:
        raise WorkbookError(f"The cache was made for batch {batch}, the prompt has {rows} rows.")
    if attention_mask is None:
        return ids, None
    mask = attention_mask.view(ids.shape).bool()
    if not bool(mask.any(dim=1).all()):
        raise EmptyPromptError("A prompt in the batch is all padding: give each row at least one token.")
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        raise WorkbookError("The batch must be LEFT-padded (padding before the prompt): "
                            "set tokenizer.padding_side = 'left'.")
    return ids, mask


def check_token_ids(ids: Any, vocab_size: int) -> None:
    """Raise :class:`InvalidTokenIdError` if any id in the tensor ``ids`` is outside ``[0, vocab_size)``."""
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidTokenIdError(
            f"Token id {bad} is outside the vocabulary (ids 0 .. {vocab_size - 1}, "
            f"{vocab_size:,} in all). Encode text with this model's own tokenizer.")

"""Text to token ids and back: byte-level BPE pieces, chat prompts, filler prompts.

A model reads token ids, not characters. SmolLM2's tokenizer (like GPT-2's, Llama 3's
and Qwen2's) is a *byte-level BPE*: its vocabulary is written in an alphabet of 256
printable characters, one per byte (:func:`bytes_to_unicode`; ``Ġ`` is the space
byte), so every piece maps back to the exact bytes it stands for (:func:`piece_bytes`).

Prompts for measurement: :func:`filler_ids` gives exactly ``n`` tokens of English
prose; :func:`encode` and :func:`chat_ids` turn a question into ids, with the chat
template when asked. An empty prompt is a clear :class:`~utils.errors.EmptyPromptError`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from .errors import EmptyPromptError, check_token_count

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
FILLER_TEXT = DATA_DIR / "prose_en.txt"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable-character table that byte-level BPE vocabularies are written in.

    Printable bytes stand for themselves; the 68 others (space, control bytes, ...) are
    shifted to code points from 256 up, so that no piece contains a blank or a control.
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@lru_cache(maxsize=1)
def _byte_of() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def piece_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level BPE piece stands for; None if the piece is not written in that alphabet."""
    byte_of = _byte_of()
    if not all(c in byte_of for c in piece):
        return None
    return bytes(byte_of[c] for c in piece)


def _check_text(text: str) -> None:
    if not isinstance(text, str) or not text.strip():
        raise EmptyPromptError("The prompt is empty: give at least one token of text to prefill.")


def encode(tokenizer: Any, text: str, *, chat: bool = False, system: str | None = None,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """Token ids of ``text``, shape [1, T]; ``chat=True`` wraps it in the chat template as a user turn."""
    _check_text(text)
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return ids.to(device)


def chat_ids(tokenizer: Any, question: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """A question as a chat prompt ready for the assistant's answer: ids [1, T]."""
    return encode(tokenizer, question, chat=True, device=device)


def filler_ids(tokenizer: Any, n_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Exactly ``n_tokens`` of English prose as ids, shape [1, n_tokens] (text repeated as needed)."""
    check_token_count(n_tokens, "n_tokens")
    ids = tokenizer(FILLER_TEXT.read_text(), add_special_tokens=False).input_ids
    reps = -(-n_tokens // len(ids))
    return torch.tensor([(ids * reps)[:n_tokens]], device=device)

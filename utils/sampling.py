"""From logits to the next token: greedy, temperature, top-k, top-p, seeded.

A forward pass gives one score (logit) per vocabulary entry; sampling picks one id.

- **greedy** (temperature 0): the argmax. Reproducible, prone to loops.
- **temperature** ``τ``: softmax of ``logits / τ``; below 1 sharpens, above 1 flattens.
- **top-k**: keep only the ``k`` most probable tokens.
- **top-p** (nucleus): keep the smallest set of most probable tokens whose probability
  reaches ``p``; renormalize.
- **seeded**: a ``torch.Generator`` with a fixed seed makes the draws repeat exactly.

Everything works on logits ``[V]`` or a batch ``[B, V]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import WorkbookError


@dataclass(frozen=True)
class Sampling:
    """Sampling settings: ``Sampling()`` is greedy; ``Sampling(0.8, top_p=0.9, seed=0)`` draws."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise WorkbookError(f"temperature must be >= 0, got {self.temperature!r}.")
        if not 0 < self.top_p <= 1:
            raise WorkbookError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise WorkbookError(f"top_k must be a positive whole number or None, got {self.top_k!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator | None:
        """A CPU generator seeded with ``seed`` (None when unseeded)."""
        return None if self.seed is None else torch.Generator().manual_seed(self.seed)


GREEDY = Sampling()


def filtered_probs(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0,
                   top_k: int | None = None) -> Tensor:
    """The distribution a sampler draws from: softmax(logits / τ), cut to top-k and top-p; float32 on the CPU.

    ``temperature`` 0 puts all the mass on the argmax.
    """
    logits = logits.float().cpu()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # mass *before* this token is still short of top_p
        p = torch.zeros_like(p).scatter(-1, order, sorted_p * keep)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample(logits: Tensor, settings: Sampling = GREEDY, generator: torch.Generator | None = None) -> Tensor:
    """The next token of each row: logits [B, V] -> ids [B] (or [V] -> a 0-d id), on the logits' device.

    Greedy stays on the device; a draw happens on the CPU (one small vector per row).
    """
    if settings.greedy:
        return logits.argmax(dim=-1)
    probs = filtered_probs(logits, settings.temperature, settings.top_p, settings.top_k)
    flat = probs.reshape(-1, probs.shape[-1])
    drawn = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return drawn.reshape(probs.shape[:-1]).to(logits.device)


def sample_next(logits: Tensor, temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None, top_k: int | None = None) -> int:
    """One token id from a logits vector [V]: argmax at temperature 0, else a draw."""
    return int(sample(logits, Sampling(temperature, top_k, top_p), generator))

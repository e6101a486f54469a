"""Speculative decoding: guess cheaply, verify in one pass.

Decode is bandwidth-bound: one forward pass reads every weight to make ONE token, and
a pass over a few more positions costs little more (the weights are read once either
way). So let something cheap guess ``k`` tokens (a *draft*), run the target model once
over them (:func:`utils.engine.extend`, prefill-shaped) and keep the longest prefix it
agrees with, plus its own next token. A rejection rolls the KV cache back
(:func:`utils.engine.rollback`). Everything here runs over either backend (a
transformers model or the hand-written :class:`~utils.llama.Llama`).

- :func:`accept_greedy`: exact match; the output is the target's greedy output, always;
- :func:`accept_sampled`: the rejection-sampling rule of Leviathan et al. (2023) and
  Chen et al. (2023): accept a drafted ``x`` with probability ``min(1, p(x) / q(x))``,
  else draw from :func:`residual` ``norm(max(p - q, 0))``; the output is distributed as
  the target's own samples;
- drafts (each ``start(prompt, max_len)`` then ``propose(context, k, sampling, generator)``
  -> ``(tokens, q)``, ``q`` [k, V] or None for a deterministic guess):
  :class:`PromptLookup` (n-gram match in the text so far: :func:`prompt_lookup`) and
  :class:`ModelDraft` over any model: :func:`early_exit_model` (the target's own first
  layers, then its final norm and head), :func:`quantized_model` (int4 layers, int8 head),
  or a separate smaller model with the same tokenizer;
- :func:`speculative_generate`: the whole loop, counting drafted, accepted and rejected
  tokens (:class:`SpeculativeResult`: acceptance rate ``alpha``, tokens per verify step);
- :func:`expected_tokens_per_step`: ``(1 - α^(k+1)) / (1 - α)``, what the loop should make
  per target pass when each drafted token is accepted with probability ``α``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor, nn

from . import engine
from .errors import WorkbookError, check_count, check_prompt_length, check_token_count
from .llama import Llama
from .quant import quantized_copy
from .sampling import GREEDY, Sampling, filtered_probs

# ----------------------------------------------------------------------------- the formula


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one verify pass yields on average with ``k`` drafted tokens, each accepted with
    probability ``alpha`` independently: ``1 + α + α² + ... + α^k = (1 - α^(k+1)) / (1 - α)``.

    ``k = 0`` (nothing drafted) is a plain decode step: 1 token.
    """
    k = check_count(k, "k", allow_zero=True)
    if not 0 <= alpha <= 1:
        raise WorkbookError(f"alpha must be an acceptance rate in [0, 1], got {alpha!r}.")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


# ----------------------------------------------------------------------------- acceptance


def accept_greedy(drafted: Sequence[int], target_logits: Tensor) -> tuple[int, int]:
    """``(n, next)``: how many drafted tokens the target agrees with, and its own next token.

    ``target_logits`` [k+1, V]: row ``i`` is the target's prediction for the slot of
    ``drafted[i]`` (the pass fed the last accepted token, then the k drafts); row ``k``
    gives the bonus token when every draft is accepted.
    """
    best = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(drafted) and int(drafted[n]) == best[n]:
        n += 1
    return n, best[n]


def residual(p: Tensor, q: Tensor) -> Tensor:
    """``norm(max(p - q, 0))``: where a rejected draft's replacement is drawn from (p, q: [V])."""
    r = (p - q).clamp(min=0)
    total = r.sum()
    return r / total if total > 0 else p  # p == q: a draft is then never rejected


def _draw(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_sampled(drafted: Sequence[int], p: Tensor, q: Tensor | None,
                   generator: torch.Generator | None = None) -> tuple[int, int]:
    """``(n, next)`` by the rejection-sampling rule; the tokens it emits are distributed as ``p``.

    ``p`` [k+1, V]: the target's distributions (row ``i`` for the slot of ``drafted[i]``);
    ``q`` [k, V]: the draft's, from which ``drafted`` was drawn (None: a deterministic draft,
    q one-hot at the drafted token). Accept ``x`` with probability ``min(1, p(x) / q(x))``;
    on the first rejection draw from :func:`residual`; when all are accepted, from ``p[k]``.
    """
    for i, x in enumerate(int(t) for t in drafted):
        q_i = torch.zeros_like(p[i]).index_fill_(0, torch.tensor([x]), 1.0) if q is None else q[i]
        if float(torch.rand((), generator=generator)) < min(1.0, float(p[i, x] / q_i[x])):
            continue
        return i, _draw(residual(p[i], q_i), generator)
    return len(drafted), _draw(p[len(drafted)], generator)


def accept(drafted: Sequence[int], target_logits: Tensor, q: Tensor | None, sampling: Sampling,
           generator: torch.Generator | None) -> tuple[int, int]:
    """:func:`accept_greedy` under greedy settings, else :func:`accept_sampled` on the filtered distributions."""
    if sampling.greedy:
        return accept_greedy(drafted, target_logits)
    p = filtered_probs(target_logits, sampling.temperature, sampling.top_p, sampling.top_k)
    return accept_sampled(drafted, p, q, generator)


# ----------------------------------------------------------------------------- drafts


class Draft(Protocol):
    """What the loop asks of a draft."""

    name: str

    def start(self, prompt: Tensor, max_len: int) -> None: ...

    def propose(self, context: Sequence[int], k: int, sampling: Sampling,
                generator: torch.Generator | None) -> tuple[list[int], Tensor | None]: ...


def prompt_lookup(context: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the context's last n-gram.

    Tries ``n = max_ngram`` down to 1; the most recent match wins; [] when none matches.
    Free to compute, and right whenever the answer copies its input (summaries, edits, extraction).
    """
    context = list(context)
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + k]
    return []


@dataclass
class PromptLookup:
    """The prompt-lookup draft: n-gram matches against the prompt and the text so far (no model)."""

    max_ngram: int = 3
    name: str = "prompt lookup"

    def start(self, prompt: Tensor, max_len: int) -> None:
        pass

    def propose(self, context: Sequence[int], k: int, sampling: Sampling = GREEDY,
                generator: torch.Generator | None = None) -> tuple[list[int], Tensor | None]:
        return prompt_lookup(context, k, self.max_ngram), None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class ModelDraft:
    """A draft that is a model (either backend), with its own KV cache kept in step with the text.

    ``propose`` rolls its cache back to what it shares with the context, feeds the rest in
    one :func:`~utils.engine.extend`, then decodes ``k`` tokens one at a time.
    """

    def __init__(self, model: Any, name: str) -> None:
        self.model, self.name = model, name
        self.cache: Any = None
        self.fed: list[int] = []  # the tokens whose K/V the draft's cache holds

    def start(self, prompt: Tensor, max_len: int) -> None:
        self.cache, self.fed = engine.new_cache(self.model, 1, max_len), []

    def propose(self, context: Sequence[int], k: int, sampling: Sampling = GREEDY,
                generator: torch.Generator | None = None) -> tuple[list[int], Tensor | None]:
        keep = _common_prefix(self.fed, context[:-1])  # always re-feed at least the last token
        engine.rollback(self.cache, keep)
        device = engine.device_of(self.model)
        new = torch.tensor([list(context[keep:])], device=device)
        logits = engine.extend(self.model, self.cache, new, last_only=True)[:, -1]
        tokens, probs = [], []
        for i in range(k):
            if i:
                logits = engine.decode_one_token(self.model, self.cache, torch.tensor([tokens[-1]], device=device))
            if sampling.greedy:
                tokens.append(int(logits[0].argmax()))
            else:
                probs.append(filtered_probs(logits[0], sampling.temperature, sampling.top_p, sampling.top_k))
                tokens.append(_draw(probs[-1], generator))
        self.fed = list(context) + tokens[:-1]
        return tokens, (torch.stack(probs) if probs else None)


def early_exit_model(model: Llama, n_layers: int) -> Llama:
    """The target's first ``n_layers`` blocks, then its own final norm and LM head: a self-draft.

    Shares every weight with ``model`` (nothing is copied); its caches hold ``n_layers`` layers.
    """
    n = check_count(n_layers, "n_layers")
    if n > model.args.n_layers:
        raise WorkbookError(f"n_layers={n}: the model has only {model.args.n_layers} layers.")
    draft = copy.copy(model)
    for attr in ("_modules", "_parameters", "_buffers"):  # own dicts: changing them leaves `model` alone
        setattr(draft, attr, dict(getattr(model, attr)))
    draft.layers = nn.ModuleList(list(model.layers)[:n])
    windows = model.args.windows[:n] if model.args.windows else ()
    draft.args = model.args.changed(n_layers=n, windows=windows)
    return draft


def quantized_model(model: Llama, group_size: int = 32, dtype: torch.dtype = torch.bfloat16) -> Llama:
    """A copy of ``model`` in ``dtype`` with int4 (group ``group_size``) layers and an int8 LM head
    (:func:`utils.quant.quantized_copy`): the quantization lab's best variant, as a draft."""
    return quantized_copy(model, 4, 8, group_size, dtype)


# ----------------------------------------------------------------------------- the loop


@dataclass
class SpeculativeResult:
    """The tokens made and what the drafts did: one entry of ``draft_lengths`` per verify pass."""

    tokens: list[int]
    draft_lengths: list[int] = field(default_factory=list)  # k_i drafted at pass i (0: plain decode)
    accepted: int = 0  # drafted tokens the target kept
    rejected: int = 0  # passes that ended on a rejected draft

    @property
    def steps(self) -> int:
        """Verify passes of the target after the prefill."""
        return len(self.draft_lengths)

    @property
    def drafted(self) -> int:
        return sum(self.draft_lengths)

    @property
    def alpha(self) -> float:
        """Acceptance rate: accepted ÷ drafted tokens the target judged (those after a rejection were not)."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """Tokens made per verify pass (the first token comes from the prefill and is not counted)."""
        return (len(self.tokens) - 1) / self.steps if self.steps else float("nan")

    def predicted_tokens_per_step(self, alpha: float | None = None) -> float:
        """:func:`expected_tokens_per_step` averaged over the passes, each with its own draft length."""
        a = self.alpha if alpha is None else alpha
        if not self.steps or a != a:
            return float("nan")
        return sum(expected_tokens_per_step(a, k) for k in self.draft_lengths) / self.steps


def verify_step(target: Any, cache: Any, draft: Draft, context: list[int], k: int, sampling: Sampling,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """One draft-verify round: ``(drafted, n)`` and the accepted tokens plus the target's next appended
    to ``context``. The cache holds ``context[:-1]`` before and after (rejected slots rolled back)."""
    drafted, q = draft.propose(context, k, sampling, generator) if k > 0 else ([], None)
    drafted, q = drafted[:k], (q[:k] if q is not None else None)
    start = len(context) - 1
    fed = torch.tensor([[context[-1], *drafted]], device=engine.device_of(target))
    logits = engine.extend(target, cache, fed)[0]  # [k+1, V]: one pass over the last token and the drafts
    n, nxt = accept(drafted, logits, q, sampling, generator)
    engine.rollback(cache, start + 1 + n)
    context.extend([*drafted[:n], nxt])
    return drafted, n


@torch.inference_mode()
def speculative_generate(target: Any, draft: Draft, ids: Tensor, max_new_tokens: int, k: int, *,
                         sampling: Sampling = GREEDY, eos_token_id: int | None = None) -> SpeculativeResult:
    """Generate up to ``max_new_tokens`` after ``ids`` [1, T] with ``draft`` guessing ``k`` tokens a pass.

    Greedy: the same tokens as :func:`utils.engine.generate`. Sampled: the same distribution.
    Stops after ``eos_token_id``; never asks the draft for more than the tokens still wanted.
    """
    check_token_count(max_new_tokens)
    k = check_count(k, "k (tokens drafted per verify pass)")
    ids = ids.view(1, -1) if ids.dim() == 1 else ids
    if ids.shape[0] != 1:
        raise WorkbookError(f"speculative_generate runs one sequence (batch 1), got {ids.shape[0]} rows.")
    T = ids.shape[1]
    check_prompt_length(T, engine.max_context(target), max_new_tokens)
    cache = engine.new_cache(target, 1, T + max_new_tokens)
    draft.start(ids, T + max_new_tokens)
    generator = sampling.generator()
    first_logits = engine.prefill(target, cache, ids)[:1]
    _, first = accept([], first_logits, None, sampling, generator)
    context = ids[0].tolist() + [first]
    result = SpeculativeResult([first])
    while len(result.tokens) < max_new_tokens and eos_token_id not in result.tokens:
        wanted = max_new_tokens - len(result.tokens)
        drafted, n = verify_step(target, cache, draft, context, min(k, wanted - 1), sampling, generator)
        result.draft_lengths.append(len(drafted))
        result.accepted += n
        result.rejected += int(n < len(drafted))
        result.tokens = context[T:]
    if eos_token_id in result.tokens:
        result.tokens = result.tokens[:result.tokens.index(eos_token_id) + 1]
    return result


__all__ = [
    "expected_tokens_per_step", "accept_greedy", "residual", "accept_sampled", "accept", "Draft",
    "prompt_lookup", "PromptLookup", "ModelDraft", "early_exit_model", "quantized_model",
    "SpeculativeResult", "verify_step", "speculative_generate",
]

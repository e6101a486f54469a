"""The phases of generation over the hand-written model (:mod:`utils.llama`).

The same vocabulary as :mod:`utils.phases` (the transformers backend), so a chapter
or lab swaps one for the other in one line; :mod:`utils.engine` picks the right one
from the model's type:

- :func:`new_cache` ``(model, batch, max_len)``: a preallocated, zeroed KV cache;
- :func:`prefill` ``(model, cache, ids, mask=None) -> logits [B, V]``: the whole prompt in
  one pass (compute-bound); fills slots ``0 .. T-1``;
- :func:`decode_one_token` ``(model, cache, token) -> logits [B, V]``: one new token per row
  at the next slot (bandwidth-bound);
- :func:`extend` ``(model, cache, tokens) -> logits [B, T, V]``: several new positions after
  what the cache holds (a speculative verify, a chunk of a long prompt);
- :func:`rollback` ``(cache, length)``: forget everything after ``length`` tokens;
- :func:`packed` ``(model, batch, tokens, keep) -> logits [K, V]``: several sequences' new
  tokens in ONE row of one pass (a serving engine's mixed batch: prompt chunks and decode
  tokens together); ``batch`` (:class:`utils.executors.PackedBatch`) says where each lives.

:func:`forward_no_cache` recomputes a whole sequence (the quadratic baseline).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import PromptTooLongError, WorkbookError, check_prompt_batch, check_prompt_length, check_token_ids
from .llama import KVCache, Llama

def max_context(model: Llama) -> int:
    """Positions the model was trained for (``max_position_embeddings``)."""
    return model.args.max_context


def new_cache(model: Llama, batch: int, max_len: int, static: bool = False) -> KVCache:
    """A zeroed KV cache for ``batch`` rows of up to ``max_len`` tokens (clear error if it will not fit)."""
    return model.new_cache(batch, max_len, static=static)


def rollback(cache: KVCache, length: int) -> None:
    """Forget everything after the first ``length`` tokens (a rejected speculative draft)."""
    if not 0 <= length <= cache.length:
        raise WorkbookError(f"Cannot roll back to {length}: the cache holds {cache.length} tokens.")
    cache.length = length


def as_batch(input_ids: Tensor, attention_mask: Tensor | None, batch: int | None = None) -> tuple[Tensor, Tensor]:
    """input_ids as [B, T] and the mask as [B, T] bool, all True when none is given
    (:func:`utils.errors.check_prompt_batch` checks both, as for the other backend)."""
    ids, mask = check_prompt_batch(input_ids, attention_mask, batch)
    return ids, torch.ones_like(ids, dtype=torch.bool) if mask is None else mask


@torch.inference_mode()
def extend(model: Llama, cache: KVCache, tokens: Tensor, last_only: bool = False) -> Tensor:
    """Append ``tokens`` [B, T] after what ``cache`` holds; return logits [B, T, V] (or [B, 1, V]).

    Attends to the filled slots only. Prefill is extend on an empty cache; a speculative
    verify step is extend with the draft tokens (then :func:`rollback` what was rejected).
    """
    start, T = cache.length, tokens.shape[1]
    if start + T > cache.max_len:
        raise PromptTooLongError(
            f"The cache holds {cache.max_len} tokens: {start} are filled and {T} more were given "
            f"({start + T} in all). Make a larger cache (new_cache(model, batch, max_len)).")
    check_token_ids(tokens, model.args.vocab_size)
    slots = torch.arange(start, start + T, device=cache.device)  # [T]
    logits = model(tokens.to(cache.device), slots, cache, start + T, last_only)
    cache.length = start + T
    return logits


@torch.inference_mode()
def prefill(model: Llama, cache: KVCache, input_ids: Tensor,
            attention_mask: Tensor | None = None) -> Tensor:
    """Run the prompt [B, T] (left-padded if B > 1) through the model in one pass.

    Resets ``cache`` and fills slots 0..T-1. Returns the logits of the last position [B, V]:
    the distribution of the first new token.
    """
    ids, mask = as_batch(input_ids, attention_mask, cache.batch)
    check_prompt_length(ids.shape[1], cache.max_len)
    mask = mask.to(cache.device)
    cache.length = 0
    cache.valid.fill_(True)
    cache.valid[:, :ids.shape[1]] = mask  # padding slots are never attended to
    cache.n_pad.copy_((~mask).sum(dim=1))  # RoPE position = slot - n_pad
    return extend(model, cache, ids, last_only=True)[:, -1]


@torch.inference_mode()
def decode_one_token(model: Llama, cache: KVCache, token: Tensor) -> Tensor:
    """Run one new token per row (``token``: [B] or [B, 1]) at the next slot; logits [B, V].

    Eager: attends to the ``length + 1`` filled slots. ``cache.static``: to all ``max_len``
    slots (masked): one shape at every step, as a compiled step needs (:mod:`utils.fast`).
    """
    slot = cache.length
    if slot >= cache.max_len:
        raise PromptTooLongError(
            f"The KV cache is full: {cache.max_len} of {cache.max_len} slots are used. "
            "Make the cache as large as prompt + new tokens.")
    slots = torch.tensor([slot], device=cache.device)  # [1]
    kv_len = cache.max_len if cache.static else slot + 1
    logits = model(token.view(-1, 1), slots, cache, kv_len)  # [B, 1, V]
    cache.length = slot + 1
    return logits[:, -1]


@torch.inference_mode()
def forward_no_cache(model: Llama, input_ids: Tensor, attention_mask: Tensor | None = None,
                     last_only: bool = False) -> Tensor:
    """Logits [B, T, V] of the whole sequence, computed from scratch (K/V kept only for this pass)."""
    ids, mask = as_batch(input_ids, attention_mask)
    cache = model.new_cache(ids.shape[0], ids.shape[1])  # scratch: thrown away on return
    cache.valid.copy_(mask.to(cache.device))
    cache.n_pad.copy_((~mask).sum(dim=1).to(cache.device))
    return extend(model, cache, ids, last_only=last_only)


@torch.inference_mode()
def packed(model: Llama, batch: "KVCache", tokens: Tensor, keep: Tensor) -> Tensor:
    """Tokens of several sequences packed in one row ``[N]``: logits ``[K, V]`` at positions ``keep`` [K].

    ``batch`` gives each token its position and sequence (its RoPE position, what it may attend
    to, where its K/V goes); the model's call is the same as for any cache.
    """
    check_token_ids(tokens, model.args.vocab_size)
    slots = torch.zeros(1, len(tokens), dtype=torch.long, device=tokens.device)  # unused: the batch knows
    return model(tokens[None], slots, batch, 0, keep=keep)[0]

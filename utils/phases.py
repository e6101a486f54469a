"""The phases of generation through transformers, with a KV cache.

A request runs in two phases:

- **prefill**: the whole prompt goes through the model in one parallel forward pass.
  It fills the KV cache and yields the logits of the first new token. Its time sets
  the time-to-first-token (TTFT = prefill + first sample). Compute-bound.
- **decode**: one forward pass per new token, each reading every weight once.
  Memory-bandwidth-bound: ``decode tok/s ~ bandwidth / bytes read per token``.

The same vocabulary as :mod:`utils.llama_phases` (the hand-written backend), so a
chapter swaps one for the other in one line; :mod:`utils.engine` picks the backend
from the model's type:

- :func:`new_cache` ``(model, batch, max_len)``: an empty cache (transformers'
  ``DynamicCache``, which grows; ``max_len`` is only checked against the context);
- :func:`prefill` ``(model, cache, ids, mask=None) -> logits [B, V]``;
- :func:`decode_one_token` ``(model, cache, token) -> logits [B, V]``;
- :func:`extend` ``(model, cache, tokens) -> logits [B, T, V]``;
- :func:`rollback` ``(cache, length)``.

Batches are left-padded; the cache keeps the attention mask so that every decode
step masks the padding and counts each row's positions from its first real token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .errors import PromptTooLongError, WorkbookError, check_prompt_batch, check_prompt_length, check_token_ids


@dataclass
class HFCache:
    """transformers' KV cache plus what a batch needs beside it: the attention mask so far.

    ``mask`` is None while no row is padded (then none is passed to the model, as in
    ``generate`` with one prompt); else [B, length] with False at padding.
    """

    kv: Any
    batch: int
    max_len: int
    mask: Tensor | None = None

    @property
    def length(self) -> int:
        return self.kv.get_seq_length()


def max_context(model: Any) -> int:
    """Positions the model was trained for (``max_position_embeddings``)."""
    return model.config.max_position_embeddings


def new_cache(model: Any, batch: int, max_len: int) -> HFCache:
    """An empty transformers KV cache for ``batch`` rows of up to ``max_len`` tokens."""
    from transformers import DynamicCache  # the backend's own type; transformers is a heavy import

    check_prompt_length(1, max_context(model), max_len - 1)
    return HFCache(DynamicCache(config=model.config), batch, max_len)


def rollback(cache: HFCache, length: int) -> None:
    """Forget everything after the first ``length`` tokens (a rejected speculative draft)."""
    if not 0 <= length <= cache.length:
        raise WorkbookError(f"Cannot roll back to {length}: the cache holds {cache.length} tokens.")
    _drop(cache, cache.length - length)
    if cache.mask is not None:
        cache.mask = cache.mask[:, :length]


def _drop(cache: HFCache, n: int) -> None:
    """Remove the last ``n`` tokens (transformers 5: ``crop`` takes minus the count to remove)."""
    if n > 0:
        cache.kv.crop(-n)


def _positions(mask: Tensor, new: int) -> Tensor:
    """RoPE positions of the last ``new`` slots: counted from each row's first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -new:]


def _forward(model: Any, cache: HFCache, tokens: Tensor, last_only: bool) -> Tensor:
    """The model over ``tokens`` [B, T], whose slots ``cache.mask`` (if any) already covers."""
    kwargs: dict[str, Any] = {}
    if cache.mask is not None:
        kwargs = dict(attention_mask=cache.mask.long(), position_ids=_positions(cache.mask, tokens.shape[1]))
    out = model(input_ids=tokens, cache=cache.kv, use_cache=True, logits_to_keep=1 if last_only else 0, **kwargs)
    return out.logits


def _append(model: Any, cache: HFCache, tokens: Tensor, last_only: bool) -> Tensor:
    """Run ``tokens`` [B, T] after what ``cache`` holds (ids already known to be in the vocabulary)."""
    T = tokens.shape[1]
    if cache.length + T > cache.max_len:
        raise PromptTooLongError(
            f"The cache holds {cache.max_len} tokens: {cache.length} are filled and {T} more were given "
            f"({cache.length + T} in all). Make a larger cache (new_cache(model, batch, max_len)).")
    if cache.mask is not None:
        cache.mask = torch.cat([cache.mask, cache.mask.new_ones(cache.mask.shape[0], T)], dim=1)
    return _forward(model, cache, tokens, last_only)


@torch.inference_mode()
def extend(model: Any, cache: HFCache, tokens: Tensor, last_only: bool = False) -> Tensor:
    """Append ``tokens`` [B, T] after what ``cache`` holds; logits [B, T, V] (or [B, 1, V])."""
    check_token_ids(tokens, model.config.vocab_size)
    return _append(model, cache, tokens, last_only)


@torch.inference_mode()
def prefill(model: Any, cache: HFCache, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """One forward pass over the whole prompt [B, T] (left-padded if B > 1): logits of the next token [B, V].

    Resets ``cache`` first.
    """
    ids, mask = check_prompt_batch(input_ids, attention_mask, cache.batch)
    check_prompt_length(ids.shape[1], cache.max_len)
    check_token_ids(ids, model.config.vocab_size)
    mask = None if mask is None else mask.to(ids.device)
    _drop(cache, cache.length)  # a prefill starts a new request
    cache.mask = None if mask is None or bool(mask.all()) else mask
    return _forward(model, cache, ids, last_only=True)[:, -1]


@torch.inference_mode()
def decode_one_token(model: Any, cache: HFCache, token: Tensor) -> Tensor:
    """One forward pass for one new token per row ([B] or [B, 1]); logits [B, V].

    The token comes from the model's own sampling, so its id is not checked here: that
    check reads a value back from the device, a sync in the hot loop.
    """
    return _append(model, cache, token.view(-1, 1), last_only=False)[:, -1]


def kv_tensors(cache: HFCache | Any) -> list[tuple[Tensor, Tensor]]:
    """(keys, values) of every layer, each ``[batch, kv_heads, tokens, head_dim]``: what the cache stores.

    Takes an :class:`HFCache` or transformers' own cache object (the 5.x layer objects
    with ``.keys`` / ``.values``, or the older ``key_cache`` / ``value_cache`` lists), so
    a chapter can count the bytes a prefill really left behind.
    """
    kv = cache.kv if isinstance(cache, HFCache) else cache
    if hasattr(kv, "layers"):
        return [(layer.keys, layer.values) for layer in kv.layers]
    return list(zip(kv.key_cache, kv.value_cache))

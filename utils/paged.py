"""A paged KV cache driven by hand, with prefix caching: chapter 07's view of the serving core's memory.

The serving core keeps KV memory in blocks: :class:`utils.blocks.BlockManager` keeps the books
(block tables, reference counts, the hashes of full blocks for prefix sharing) and
:class:`utils.executors.KVPool` holds the tensors. :class:`PagedKVCache` puts the two together
for a chapter that drives sequences one call at a time: ``prefill`` a prompt (reusing cached
blocks of its prefix when prefix caching is on), ``decode`` several sequences one token each,
``rollback`` to repeat a timed step at the same position, ``release`` a finished sequence.
Every call is one packed forward pass of the hand-written model
(:func:`utils.executors.run_packed`), the same one the serving loop runs.

:func:`paged_generate` serves several prompts with the serving core's loop
(:func:`utils.scheduler.serve`) over such a cache.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from .blocks import BlockManager, block_hashes
from .errors import WorkbookError, check_count
from .executors import KVPool, ModelExecutor, run_packed
from .llama import Llama
from .requests import Request, Sequence as Seq
from .scheduler import Scheduler, serve

__all__ = ["PagedKVCache", "paged_generate", "block_hashes"]

_OPEN_ENDED = 1 << 30  # a hand-driven sequence makes as many tokens as it is asked for


class PagedKVCache:
    """``n_blocks`` blocks of ``block_size`` token slots shared by hand-driven sequences."""

    def __init__(self, model: Llama, n_blocks: int, block_size: int = 16, prefix_caching: bool = False) -> None:
        self.model = model
        self.pool = KVPool(model, n_blocks, block_size)
        self.blocks = BlockManager(n_blocks, block_size, prefix_caching)
        self.seqs: dict[int, Seq] = {}

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def lengths(self) -> dict[int, int]:
        """Tokens with K/V in the cache, per live sequence."""
        return {i: s.num_computed for i, s in self.seqs.items()}

    @property
    def tables(self) -> dict[int, list[int]]:
        return {i: list(s.block_table) for i, s in self.seqs.items()}

    def blocks_in_use(self) -> int:
        return self.blocks.blocks_in_use()

    @property
    def hit_rate(self) -> float:
        return self.blocks.hit_rate

    def _run(self, work: list[tuple[Seq, int]]) -> Tensor:
        for seq, n in work:
            if not self.blocks.can_grow(seq, n):
                raise WorkbookError(f"The paged KV cache is full: all {self.blocks.n_blocks} blocks of "
                                    f"{self.block_size} tokens are in use. Release sequences or make it larger.")
            self.blocks.grow(seq, n)
        logits = run_packed(self.model, self.pool, work)
        for seq, n in work:
            old, seq.num_computed = seq.num_computed, seq.num_computed + n
            self.blocks.computed(seq, old)
        return logits

    def prefill(self, seq_id: int, ids: Sequence[int] | Tensor) -> tuple[Tensor, int]:
        """A new sequence with prompt ``ids``: (logits [V] of its first new token, prompt tokens found cached)."""
        if seq_id in self.seqs:
            raise WorkbookError(f"Sequence {seq_id} is live: release it first, or use another id.")
        seq = Seq(Request(seq_id, 0.0, tuple(int(t) for t in ids), _OPEN_ENDED))
        self.blocks.admit(seq)
        self.seqs[seq_id] = seq
        return self._run([(seq, seq.to_compute)])[0], seq.num_cached

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> Tensor:
        """One step: each sequence is fed its token (at its next position): logits [n, V]."""
        seqs = [self.seqs[i] for i in seq_ids]
        for seq, t in zip(seqs, tokens):
            seq.add(int(t), 0.0)
        return self._run([(s, 1) for s in seqs])

    def rollback(self, seq_id: int, length: int) -> None:
        """Forget ``seq_id``'s tokens after the first ``length`` (its blocks stay; later writes overwrite)."""
        seq = self.seqs[seq_id]
        if not seq.request.prompt_tokens <= length <= seq.num_computed:
            raise WorkbookError(f"Cannot roll sequence {seq_id} back to {length} tokens: it holds "
                                f"{seq.num_computed}, its prompt {seq.request.prompt_tokens}.")
        del seq.tokens[length - seq.request.prompt_tokens:]
        del seq.token_s[length - seq.request.prompt_tokens:]
        seq.num_computed = length

    def release(self, seq_id: int) -> None:
        """``seq_id`` is finished: its blocks go back (with prefix caching, their hashes stay findable)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.blocks.release(seq)


def paged_generate(model: Llama, prompts: Sequence[Sequence[int]], max_new_tokens: int, n_blocks: int,
                   block_size: int = 16, max_seqs: int = 64, token_budget: int | None = None) -> list[list[int]]:
    """Greedy tokens of several prompts served together by the serving core over a paged cache."""
    check_count(max_new_tokens, "max_new_tokens")
    trace = [Request(i, 0.0, tuple(int(t) for t in p), max_new_tokens) for i, p in enumerate(prompts)]
    scheduler = Scheduler(BlockManager(n_blocks, block_size), max_seqs, token_budget)
    return [s.tokens for s in serve(trace, scheduler, ModelExecutor(model, KVPool(model, n_blocks, block_size)))]

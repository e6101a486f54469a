"""Executors: run a scheduled step on the hand-written model, over contiguous rows or paged blocks.

The scheduler (:mod:`utils.scheduler`) decides *what* runs: each sequence and how many of its
tokens it feeds. An executor makes it happen. The interface is one call,
``execute(step) -> (next tokens, seconds)`` (:class:`utils.scheduler.Executor`); this module's
:class:`ModelExecutor` is the real one, :class:`utils.simulator.SimulatedExecutor` the charged one.

**Storage.** :class:`KVPool` holds the K/V tensors of every layer as one flat run of token
slots, ``n_blocks x block_size``; a sequence's position ``p`` lives at slot
``table[p // block_size] x block_size + p % block_size`` of its block table. Paged memory is
many small blocks; a *contiguous* cache is the same pool cut into one block of ``max_len``
per row. Who owns which block is kept apart, by :class:`utils.blocks.BlockManager`.

**Packed (mixed) batches.** The step's tokens -- a prompt chunk of ``c`` tokens and the ``B``
decode tokens of the running sequences -- go through the model as ONE row of ``c + B`` tokens
(:class:`PackedBatch`, nano-vllm's and vLLM's layout): every weight is read once for all of
them, so the chunk rides along in the decode step (SARATHI's *piggybacking*). Each token gets
its own RoPE position and sees only its own sequence's keys, up to its own position (and within
a sliding window); the logits are computed only at each sequence's last token. A real engine
reads the blocks in place with a varlen attention kernel; here each layer gathers the batch's
keys into one tensor and masks across sequences, which costs attention FLOPs on a CPU (each
token's scores against every key of the batch) but keeps every matmul shared.
``mixed=False`` runs each prompt chunk as its own pass and the decodes as one more: the
baseline that SARATHI improves on.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

from . import llama_phases
from .blocks import BlockManager
from .errors import WorkbookError, check_count
from .llama import Llama
from .requests import Sequence
from .scheduler import Scheduler, Step
from .timing import synchronize


class KVPool(nn.Module):
    """K and V of every layer for ``n_blocks x block_size`` token slots: [n_layers, n_kv_heads, slots, head_dim]."""

    def __init__(self, model: Llama, n_blocks: int, block_size: int) -> None:
        super().__init__()
        if not isinstance(model, Llama):
            raise WorkbookError("The serving executors run the hand-written model (utils.llama.Llama): "
                                "its cache interface lets every sequence sit at its own positions.")
        a = model.args
        self.n_blocks, self.block_size = check_count(n_blocks, "n_blocks"), check_count(block_size, "block_size")
        shape = (a.n_layers, a.n_kv_heads, n_blocks * block_size, a.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=model.dtype, device=model.device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=model.dtype, device=model.device), persistent=False)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V one block holds, over all layers."""
        return self.nbytes // self.n_blocks

    def slots(self, table: list[int], start: int, stop: int) -> list[int]:
        """Flat slots of positions ``start .. stop-1`` of the sequence with block ``table``."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]


class PackedBatch:
    """Several sequences' new tokens in one row: the cache interface the model's forward pass calls.

    ``items``: (block table, first new position, new tokens) per sequence. Token ``j`` of the row
    belongs to sequence ``seq[j]`` at position ``pos[j]``; the keys are every sequence's positions
    ``0 .. its last new one``, gathered from the pool.
    """

    def __init__(self, pool: KVPool, items: list[tuple[list[int], int, int]]) -> None:
        dev = pool.k.device
        write, read, q_seq, q_pos, k_seq, k_pos = [], [], [], [], [], []
        for i, (table, start, n) in enumerate(items):
            write += pool.slots(table, start, start + n)
            read += pool.slots(table, 0, start + n)
            q_seq += [i] * n
            q_pos += range(start, start + n)
            k_seq += [i] * (start + n)
            k_pos += range(start + n)
        self.pool = pool
        self.write, self.read = torch.tensor(write, device=dev), torch.tensor(read, device=dev)
        self.pos = torch.tensor(q_pos, device=dev)
        self._q = (torch.tensor(q_seq, device=dev)[:, None], self.pos[:, None])
        self._k = (torch.tensor(k_seq, device=dev)[None], torch.tensor(k_pos, device=dev)[None])
        self.last = torch.tensor([len(q_seq) - 1 - q_seq[::-1].index(i) for i in range(len(items))], device=dev)

    def positions(self, slots: Tensor) -> Tensor:
        """RoPE positions [1, N]: each token's position in its own sequence."""
        return self.pos[None]

    def mask(self, slots: Tensor, kv_len: int, window: int | None = None) -> Tensor:
        """[1, 1, N, S]: a token sees its own sequence's keys up to its own position (within ``window``)."""
        (qs, qp), (ks, kp) = self._q, self._k
        allowed = (qs == ks) & (kp <= qp)
        if window is not None:
            allowed = allowed & (qp - kp < window)
        return allowed[None, None]

    def update(self, i: int, k: Tensor, v: Tensor, slots: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Write layer ``i``'s new K/V [1, Hkv, N, D] into the pool; return the batch's keys [1, Hkv, S, D]."""
        self.pool.k[i].index_copy_(1, self.write, k[0])
        self.pool.v[i].index_copy_(1, self.write, v[0])
        return self.pool.k[i][:, self.read][None], self.pool.v[i][:, self.read][None]


def run_packed(model: Llama, pool: KVPool, work: list[tuple[Sequence, int]]) -> Tensor:
    """One forward pass over ``work`` (each sequence feeds its next ``n`` tokens): logits [len(work), V]
    at each sequence's last fed token."""
    ids = [t for seq, n in work for t in seq.ids(seq.num_computed, seq.num_computed + n)]
    batch = PackedBatch(pool, [(seq.block_table, seq.num_computed, n) for seq, n in work])
    return llama_phases.packed(model, batch, torch.tensor(ids, device=pool.k.device), batch.last)


class ModelExecutor:
    """Runs each step on the hand-written model: mixed (one pass) or the chunks and the decodes apart."""

    def __init__(self, model: Llama, pool: KVPool, mixed: bool = True) -> None:
        self.model, self.pool, self.mixed = model, pool, mixed

    def passes(self, step: Step) -> list[list[tuple[Sequence, int]]]:
        """The forward passes of a step: one; or each prompt chunk (n > 1) alone, then the rest together."""
        if self.mixed:
            return [step.work]
        chunks = [[(s, n)] for s, n in step.work if n > 1]
        ones = [(s, n) for s, n in step.work if n == 1]
        return chunks + ([ones] if ones else [])

    @torch.inference_mode()
    def execute(self, step: Step) -> tuple[list[int | None], float]:
        """Run ``step``: each sequence's next token where its tokens are all computed; the measured seconds."""
        synchronize(self.model.device)
        start = time.perf_counter()
        nxt: dict[int, int] = {}
        for work in self.passes(step):
            tokens = run_packed(self.model, self.pool, work).argmax(dim=-1).tolist()
            nxt.update({seq.id: t for (seq, _), t in zip(work, tokens)})
        synchronize(self.model.device)
        seconds = time.perf_counter() - start
        return [nxt[s.id] if s.num_computed + n == s.num_tokens else None for s, n in step.work], seconds


def row_server(model: Llama, rows: int, max_len: int, token_budget: int | None = None, mixed: bool = True,
               decode_first: bool = True, policy: Any = None) -> tuple[Scheduler, ModelExecutor]:
    """A contiguous cache: ``rows`` sequences at once, each reserving ``max_len`` slots (one block each)."""
    blocks = BlockManager(rows, max_len)
    return (Scheduler(blocks, rows, token_budget, decode_first, policy),
            ModelExecutor(model, KVPool(model, rows, max_len), mixed))


def paged_server(model: Llama, n_blocks: int, block_size: int = 16, max_seqs: int = 64,
                 token_budget: int | None = None, mixed: bool = True, prefix_caching: bool = False,
                 decode_first: bool = True, policy: Any = None) -> tuple[Scheduler, ModelExecutor]:
    """A paged cache of ``n_blocks`` blocks of ``block_size`` slots, up to ``max_seqs`` sequences at once."""
    blocks = BlockManager(n_blocks, block_size, prefix_caching)
    return (Scheduler(blocks, max_seqs, token_budget, decode_first, policy),
            ModelExecutor(model, KVPool(model, n_blocks, block_size), mixed))

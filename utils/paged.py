"""A paged KV cache (block tables) and a prefix cache over it.

**Paging** (PagedAttention, Kwon et al. 2023, the idea behind vLLM). A contiguous cache
reserves each sequence's *maximum* length up front: prompt + the most tokens it may
generate. Most requests stop well before that, so most of the reservation is never
written. A paged cache cuts KV memory into fixed **blocks** of ``block_size`` token slots
and gives each sequence a **block table**: its logical position ``p`` lives in physical
block ``table[p // block_size]`` at offset ``p % block_size``. A sequence holds only the
blocks it has filled (the last one partly), and a finished sequence's blocks go back to
the pool at once.

**Prefix caching** (vLLM's automatic prefix caching, SGLang's RadixAttention). A *full*
block is identified by the hash of its tokens and of every token before it (a chain
of hashes), so two prompts that start the same way map their first blocks to the same
hashes. A new request looks up its prompt's block hashes, points its table at the
blocks already computed, and prefills only the rest. Only full blocks are shared, and
a sequence writes only into blocks past its shared prefix, so a shared block is never
written again and needs no copy (copy-on-write is needed when a *partly* filled block
is shared, e.g. forking a sequence for parallel sampling; not done here).

The cache plugs into the hand-written model (:class:`utils.llama.Llama`) through the
three calls its forward pass makes on any cache: ``positions``, ``mask`` and ``update``.
Here ``update`` writes new K/V into the blocks and *gathers* each row's blocks into a
contiguous tensor for attention; a real PagedAttention kernel reads the blocks in place.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import torch
from torch import Tensor, nn

from .errors import OutOfMemoryError, PromptTooLongError, WorkbookError, check_count
from .llama import Llama

# ----------------------------------------------------------------------------- the pool and the tables


class PagedKVCache(nn.Module):
    """``n_blocks`` blocks of ``block_size`` slots for every layer, shared by many sequences.

    ``k``, ``v``: [n_layers, n_kv_heads, n_blocks x block_size, head_dim] (a flat pool of slots).
    ``tables[seq]``: the sequence's block ids, in order; ``lengths[seq]``: its tokens so far.
    ``refs[b]``: how many holders (sequences, the prefix cache) use block ``b``; 0 = free.
    """

    def __init__(self, model: Llama, n_blocks: int, block_size: int = 16) -> None:
        super().__init__()
        if not isinstance(model, Llama):
            raise WorkbookError("The paged cache plugs into the hand-written model (utils.llama.Llama).")
        a = model.args
        self.block_size, self.n_blocks = check_count(block_size, "block_size"), check_count(n_blocks, "n_blocks")
        shape = (a.n_layers, a.n_kv_heads, n_blocks * block_size, a.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=model.dtype, device=model.device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=model.dtype, device=model.device), persistent=False)
        self.refs = [0] * n_blocks
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.evict: "PrefixCache | None" = None  # a prefix cache may give back blocks only it holds
        self._batch: list[int] = []
        self._step: tuple[Tensor, int, Tensor, Tensor] | None = None

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V one block holds, over all layers."""
        return (self.k.nbytes + self.v.nbytes) // self.n_blocks

    def blocks_in_use(self) -> int:
        return sum(1 for r in self.refs if r > 0)

    def _take_block(self) -> int:
        free = next((b for b, r in enumerate(self.refs) if r == 0), None)
        if free is None and self.evict is not None:
            free = self.evict.evict_one()
        if free is None:
            raise OutOfMemoryError(
                f"The paged KV cache is full: all {self.n_blocks} blocks of {self.block_size} tokens are in "
                "use. Serve fewer sequences at once or make the pool larger.")
        self.refs[free] = 1
        return free

    def reserve(self, seq: int, n_tokens: int) -> None:
        """Make ``seq``'s table long enough for ``n_tokens`` (new blocks from the pool)."""
        table = self.tables.setdefault(seq, [])
        self.lengths.setdefault(seq, 0)
        while len(table) * self.block_size < n_tokens:
            table.append(self._take_block())

    def share(self, seq: int, blocks: Sequence[int]) -> None:
        """Start ``seq`` with ``blocks`` (a cached prefix) already in its table."""
        if self.tables.get(seq):
            raise WorkbookError(f"Sequence {seq} already has blocks; share a prefix only into a new sequence.")
        for b in blocks:
            self.refs[b] += 1
        self.tables[seq], self.lengths[seq] = list(blocks), len(blocks) * self.block_size

    def release(self, seq: int) -> None:
        """``seq`` is finished: drop its hold on its blocks (a block no one holds is free)."""
        for b in self.tables.pop(seq, []):
            self.refs[b] -= 1
        self.lengths.pop(seq, None)

    # ------------------------------------------------------------------------- what the model calls

    def use(self, seqs: Sequence[int]) -> "PagedKVCache":
        """The sequences that the next forward call runs, one per row of its batch."""
        self._batch, self._step = list(seqs), None
        return self

    def _where(self, slots: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Physical slots of the new tokens [B*T] and of each row's first ``kv_len`` positions [B, kv_len]."""
        if self._step is None or self._step[0] is not slots or self._step[1] != kv_len:
            bs, dev = self.block_size, self.k.device
            tables = [self.tables[s] for s in self._batch]
            width = max(len(t) for t in tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev)  # [B, blocks]
            pos = torch.arange(kv_len, device=dev).clamp(max=width * bs - 1)
            read = table[:, pos // bs] * bs + pos % bs  # [B, kv_len]; unwritten positions are masked
            write = (table.gather(1, slots // bs) * bs + slots % bs).reshape(-1)  # [B*T]
            self._step = (slots, kv_len, write, read)
        return self._step[2], self._step[3]

    def positions(self, slots: Tensor) -> Tensor:
        """RoPE positions: the logical positions themselves (no padding in a paged batch)."""
        return slots

    def mask(self, slots: Tensor, kv_len: int, window: int | None = None) -> Tensor:
        """[B, 1, T, kv_len]: each token sees its own row's positions up to its own (and within ``window``)."""
        k_pos = torch.arange(kv_len, device=slots.device)
        q_pos = slots[..., None]  # [B, T, 1]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed = allowed & (q_pos - k_pos < window)
        return allowed[:, None]

    def update(self, i: int, k: Tensor, v: Tensor, slots: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Write layer ``i``'s new K/V [B, Hkv, T, D] into the blocks; gather each row's first ``kv_len``."""
        write, read = self._where(slots, kv_len)
        B, H, T, D = k.shape
        self.k[i].index_copy_(1, write, k.transpose(0, 1).reshape(H, B * T, D))
        self.v[i].index_copy_(1, write, v.transpose(0, 1).reshape(H, B * T, D))
        return self.k[i][:, read].transpose(0, 1), self.v[i][:, read].transpose(0, 1)  # [B, Hkv, kv_len, D]


# ----------------------------------------------------------------------------- prefill and decode over pages


@torch.inference_mode()
def paged_prefill(model: Llama, cache: PagedKVCache, seq: int, ids: Tensor) -> Tensor:
    """Append prompt ``ids`` [T] to sequence ``seq`` (after what it holds, e.g. a cached prefix): logits [V]."""
    start, T = cache.lengths.get(seq, 0), len(ids)
    if start + T > model.args.max_context:
        raise PromptTooLongError(f"{start + T} tokens do not fit the model's {model.args.max_context}-token context.")
    cache.reserve(seq, start + T)
    slots = torch.arange(start, start + T, device=cache.k.device)[None]  # [1, T]
    logits = model(ids.to(cache.k.device)[None], slots, cache.use([seq]), start + T, last_only=True)
    cache.lengths[seq] = start + T
    return logits[0, -1]


@torch.inference_mode()
def paged_decode(model: Llama, cache: PagedKVCache, seqs: Sequence[int], tokens: Sequence[int]) -> Tensor:
    """One decode step for ``seqs`` (one token each, each at its own position): logits [n, V]."""
    lengths = [cache.lengths[s] for s in seqs]
    for s, n in zip(seqs, lengths):
        cache.reserve(s, n + 1)
    dev = cache.k.device
    slots = torch.tensor(lengths, device=dev)[:, None]  # [n, 1]
    logits = model(torch.tensor(list(tokens), device=dev)[:, None], slots, cache.use(seqs), max(lengths) + 1)
    for s in seqs:
        cache.lengths[s] += 1
    return logits[:, -1]


def paged_generate(model: Llama, cache: PagedKVCache, prompts: Sequence[Tensor], max_new_tokens: int,
                   first_seq: int = 0) -> list[list[int]]:
    """Greedy tokens of several prompts decoded together over the paged cache (sequences are released)."""
    check_count(max_new_tokens, "max_new_tokens")
    seqs = list(range(first_seq, first_seq + len(prompts)))
    out = [[int(paged_prefill(model, cache, s, p).argmax())] for s, p in zip(seqs, prompts)]
    for _ in range(max_new_tokens - 1):
        logits = paged_decode(model, cache, seqs, [o[-1] for o in out])
        for o, t in zip(out, logits.argmax(dim=-1).tolist()):
            o.append(t)
    for s in seqs:
        cache.release(s)
    return out


# ----------------------------------------------------------------------------- prefix caching


def block_hashes(ids: Sequence[int], block_size: int) -> list[str]:
    """One hash per FULL block of ``ids``: of the block's tokens and the hash before it (a chain)."""
    hashes, parent = [], ""
    for start in range(0, len(ids) - block_size + 1, block_size):
        block = ",".join(str(int(t)) for t in ids[start:start + block_size])
        parent = hashlib.sha256(f"{parent}|{block}".encode()).hexdigest()[:16]
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Computed full blocks of past prompts, by block hash; least recently used evicted first."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache, self.blocks = cache, OrderedDict()  # hash -> block id
        cache.evict = self
        self.hit_tokens = self.prompt_tokens = 0

    def lookup(self, ids: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of ``ids`` (at least one token is left to compute)."""
        found = []
        for h in block_hashes(list(ids)[:-1], self.cache.block_size):
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            found.append(self.blocks[h])
        return found

    def register(self, seq: int, ids: Sequence[int]) -> None:
        """Remember ``seq``'s full prompt blocks (the cache holds them until evicted)."""
        for h, b in zip(block_hashes(list(ids), self.cache.block_size), self.cache.tables[seq]):
            if h not in self.blocks:
                self.blocks[h] = b
                self.cache.refs[b] += 1

    def finish(self, seq: int, ids: Sequence[int]) -> None:
        """``seq`` is done: remember every full block it computed (prompt and answer), then release it.

        The next turn of a conversation resends this one's prompt and answer: it hits them all.
        (The last sampled token was never fed back, so only ``lengths[seq]`` tokens have K/V.)
        """
        self.register(seq, list(ids)[:self.cache.lengths[seq]])
        self.cache.release(seq)

    def evict_one(self) -> int | None:
        """Free the least recently used block that only this cache holds (None if there is none)."""
        for h, b in self.blocks.items():
            if self.cache.refs[b] == 1:
                del self.blocks[h]
                self.cache.refs[b] = 0
                return b
        return None

    def prefill(self, model: Llama, seq: int, ids: Tensor) -> tuple[Tensor, int]:
        """Prefill ``seq`` with ``ids`` [T], reusing cached blocks: (logits [V], tokens served from cache)."""
        hit = self.lookup(ids.tolist())
        self.cache.share(seq, hit)
        cached = len(hit) * self.cache.block_size
        logits = paged_prefill(model, self.cache, seq, ids[cached:])
        self.register(seq, ids.tolist())
        self.hit_tokens, self.prompt_tokens = self.hit_tokens + cached, self.prompt_tokens + len(ids)
        return logits, cached

    @property
    def hit_rate(self) -> float:
        """Share of all prompt tokens so far that came from the cache."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

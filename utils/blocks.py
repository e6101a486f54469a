"""KV memory as blocks: who holds which block, reference counts, prefix sharing; without torch.

**Paging** (PagedAttention, Kwon et al. 2023, the idea behind vLLM). KV memory is cut into
``n_blocks`` blocks of ``block_size`` token slots. A sequence's **block table** maps its
position ``p`` to block ``table[p // block_size]``, offset ``p % block_size``. A sequence holds
only the blocks it has filled (the last one partly); a finished one gives them back at once.
A **contiguous** cache is the same bookkeeping with one block of ``max_len`` slots per
sequence: its whole maximum length is reserved at admission (one "row").

**Prefix caching** (vLLM's automatic prefix caching). A *full* block is named by the hash of
its tokens and of every token before it (:func:`block_hashes`, a chain), so prompts that start
the same way name their first blocks alike. At admission a sequence looks its prompt's hashes
up and starts with the blocks already computed (``num_computed`` jumps past them); only full
blocks are shared and a sequence writes only past its shared prefix, so a shared block is
never written again. A block no sequence holds any more keeps its hash and stays findable
until its slots are needed (free blocks are reused least recently freed first).

This class only keeps the books; the K/V tensors live in :class:`utils.executors.KVPool`.
The scheduler asks it whether a sequence can grow, the executors read ``seq.block_table``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from .errors import WorkbookError, check_count
from .requests import Sequence


def block_hashes(ids: list[int], block_size: int, parent: str = "") -> list[str]:
    """One hash per FULL block of ``ids``: of the block's tokens and the hash before it (a chain)."""
    hashes = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        block = ",".join(str(int(t)) for t in ids[start:start + block_size])
        parent = hashlib.sha256(f"{parent}|{block}".encode()).hexdigest()[:16]
        hashes.append(parent)
    return hashes


class BlockManager:
    """``n_blocks`` blocks of ``block_size`` slots: allocation, reference counts, prefix sharing."""

    def __init__(self, n_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        self.n_blocks, self.block_size = check_count(n_blocks, "n_blocks"), check_count(block_size, "block_size")
        self.prefix_caching = prefix_caching
        self.refs = [0] * n_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n_blocks))  # least recently freed first
        self.by_hash: dict[str, int] = {}
        self.hash_of: dict[int, str] = {}
        self.hit_tokens = self.prompt_tokens = 0

    @property
    def capacity_tokens(self) -> int:
        return self.n_blocks * self.block_size

    def blocks_in_use(self) -> int:
        return self.n_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, n_new: int) -> int:
        """New blocks ``seq`` needs to hold its computed tokens plus ``n_new`` more."""
        return max(0, -(-(seq.num_computed + n_new) // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, n_new: int) -> bool:
        return self.blocks_needed(seq, n_new) <= len(self.free)

    def grow(self, seq: Sequence, n_new: int) -> None:
        """Give ``seq`` the blocks for ``n_new`` more tokens (check :meth:`can_grow` first)."""
        for _ in range(self.blocks_needed(seq, n_new)):
            if not self.free:
                raise WorkbookError("No free KV block: the scheduler should have preempted a sequence first.")
            block, _ = self.free.popitem(last=False)
            self.by_hash.pop(self.hash_of.pop(block, ""), None)  # its old contents are gone
            self.refs[block] = 1
            seq.block_table.append(block)

    def admit(self, seq: Sequence) -> None:
        """A new (or preempted) sequence: start it with the cached blocks of its prompt's longest prefix.

        (One that arrives with its K/V computed elsewhere, a disaggregated decode machine's, keeps it.)"""
        if seq.num_computed:
            return
        ids = seq.ids(0, seq.num_tokens - 1)  # at least one token is left to compute: its logits are needed
        hit = []
        if self.prefix_caching:
            for h in block_hashes(ids, self.block_size):
                if h not in self.by_hash:
                    break
                hit.append(self.by_hash[h])
        for b in hit:
            self.free.pop(b, None)
            self.refs[b] += 1
        seq.block_table, seq.num_computed = hit, len(hit) * self.block_size
        seq.num_cached = seq.num_computed
        self.hit_tokens, self.prompt_tokens = self.hit_tokens + seq.num_cached, self.prompt_tokens + seq.num_tokens

    def computed(self, seq: Sequence, old: int) -> None:
        """``seq``'s K/V grew from ``old`` to ``num_computed`` tokens: name the blocks it filled."""
        if not self.prefix_caching:
            return
        first = old // self.block_size
        last = seq.num_computed // self.block_size
        if last <= first:
            return
        hashes = block_hashes(seq.ids(0, last * self.block_size), self.block_size)
        for b, h in zip(seq.block_table[first:last], hashes[first:last]):
            if h not in self.by_hash and b not in self.hash_of:
                self.by_hash[h], self.hash_of[b] = b, h

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was preempted: drop its hold; a block no one holds is free (hash kept)."""
        for b in reversed(seq.block_table):  # its tail first: the prefix stays findable longest
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None
        seq.block_table, seq.num_computed = [], 0

    @property
    def hit_rate(self) -> float:
        """Share of the prompt tokens admitted so far that came from the prefix cache."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

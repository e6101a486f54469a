"""utils.paged: a paged KV cache gives the tokens of the contiguous one; the prefix cache reuses blocks."""

from __future__ import annotations

import math

import pytest
import torch

from utils import engine as E
from utils import llama as L
from utils import paged as P
from utils.errors import OutOfMemoryError

from test_batching import tiny_hf


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model(request):
    return L.Llama.from_hf(tiny_hf(request.param))


def prompts(n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (int(t),), generator=g) for t in torch.randint(3, 40, (n,), generator=g)]


def test_paged_tokens_equal_contiguous_ones(model):
    cache = P.PagedKVCache(model, n_blocks=40, block_size=4)
    ps = prompts()
    got = P.paged_generate(model, cache, ps, 12)
    for p, g in zip(ps, got):
        assert g == E.generate(model, p[None], 12)[0].tolist()
    assert cache.blocks_in_use() == 0  # every sequence released its blocks


def test_a_sequence_holds_only_the_blocks_it_filled(model):
    cache = P.PagedKVCache(model, n_blocks=40, block_size=4)
    P.paged_prefill(model, cache, 0, torch.arange(1, 10))  # 9 tokens -> 3 blocks
    assert len(cache.tables[0]) == 3 == cache.blocks_in_use()
    P.paged_decode(model, cache, [0], [5])
    P.paged_decode(model, cache, [0], [6])
    P.paged_decode(model, cache, [0], [7])  # 12 tokens: still 3 blocks
    assert cache.lengths[0] == 12 and len(cache.tables[0]) == math.ceil(12 / 4)
    assert cache.block_bytes * cache.n_blocks == cache.k.nbytes + cache.v.nbytes


def test_the_block_table_is_what_attention_reads(model):
    """Swap two sequences' tables and their next tokens follow the other sequence: the table is used."""
    cache = P.PagedKVCache(model, n_blocks=40, block_size=4)
    a, b = prompts(2, seed=3)
    la, lb = P.paged_prefill(model, cache, 0, a), P.paged_prefill(model, cache, 1, b)
    tok = [int(la.argmax()), int(lb.argmax())]
    right = P.paged_decode(model, cache, [0], [tok[0]])
    cache.lengths[0] -= 1
    cache.tables[0], cache.tables[1] = cache.tables[1], cache.tables[0]
    cache.lengths[0], cache.lengths[1] = cache.lengths[1], cache.lengths[0]
    wrong = P.paged_decode(model, cache, [0], [tok[0]])
    assert not torch.allclose(right, wrong)


def test_an_exhausted_pool_is_a_clear_error(model):
    cache = P.PagedKVCache(model, n_blocks=2, block_size=4)
    with pytest.raises(OutOfMemoryError, match="all 2 blocks"):
        P.paged_prefill(model, cache, 0, torch.arange(1, 12))


def test_block_hashes_chain_the_whole_prefix():
    h = P.block_hashes(list(range(10)), 4)
    assert len(h) == 2  # full blocks only
    assert P.block_hashes(list(range(8)) + [99, 98], 4) == h
    changed = P.block_hashes([7] + list(range(1, 10)), 4)
    assert changed[0] != h[0] and changed[1] != h[1]  # a change early on changes every later hash


def test_prefix_cache_hit_gives_the_same_logits_and_skips_the_shared_blocks(model):
    cache = P.PagedKVCache(model, n_blocks=64, block_size=4)
    pc = P.PrefixCache(cache)
    shared = torch.randint(1, 96, (21,), generator=torch.Generator().manual_seed(1))
    a, b = torch.cat([shared, torch.tensor([5, 6, 7])]), torch.cat([shared, torch.tensor([9, 9])])
    _, cached_a = pc.prefill(model, 0, a)
    logits_b, cached_b = pc.prefill(model, 1, b)
    assert cached_a == 0 and cached_b == 20  # 5 full shared blocks of 4
    assert cache.tables[1][:5] == cache.tables[0][:5]  # the same physical blocks
    fresh = E.prefill(model, E.new_cache(model, 1, len(b)), b[None])[0]
    assert torch.allclose(logits_b, fresh, atol=1e-4)
    assert pc.hit_rate == pytest.approx(20 / (len(a) + len(b)))
    whole = pc.lookup(a.tolist())  # a prompt seen in full still leaves its last token to compute
    assert len(whole) * 4 <= len(a) - 1


def test_eviction_frees_only_blocks_no_sequence_holds(model):
    cache = P.PagedKVCache(model, n_blocks=6, block_size=4)
    pc = P.PrefixCache(cache)
    pc.prefill(model, 0, torch.arange(1, 13))  # 3 blocks, registered
    cache.release(0)  # now held by the prefix cache only
    assert cache.blocks_in_use() == 3
    pc.prefill(model, 1, torch.arange(50, 70))  # 20 tokens: 5 blocks; 3 free + 2 evicted
    assert len(cache.tables[1]) == 5 and sorted(cache.tables[1]) == [0, 1, 3, 4, 5]  # 2 oldest evicted
    assert pc.lookup(list(range(1, 14))) == []  # the first prompt's chain now breaks at its first block
    with pytest.raises(OutOfMemoryError):
        pc.prefill(model, 2, torch.arange(20, 40))  # every block is held by sequence 1 or needed


def test_a_finished_turn_is_hit_in_full_by_the_next(model):
    cache = P.PagedKVCache(model, n_blocks=64, block_size=4)
    pc = P.PrefixCache(cache)
    prompt = torch.arange(1, 11)  # 10 tokens
    logits, _ = pc.prefill(model, 0, prompt)
    answer = [int(logits.argmax())]
    for _ in range(5):
        answer.append(int(P.paged_decode(model, cache, [0], [answer[-1]]).argmax()))
    conversation = prompt.tolist() + answer  # 16 tokens; K/V exist for the first 15
    pc.finish(0, conversation)
    assert 0 not in cache.tables
    next_turn = torch.tensor(conversation + [7, 8, 9])
    _, cached = pc.prefill(model, 1, next_turn)
    assert cached == 12  # the 3 full blocks of the 15 computed tokens

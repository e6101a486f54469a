"""utils.paged: a hand-driven paged cache gives the contiguous cache's tokens; prefix caching reuses blocks."""

from __future__ import annotations

import pytest
import torch

from utils import engine as E
from utils import llama as L
from utils import paged as P
from utils.errors import WorkbookError

from test_batching import tiny_hf


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model(request):
    return L.Llama.from_hf(tiny_hf(request.param))


def prompts(n: int = 3, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (int(t),), generator=g).tolist() for t in torch.randint(3, 40, (n,), generator=g)]


def greedy(model, p, n):
    return E.generate(model, torch.tensor(p)[None], n)[0].tolist()


def test_paged_generate_equals_alone(model):
    ps = prompts()
    assert P.paged_generate(model, ps, 12, n_blocks=40, block_size=4) == [greedy(model, p, 12) for p in ps]


def test_hand_driven_decode_equals_alone_and_holds_only_filled_blocks(model):
    cache = P.PagedKVCache(model, n_blocks=40, block_size=4)
    ps = prompts(2, seed=3)
    out = [[int(cache.prefill(i, p)[0].argmax())] for i, p in enumerate(ps)]
    for _ in range(5):
        for o, t in zip(out, cache.decode([0, 1], [o[-1] for o in out]).argmax(-1).tolist()):
            o.append(t)
    assert out == [greedy(model, p, 6) for p in ps]
    assert [len(t) for t in cache.tables.values()] == [-(-(len(p) + 5) // 4) for p in ps]
    cache.release(0), cache.release(1)
    assert cache.blocks_in_use() == 0


def test_rollback_repeats_a_step_exactly(model):
    cache = P.PagedKVCache(model, n_blocks=20, block_size=4)
    cache.prefill(0, prompts(1)[0])
    n = cache.lengths[0]
    first = cache.decode([0], [5])
    cache.rollback(0, n)
    assert torch.equal(cache.decode([0], [5]), first) and cache.lengths[0] == n + 1
    with pytest.raises(WorkbookError):
        cache.rollback(0, 1)


def test_an_exhausted_pool_is_a_clear_error(model):
    cache = P.PagedKVCache(model, n_blocks=2, block_size=4)
    with pytest.raises(WorkbookError, match="all 2 blocks"):
        cache.prefill(0, list(range(1, 12)))


def test_block_hashes_chain_the_whole_prefix():
    h = P.block_hashes(list(range(10)), 4)
    assert len(h) == 2  # full blocks only
    assert P.block_hashes(list(range(8)) + [99, 98], 4) == h
    changed = P.block_hashes([7] + list(range(1, 10)), 4)
    assert changed[0] != h[0] and changed[1] != h[1]  # a change early on changes every later hash


def test_prefix_hit_gives_the_same_logits_and_shares_blocks(model):
    cache = P.PagedKVCache(model, n_blocks=64, block_size=4, prefix_caching=True)
    shared = torch.randint(1, 96, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b = shared + [5, 6, 7], shared + [9, 9]
    _, cached_a = cache.prefill(0, a)
    logits_b, cached_b = cache.prefill(1, b)
    assert cached_a == 0 and cached_b == 20  # 5 full shared blocks of 4
    assert cache.tables[1][:5] == cache.tables[0][:5]  # the same physical blocks
    fresh = E.prefill(model, E.new_cache(model, 1, len(b)), torch.tensor(b)[None])[0]
    assert torch.allclose(logits_b, fresh, atol=1e-4)
    assert cache.hit_rate == pytest.approx(20 / (len(a) + len(b)))


def test_freed_blocks_stay_findable_until_reused(model):
    cache = P.PagedKVCache(model, n_blocks=6, block_size=4, prefix_caching=True)
    cache.prefill(0, list(range(1, 13)))  # 3 blocks
    cache.release(0)
    assert cache.blocks_in_use() == 0
    assert cache.prefill(1, list(range(1, 13)) + [40])[1] == 12  # found again after release
    cache.release(1)
    cache.prefill(2, list(range(50, 70)))  # 20 tokens: 5 blocks; the old ones are reused, their hashes dropped
    cache.release(2)
    assert cache.prefill(3, list(range(1, 13)) + [40])[1] < 12


def test_a_finished_turn_is_hit_in_full_by_the_next(model):
    cache = P.PagedKVCache(model, n_blocks=64, block_size=4, prefix_caching=True)
    prompt = list(range(1, 11))  # 10 tokens
    answer = [int(cache.prefill(0, prompt)[0].argmax())]
    for _ in range(5):
        answer.append(int(cache.decode([0], [answer[-1]]).argmax()))
    cache.release(0)  # K/V exist for prompt + the first 5 answer tokens: 15 tokens, 3 full blocks
    _, cached = cache.prefill(1, prompt + answer + [7, 8, 9])
    assert cached == 12

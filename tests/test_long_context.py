"""utils.long_context: tiled attention equals the full softmax; the int8 and sliding-window caches plug into
the hand-written model through the cache interface and keep their promises; clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from utils import batching, engine
from utils import long_context as LC
from utils.errors import OutOfMemoryError, WorkbookError
from utils.decode_table import NEAR_TIE, divergence
from utils.llama_phases import forward_no_cache
from utils.shapes import ModelShape, by_name
from utils.variants import perplexity

ROPE = {"rope_type": "default", "rope_theta": 10_000.0}


def tiny_args(**kw) -> ModelShape:
    base = dict(name="tiny", vocab_size=96, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                head_dim=16, intermediate_size=88, rope=ROPE, max_context=256, tied_embeddings=False)
    return ModelShape(**{**base, **kw})


@pytest.fixture(scope="module")
def model():
    return LC.random_llama(tiny_args(), seed=1)


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- tiled attention


@pytest.mark.parametrize("H,Hkv,T,S,block", [(4, 4, 37, 37, 8), (8, 2, 16, 50, 7), (6, 1, 1, 33, 16), (4, 2, 64, 64, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_tiled_attention_equals_sdpa_and_the_full_softmax(H, Hkv, T, S, block, causal):
    g = torch.Generator().manual_seed(H + T)
    q = torch.randn(2, H, T, 16, generator=g)
    k, v = torch.randn(2, Hkv, S, 16, generator=g), torch.randn(2, Hkv, S, 16, generator=g)
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T) if causal else None
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(LC.tiled_attention(q, k, v, causal, block), sdpa, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(LC.full_attention(q, k, v, causal), sdpa, atol=1e-5, rtol=1e-4)


def test_tiled_attention_never_holds_the_score_matrix():
    q, k, v = (torch.randn(1, 4, 512, 16) for _ in range(3))
    with LC.PeakMemory() as full:
        LC.full_attention(q, k, v)
    with LC.PeakMemory() as tiled:
        LC.tiled_attention(q, k, v, block=32)
    assert full.peak >= LC.score_matrix_bytes(1, 4, 512, 512)  # the T x S scores, float32
    assert tiled.peak < LC.score_matrix_bytes(1, 4, 512, 512) / 4


def test_tiled_attention_refuses_uneven_groups():
    with pytest.raises(WorkbookError, match="KV heads"):
        LC.tiled_attention(torch.randn(1, 4, 2, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8))


# ----------------------------------------------------------------------------- int8 cache


def test_int8_round_trip_error_is_at_most_half_a_step():
    x = torch.randn(2, 3, 50, 16) * torch.rand(2, 3, 50, 1) * 10
    q, scale = LC.quantize_kv(x)
    assert q.dtype == torch.int8 and scale.shape == (2, 3, 50, 1)
    err = (LC.dequantize_kv(q, scale, torch.float32) - x).abs()
    assert bool((err <= scale.float() * 0.5 + 1e-6).all())
    assert LC.dequantize_kv(*LC.quantize_kv(torch.zeros(1, 4)), torch.float32).abs().max() == 0


def test_int8_cache_bytes_are_the_formula(model):
    a = model.args
    cache = LC.with_int8_kv(model).new_cache(2, 40)
    assert cache.nbytes == LC.int8_kv_bytes_per_token(a.n_layers, a.n_kv_heads, a.head_dim) * 40 * 2
    assert cache.nbytes * 4 == pytest.approx(model.new_cache(2, 40).nbytes * (a.head_dim + 2) / a.head_dim)


def test_int8_cache_keeps_greedy_tokens_and_perplexity(model):
    """Band: 24 greedy tokens equal on each of 3 prompts, or parting only at a near-tie of the float model's
    logits (random weights have many: < decode_table.NEAR_TIE of the largest logit); perplexity within 1%."""
    int8 = LC.with_int8_kv(model)
    for seed in range(3):
        p = ids(12, seed)
        want, got = engine.generate(model, p, 24)[0].tolist(), engine.generate(int8, p, 24)[0].tolist()
        split = divergence(model, p, got, want)
        assert split is None or split[1] < NEAR_TIE, f"prompt {seed}: parts at token {split[0]}, gap {split[1]:.2%}"
    text = ids(80, seed=9)
    full, quantized = forward_no_cache(model, text), forward_no_cache(int8, text)
    assert (quantized - full).abs().max() < 0.02 * full.abs().max()
    assert perplexity(int8, text) == pytest.approx(perplexity(model, text), rel=0.01)
    assert int8.lm_head.weight is model.lm_head.weight  # shared, not copied


def test_int8_cache_serves_a_left_padded_batch_of_rows_of_their_own(model):
    """Rows at different positions (a left-padded batch, the engine's batched path) on the int8 cache: each
    row makes the tokens it makes alone."""
    int8 = LC.with_int8_kv(model)
    a, b = ids(9, 1)[0], ids(5, 2)[0]
    batch, mask = batching.left_pad([a, b], pad_id=0)
    together = engine.generate(int8, batch, 6, mask)
    assert together[0].tolist() == engine.generate(int8, a[None], 6)[0].tolist()
    assert together[1].tolist() == engine.generate(int8, b[None], 6)[0].tolist()


# ----------------------------------------------------------------------------- sliding window


def test_window_cache_equals_the_window_mask(model):
    p = ids(30, seed=4)
    with LC.windowed(model, 8):
        want = engine.generate(model, p, 20)[0]
        cache = LC.window_cache(model, 1, 8)
        logits = engine.prefill(model, cache, p)
        ref = engine.prefill(model, model.new_cache(1, 30), p)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-4)
    got = [int(logits.argmax())]
    for _ in range(19):
        got.append(int(engine.decode_one_token(model, cache, torch.tensor([got[-1]])).argmax()))
    assert got == want.tolist()
    assert [b.attn.window for b in model.layers] == [None, None]  # restored


def test_window_caps_memory_and_reads(model):
    cache = LC.window_cache(model, 1, 16)
    full = model.new_cache(1, 200)
    LC.fill_cache(model, cache, 150)
    assert cache.nbytes == model.new_cache(1, 16).nbytes < full.nbytes
    assert cache.mask(torch.tensor([150]), 151).shape[-1] == 16  # a decode step reads W slots
    assert set(cache.pos.tolist()) == set(range(134, 150))


def test_a_new_prompt_does_not_see_the_last_request(model):
    cache = LC.window_cache(model, 1, 8)
    engine.prefill(model, cache, ids(20, seed=5))
    p = ids(12, seed=6)
    fresh = engine.prefill(model, LC.window_cache(model, 1, 8), p)
    torch.testing.assert_close(engine.prefill(model, cache, p), fresh)


# ----------------------------------------------------------------------------- shapes, crossover, errors


def test_a_changed_shape_and_the_crossover():
    a = by_name("llama-3.2-1b", n_kv_heads=1)
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.hidden_size) == (16, 32, 1, 64, 2048)
    assert LC.crossover_context(16e9, 131_072) == pytest.approx(122_070.3, rel=1e-6)
    assert LC.crossover_context(16e9, 131_072, batch=8) == pytest.approx(122_070.3 / 8, rel=1e-6)
    assert LC.step_seconds(1e9, 1e5, 10_000, 1e10) == pytest.approx(0.2)
    # a measured 0.15 s step at 16 tokens, then 1e5 B per token more for each of 9,984 tokens at 10 GB/s
    assert LC.step_past_base(0.15, 1e5, 16, 10_000, 1e10) == pytest.approx(0.15 + 9_984e5 / 1e10)
    assert LC.step_past_base(0.15, 1e5, 16, 16, 1e10) == 0.15
    assert LC.step_past_base(0.15, 1e5, 16, 1_016, 1e10, batch=2) == pytest.approx(0.17)
    with pytest.raises(WorkbookError, match="shorter"):
        LC.step_past_base(0.15, 1e5, 16, 8, 1e10)
    with pytest.raises(WorkbookError, match="divide"):
        by_name("llama-3.2-1b", n_kv_heads=5)


def test_too_large_is_refused_with_the_numbers():
    with pytest.raises(OutOfMemoryError, match="GB"):
        LC.random_llama(by_name("llama-3.1-8b", n_layers=400))
    with pytest.raises(WorkbookError):
        LC.fill_cache(LC.random_llama(tiny_args()), LC.random_llama(tiny_args()).new_cache(1, 4), 5)
    with pytest.raises(WorkbookError):
        LC.with_int8_kv(object())


def test_a_random_model_has_its_shapes_parameters_tied_or_not():
    for tied in (True, False):
        shape = tiny_args(tied_embeddings=tied)
        m = LC.random_llama(shape)
        assert (m.lm_head.weight is m.embed.weight) is tied
        assert sum(p.numel() for p in m.parameters()) == shape.n_params

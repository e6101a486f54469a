"""Tests of utils.roofline: the worked examples of the workbook, and bad input."""

from __future__ import annotations

import math

import numpy as np

import pytest

from utils import roofline as rl
from utils.errors import InvalidTokenCountError, OutOfMemoryError, WorkbookError

# Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, bf16 (2 bytes).
LLAMA8B = dict(n_layers=32, n_kv_heads=8, head_dim=128, bytes_per_elem=2)


# ------------------------------------------------------------------- KV cache

def test_kv_bytes_per_token_8b_is_128_kib():
    assert rl.kv_bytes_per_token(**LLAMA8B) == 131_072 == 128 * 1024


def test_kv_bytes_per_token_smollm2_fp32_is_45_kib():
    # 30 layers, 3 KV heads, head_dim 64, fp32: the design doc's 45 KiB per token.
    assert rl.kv_bytes_per_token(30, 3, 64, 4) == 46_080 == 45 * 1024


def test_kv_bytes_per_token_fractional_bytes():
    assert rl.kv_bytes_per_token(2, 1, 4, 0.5) == 8


def test_kv_cache_8b_at_20k_tokens_is_2_6_gb():
    assert rl.kv_cache_bytes(**LLAMA8B, context_tokens=20_000) == 2_621_440_000
    assert round(rl.kv_cache_bytes(**LLAMA8B, context_tokens=20e3) / 1e9, 1) == 2.6


def test_kv_cache_8b_at_128k_tokens_is_17_gb():
    b = rl.kv_cache_bytes(**LLAMA8B, context_tokens=131_072)
    assert b == 131_072 * 131_072 == 2**34
    assert round(b / 1e9, 1) == 17.2


def test_kv_cache_scales_with_batch_and_is_zero_when_empty():
    one = rl.kv_cache_bytes(**LLAMA8B, context_tokens=1000)
    assert rl.kv_cache_bytes(**LLAMA8B, context_tokens=1000, batch=4) == 4 * one
    assert rl.kv_cache_bytes(**LLAMA8B, context_tokens=0) == 0


# --------------------------------------------------------------------- decode

def test_decode_ceiling_8gb_at_400gbs_is_50():
    assert rl.decode_ceiling_tok_s(400e9, 8e9) == pytest.approx(50.0)


def test_decode_ceiling_40gb_at_1_2tbs_is_30():
    assert rl.decode_ceiling_tok_s(1.2e12, 40e9) == pytest.approx(30.0)


def test_weight_bytes():
    assert rl.weight_bytes(8e9, 2) == 16e9
    assert rl.weight_bytes(134.5e6, 0.5) == pytest.approx(67.25e6)


def test_decode_bytes_per_token_adds_the_kv_read():
    kv = rl.kv_bytes_per_token(**LLAMA8B)
    assert rl.decode_bytes_per_token(16e9, kv, 0) == 16e9
    assert rl.decode_bytes_per_token(16e9, kv, 20_000) == pytest.approx(16e9 + 2.62144e9)
    # long context lowers the ceiling: 3.35 TB/s, 16 GB weights, 128k context
    at_128k = rl.decode_bytes_per_token(16e9, kv, 131_072)
    assert rl.decode_ceiling_tok_s(3.35e12, at_128k) == pytest.approx(3.35e12 / (16e9 + 2**34))


# -------------------------------------------------------------------- prefill

def test_prefill_flops_weights_only_is_2_params_tokens():
    assert rl.prefill_flops(8e9, 1000) == 2 * 8e9 * 1000


def test_prefill_flops_attention_term():
    # 2 x layers x hidden x T(T+1): the causal lower triangle of QK^T and AV
    assert rl.prefill_flops(8e9, 1000, n_layers=32, hidden_size=4096) == pytest.approx(
        2 * 8e9 * 1000 + 2 * 32 * 4096 * 1000 * 1001)
    # at 8k tokens attention is ~13% of an 8B model's prefill work
    total = rl.prefill_flops(8e9, 8192, n_layers=32, hidden_size=4096)
    share = 1 - 2 * 8e9 * 8192 / total
    assert 0.10 < share < 0.16


def test_prefill_flops_needs_both_attention_args():
    with pytest.raises(WorkbookError, match="both n_layers and hidden_size"):
        rl.prefill_flops(8e9, 1000, n_layers=32)


def test_prefill_ceiling():
    # 134.5 M params at 130 GFLOP/s: ~483 tok/s
    assert rl.prefill_ceiling_tok_s(130e9, 134.5e6) == pytest.approx(130e9 / 269e6)
    assert rl.prefill_ceiling_tok_s(989e12, 8e9) == pytest.approx(61_812.5)


# ------------------------------------------------------------------- roofline

def test_ridge_point_h100_bf16_is_about_295():
    assert rl.ridge_point(989e12, 3.35e12) == pytest.approx(295.2, abs=0.1)
    assert rl.ridge_point(312e12, 2.039e12) == pytest.approx(153.0, abs=0.1)


def test_arithmetic_intensity():
    assert rl.arithmetic_intensity(2e9, 1e9) == 2.0
    assert rl.arithmetic_intensity(0, 1e9) == 0.0


def test_decode_intensity_is_2b_over_bytes_per_param():
    assert rl.decode_intensity(2) == 1.0           # bf16, batch 1
    assert rl.decode_intensity(4) == 0.5           # fp32
    assert rl.decode_intensity(0.5) == 4.0         # int4
    assert rl.decode_intensity(2, batch=64) == 64.0


def test_crossover_batch():
    # bf16 on H100: decode is memory-bound up to ~295 sequences
    assert rl.crossover_batch(989e12, 3.35e12, 2) == pytest.approx(295.2, abs=0.1)
    # at the crossover batch, decode's intensity 2 b / bytes_per_param is the ridge point
    b = rl.crossover_batch(100e9, 35e9, 4)
    assert 2 * b / 4 == pytest.approx(rl.ridge_point(100e9, 35e9))


# ------------------------------------------------------------- request time

@pytest.mark.parametrize("prompt, prefill, out, decode, ttft, dec, total, ttft_pct", [
    (1_000, 2_000, 300, 40, 0.5, 7.5, 8.0, 6),       # short prompt: 94% decode
    (12_000, 1_500, 500, 40, 8.0, 12.5, 20.5, 39),   # RAG prompt: 39% TTFT
])
def test_request_time_seed_examples(prompt, prefill, out, decode, ttft, dec, total, ttft_pct):
    t = rl.request_time(prompt, prefill, out, decode)
    assert (t.ttft_s, t.decode_s, t.total_s) == pytest.approx((ttft, dec, total))
    assert round(t.ttft_share * 100) == ttft_pct and round(t.decode_share * 100) == 100 - ttft_pct
    assert t.as_dict()["total_s"] == pytest.approx(total)


def test_request_time_without_output_is_all_prefill():
    t = rl.request_time(100, 1000, 0, 40)
    assert t.total_s == pytest.approx(0.1) and t.ttft_share == 1.0


# ------------------------------------------------------------------ capacity

def test_max_context_tokens_8b_on_80gb():
    kv = rl.kv_bytes_per_token(**LLAMA8B)
    # 80 GB x 0.9 - 16 GB = 56 GB of KV at 131,072 B/token
    assert rl.max_context_tokens(80e9, 16e9, kv) == math.floor(56e9 / 131_072) == 427_246
    assert rl.max_context_tokens(80e9, 16e9, kv, batch=8) == math.floor(56e9 / 131_072 / 8)
    assert rl.max_context_tokens(80e9, 16e9, kv, reserve_fraction=0) == math.floor(64e9 / 131_072)


def test_max_context_tokens_weights_too_big():
    with pytest.raises(OutOfMemoryError, match=r"140\.00 GB.*smaller dtype"):
        rl.max_context_tokens(80e9, 140e9, 131_072)


# ----------------------------------------------------------------- bad input

@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "8e9", None, True])
def test_bad_bandwidth_or_bytes_raise_clearly(bad):
    with pytest.raises(WorkbookError, match="bandwidth_bytes_s must be a positive number"):
        rl.decode_ceiling_tok_s(bad, 8e9)
    with pytest.raises(WorkbookError, match="bytes_per_token must be a positive number"):
        rl.decode_ceiling_tok_s(400e9, bad)


@pytest.mark.parametrize("bad", [0, -5, 1.5, "10", None])
def test_bad_token_counts_raise_invalid_token_count(bad):
    with pytest.raises(InvalidTokenCountError, match="prompt_tokens must be a positive whole"):
        rl.request_time(bad, 2000, 300, 40)
    with pytest.raises(InvalidTokenCountError, match="n_tokens"):
        rl.prefill_flops(8e9, bad)


def test_negative_context_and_output_raise():
    with pytest.raises(InvalidTokenCountError, match="context_tokens must be zero or"):
        rl.kv_cache_bytes(**LLAMA8B, context_tokens=-1)
    with pytest.raises(InvalidTokenCountError, match="output_tokens must be zero or"):
        rl.request_time(100, 1000, -3, 40)


def test_bad_shapes_and_fractions_raise():
    with pytest.raises(WorkbookError, match="n_kv_heads must be a positive whole number"):
        rl.kv_bytes_per_token(32, 0, 128, 2)
    with pytest.raises(WorkbookError, match="batch must be a positive whole number"):
        rl.decode_intensity(2, batch=0)
    with pytest.raises(WorkbookError, match=r"reserve_fraction must be a fraction in \[0, 1\)"):
        rl.max_context_tokens(80e9, 16e9, 131_072, reserve_fraction=1.0)
    with pytest.raises(WorkbookError, match="bytes_per_elem"):
        rl.kv_bytes_per_token(32, 8, 128, -2)


def test_errors_are_value_errors_for_plain_except():
    with pytest.raises(ValueError):
        rl.ridge_point(-1, 1)


def test_attention_flops_is_the_causal_triangle():
    # prefill of T: every query sees itself and the earlier ones: 4·L·d·T(T+1)/2
    assert rl.attention_flops(2, 8, 4) == 4 * 2 * 8 * (1 + 2 + 3 + 4)
    # one decode step at context c sees c + 1 keys
    assert rl.attention_flops(2, 8, 1, cached_tokens=99) == 4 * 2 * 8 * 100
    # extend = the same keys as token-by-token
    assert rl.attention_flops(3, 16, 5, 10) == sum(rl.attention_flops(3, 16, 1, 10 + i) for i in range(5))
    with pytest.raises(WorkbookError, match="new_tokens"):
        rl.attention_flops(2, 8, 0)


def test_untied_input_embedding_is_not_read_per_token():
    # Llama-3-8B: 8.03 B parameters, untied 128,256 x 4,096 embedding, bf16
    read = rl.weight_bytes_read_per_token(8.03e9, 2, 128_256, 4_096, tied_embeddings=False)
    assert 14.9e9 < read < 15.1e9
    assert rl.weight_bytes_read_per_token(1e6, 4, 1000, 100, tied_embeddings=True) == 4e6
    with pytest.raises(WorkbookError, match="must exceed the embedding"):
        rl.weight_bytes_read_per_token(1e3, 2, 1000, 100, tied_embeddings=False)


def test_request_cost_prices_input_output_and_cache_hits():
    assert rl.request_cost(1_000_000, 0, 0.5, 2.0) == pytest.approx(0.5)
    assert rl.request_cost(1000, 500, 0.5, 2.0) == pytest.approx((1000 * 0.5 + 500 * 2.0) / 1e6)
    assert rl.request_cost(1000, 0, 1.0, 2.0, cached_input_tokens=800,
                           usd_per_m_cached_input=0.1) == pytest.approx((200 * 1.0 + 800 * 0.1) / 1e6)
    with pytest.raises(WorkbookError, match="cannot exceed"):
        rl.request_cost(10, 0, 1, 1, cached_input_tokens=11)
    with pytest.raises(WorkbookError, match="input_tokens"):
        rl.request_cost(-1, 0, 1, 1)
    assert rl.request_cost(20e3, 0, 1.0, 1.0) == pytest.approx(0.02)  # 20e3 is a count, as everywhere


# ------------------------------------------------- materialized attention scores, ceilings of a request

def test_attention_score_bytes_grows_with_the_square_of_the_context():
    one = rl.attention_score_bytes(1, 9, 2_048)  # one layer, 9 heads, float32, one pass
    assert one == 9 * 2_048 * 2_048 * 4 == pytest.approx(151e6, rel=0.01)
    assert rl.attention_score_bytes(1, 9, 4_096) == 4 * one
    assert rl.attention_score_bytes(30, 9, 2_048, passes=8) == 240 * one
    # one decode step: one query row against everything cached
    assert rl.attention_score_bytes(1, 9, 1, 2_047) == one / 2_048


def test_attention_score_bytes_rejects_bad_input():
    with pytest.raises(WorkbookError):
        rl.attention_score_bytes(1, 9, 0)
    with pytest.raises(WorkbookError):
        rl.attention_score_bytes(1, 9, 16, passes=0)


def test_ceiling_speeds_and_request_time_for_llama3_8b_on_h100():
    params = 8_030_261_248
    read = rl.weight_bytes_read_per_token(params, 2, 128_256, 4_096, tied_embeddings=False)
    pf, dc = rl.ceiling_speeds(params, 2, 989.4e12, 3.35e12, read)
    assert pf == pytest.approx(989.4e12 / (2 * params))
    assert dc == pytest.approx(223.2, abs=0.1)  # 15.0 GB read per token, not 16.1
    assert rl.ceiling_speeds(params, 2, 989.4e12, 3.35e12)[1] == pytest.approx(3.35e12 / (2 * params))
    t = rl.request_time_at_ceilings(1_000, 300, params, 2, 989.4e12, 3.35e12, read)
    assert (t.ttft_s, t.decode_s) == pytest.approx((1_000 / pf, 300 / dc))
    assert t.decode_share > 0.98


def test_ceiling_speeds_rejects_bad_input():
    with pytest.raises(WorkbookError):
        rl.ceiling_speeds(8e9, 2, 0, 3.35e12)
    with pytest.raises(WorkbookError):
        rl.ceiling_speeds(8e9, 2, 989e12, 3.35e12, bytes_read_per_token=-1)


def test_max_sequences_is_memory_over_kv_per_sequence():
    from utils.roofline import kv_bytes_per_token, max_sequences

    kv = kv_bytes_per_token(32, 8, 128, 2)  # Llama 3 8B, bf16: 128 KiB per token
    assert max_sequences(80e9, 16e9, kv, 32_768) == 13  # (72 - 16) GB / 4 GiB
    assert max_sequences(80e9, 16e9, kv, 4_096) == int((72e9 - 16e9) // (kv * 4096))
    assert max_sequences(80e9, 16e9, kv, 10**7) == 0
    with pytest.raises(OutOfMemoryError):
        max_sequences(16e9, 16e9, kv, 4_096)


# ----------------------------------------------------------------------------- what a token costs


def test_cost_per_million_tokens_is_the_hourly_price_over_the_token_rate():
    cost_per_million_tokens, token_costs = rl.cost_per_million_tokens, rl.token_costs
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)  # $0.001/s over 1,000 tok/s
    costs = token_costs(2.0, prefill_tok_s=1000.0, decode_tok_s=40.0)
    assert costs.input_usd_per_m == pytest.approx(2 / 3.6) and costs.output_usd_per_m == pytest.approx(2 / 3.6 * 25)
    assert costs.output_over_input == pytest.approx(25.0)
    for bad in (lambda: cost_per_million_tokens(0, 10), lambda: cost_per_million_tokens(1, 0),
                lambda: token_costs(-1, 10, 10), lambda: token_costs(1, 10, float("nan"))):
        with pytest.raises(WorkbookError):
            bad()


# ------------------------------------------------------------------- the chapters' timing predictions

def test_prefill_params_leave_out_the_lm_head():
    # SmolLM2-135M in float32: tied embeddings, every weight read once per decode step.
    read = 134_515_008 * 4
    assert rl.prefill_params(read, 4, 49_152, 576) == 134_515_008 - 49_152 * 576
    with pytest.raises(WorkbookError, match="LM head"):
        rl.prefill_params(1_000 * 4, 4, 49_152, 576)


def test_prefill_over_decode_is_the_ratio_of_the_two_ceilings():
    # 130 GFLOP/s over 2 x 106 M params = 613 tok/s; 35 GB/s over 538 MB = 65 tok/s
    ratio = rl.prefill_over_decode(130e9, 35e9, 106e6, 538e6)
    assert ratio == pytest.approx((130e9 / (2 * 106e6)) / (35e9 / 538e6))
    assert 9 < ratio < 10
    assert rl.prefill_over_decode(260e9, 35e9, 106e6, 538e6) == pytest.approx(2 * ratio)  # faster matmuls


def test_growth_with_fixed_cost():
    assert rl.growth_with_fixed_cost(0.06, 0.025, 0.8) == pytest.approx(0.86 / 0.085)
    assert rl.growth_with_fixed_cost(1.0, 0.0, 0.01) == pytest.approx(1.01)  # the fixed cost hides the work
    with pytest.raises(WorkbookError):
        rl.growth_with_fixed_cost(0.0, 0.1, 0.2)


def test_step_costs_no_cache_grows_with_context_and_cached_stays_near_the_fixed_cost():
    costs = rl.CacheStepModel(fixed_s=0.05, flops_per_s=100e9, bandwidth_bytes_s=30e9, block_params=106e6,
                         kv_bytes_per_token=46_080, n_layers=30, n_heads=9, head_dim=64)
    c = 512
    flops = 2 * 106e6 * c + 2 * rl.attention_flops(30, 576, c)
    assert costs.no_cache_s(c, traffic=False) == pytest.approx(0.05 + flops / 100e9)
    assert costs.cached_s(c, traffic=False) == pytest.approx(0.05 + 46_080 * c / 30e9)
    assert costs.no_cache_s(c) - costs.no_cache_s(c, False) == pytest.approx(
        rl.attention_score_bytes(30, 9, c, 0, 4, 8) / 30e9)
    assert costs.no_cache_s(c) / costs.cached_s(c) > 10 > costs.no_cache_s(32) / costs.cached_s(32)


# ----------------------------------------------------------------------------- fitting measured prefill passes

GRID = [16, 32, 64, 128, 256, 512, 1024]


def _physics(n: int, fixed: float = 0.05, token: float = 0.002, pair: float = 1e-7) -> float:
    return fixed + n * token + n * (n + 1) / 2 * pair


def test_prefill_fit_recovers_the_three_terms_of_the_physics():
    fit = rl.fit_prefill_time(GRID, [_physics(n) for n in GRID])
    assert (fit.fixed_s, fit.per_token_s, fit.per_pair_s) == pytest.approx((0.05, 0.002, 1e-7), rel=1e-6)
    assert fit.worst_residual < 1e-9 and fit.seconds(2000) == pytest.approx(_physics(2000))
    assert fit.rate_tok_s == pytest.approx(500) and fit.attention_share(1000) == pytest.approx(
        1000 * 1001 / 2 * 1e-7 / _physics(1000))


def test_one_fast_long_point_cannot_make_the_fixed_cost_negative():
    times = [_physics(n, pair=1e-6) for n in GRID]
    times[-1] *= 1.2  # one slow long pass on a convex curve: an unweighted line now starts below zero
    assert np.polyfit(GRID, times, 1)[1] < 0
    fit = rl.fit_prefill_time(GRID, times)
    assert fit.fixed_s == pytest.approx(0.05, rel=0.1)  # the short prompts still set the fixed cost
    assert min(fit.fixed_s, fit.per_token_s, fit.per_pair_s) >= 0 and fit.worst_residual > 0.05


def test_prefill_fit_leaves_attention_out_below_four_lengths_and_refuses_falling_times():
    fit = rl.fit_prefill_time([32, 128, 256], [_physics(n) for n in (32, 128, 256)])
    assert fit.per_pair_s == 0 and fit.worst_residual < 0.05
    assert rl.fit_prefill_time([64, 64], [0.1, 0.1]).per_token_s == pytest.approx(0.1 / 64)
    with pytest.raises(WorkbookError, match="do not grow"):
        rl.fit_prefill_time([10, 100, 1000], [0.2, 0.1, 0.15])


def test_linear_bytes_counts_weights_and_their_scales():
    shapes = [(64, 96), (32, 64)]
    assert rl.linear_bytes(shapes, 32, scale_bits=0) == 4 * (64 * 96 + 32 * 64)
    assert rl.linear_bytes(shapes, 8) == 64 * (96 + 2) + 32 * (64 + 2)  # int8 + a bf16 scale per row
    # int4, a bf16 scale and zero point per group of 32 inputs: 96 inputs are 3 groups, 64 are 2
    assert rl.linear_bytes(shapes, 4, group=32, zero_point=True) == 64 * (96 / 2 + 3 * 4) + 32 * (64 / 2 + 2 * 4)
    assert rl.linear_bytes([(8, 33)], 4, group=32) == 8 * (33 * 4 + 2 * 16) / 8  # a partial group keeps its scale
    with pytest.raises(WorkbookError):
        rl.linear_bytes(shapes, 4, group=0)


def test_tokens_that_fit_is_none_where_the_weights_leave_no_room():
    assert rl.tokens_that_fit(80e9, 16e9, 131_072, 1, 0.1) == rl.max_context_tokens(80e9, 16e9, 131_072, 1, 0.1)
    assert rl.tokens_that_fit(16e9, 16e9, 131_072, 1, 0.0) is None

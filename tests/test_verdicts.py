"""Machine-dependent conclusions follow the numbers: two synthetic machines, opposite verdicts.

"AVX2-like": bf16 matmuls emulated, slower than fp32. "AVX-512-like": native bf16, faster.
"""

from __future__ import annotations

import pytest

from utils import verdicts as V

AVX2 = dict(fp32_prefill=300.0, bf16_prefill=75.0, fp32_decode=20.0, bf16_decode=31.0)
AVX512 = dict(fp32_prefill=630.0, bf16_prefill=1070.0, fp32_decode=25.6, bf16_decode=46.8)


@pytest.mark.parametrize("m, prefill_winner", [(AVX2, "float32"), (AVX512, "bfloat16")])
def test_faster_dtype_follows_the_numbers(m, prefill_winner):
    s = V.compare_speeds("float32", m["fp32_prefill"], "bfloat16", m["bf16_prefill"], what="prefills")
    assert s.startswith(f"{prefill_winner} prefills") and "faster" in s
    assert V.compare_speeds("float32", m["fp32_decode"], "bfloat16", m["bf16_decode"]).startswith("bfloat16")


def test_a_small_gap_is_a_tie():
    assert "about the same" in V.compare_speeds("a", 100.0, "b", 104.0)
    assert "1.20x faster" in V.compare_speeds("a", 100.0, "b", 120.0)


def test_agreement_says_all_only_when_all():
    assert V.agreement(64, 64) == "matched the baseline on all 64 tokens"
    assert V.agreement(67, 144) == "matched the baseline on 67 of 144 tokens (47%)"


def test_relative_change():
    assert V.relative_change("perplexity", 10.66, 10.0) == "perplexity rises by 6.6%"
    assert V.relative_change("perplexity", 9.8, 10.0) == "perplexity falls by 2.0%"


def test_measured_vs_predicted():
    assert "within 25%" in V.measured_vs_predicted("no-cache / cached", 35.0, 32.0)
    assert "2.1x more than the model explains" in V.measured_vs_predicted("no-cache / cached", 68.0, 32.0)


@pytest.mark.parametrize("share, matmul_share, expect", [
    (0.79, 0.9, "bandwidth-bound"),
    (0.27, 0.8, "one-row matmul kernel's effective bandwidth"),
    (0.10, 0.3, "per-operator overhead")])
def test_decode_limit_follows_the_profile(share, matmul_share, expect):
    assert expect in V.decode_limit(share, matmul_share, 16.7, 50.0)

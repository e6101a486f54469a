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
def test_decode_bound_follows_the_profile(share, matmul_share, expect):
    assert expect in V.decode_bound(share, matmul_share, 16.7, 50.0)


# prefill at a short and a long prompt on the two synthetic machines (seconds):
# AVX2-like fp32: slow matmuls, so even 16 tokens are mostly compute; AVX-512-like: fast
# matmuls, so at 16 tokens the fixed cost of a pass dominates and neither floor explains it.
PREFILL_AVX2 = dict(n_tokens=512, measured_s=1.30, compute_s=1.05, memory_s=0.010, fixed_s=0.03)
PREFILL_AVX512_SHORT = dict(n_tokens=16, measured_s=0.0626, compute_s=0.0198, memory_s=0.0107, fixed_s=0.040)
PREFILL_AVX512_SHORT_SLOW_MM = dict(n_tokens=16, measured_s=0.0626, compute_s=0.0198, memory_s=0.0107, fixed_s=0.005)


def test_prefill_bound_follows_the_floors():
    assert "compute-bound here" in V.prefill_bound(**PREFILL_AVX2)
    s = V.prefill_bound(**PREFILL_AVX512_SHORT)
    assert "neither explains it" in s and "fixed cost is what the roofline leaves out" in s and "64%" in s
    s = V.prefill_bound(**PREFILL_AVX512_SHORT_SLOW_MM)
    assert "matmuls, the other 57.6 ms, run at 34% of the rate of one large square matmul." in s
    long = dict(n_tokens=1024, measured_s=1.07, compute_s=0.71, memory_s=0.02, fixed_s=0.053)
    s = V.prefill_bound(**long, attention_s=0.33, attention_floor_s=0.10)  # chapter 03 at full settings
    assert "attention, the fit's n-squared term, 330.0 ms (31%), runs at 30% of the large-matmul rate" in s
    assert "run at 89% of the rate" in s and "the fixed cost and attention are what the roofline leaves out" in s
    alone = V.prefill_bound(**long)  # (0.71 - 0.10) / (1.07 - 0.053 - 0.33) above; 0.71 / (1.07 - 0.053) here
    assert "attention" not in alone and "run at 70% of the rate of one large square matmul." in alone
    gpu = dict(n_tokens=16, measured_s=0.0012, compute_s=0.0001, memory_s=0.0011, fixed_s=0.0)
    assert "memory-bandwidth-bound here" in V.prefill_bound(**gpu)


def test_slowest_stream_follows_the_column():
    avx512 = {"[192, 576]": 16.4, "[576, 576]": 16.6, "[49152, 576]": 16.4}  # the column of finding 5
    assert "about the same rate" in V.slowest_stream(avx512)
    avx2 = {"[192, 576]": 6.1, "[576, 576]": 11.0, "[49152, 576]": 14.2}
    s = V.slowest_stream(avx2)
    assert s.startswith("[192, 576] streams slowest (6.1 GB/s), 2.33x below") and "[49152, 576]" in s


# 00's decode share on two synthetic machines: an "AVX2-like" one whose bf16/fp32 one-row matmuls
# stream far below the probe, an "AVX-512-like" GPU-ish one close to it; plus cache-resident and noisy.
@pytest.mark.parametrize("low, high, noisy, expect", [
    (0.12, 0.14, False, "the rest goes to something else"),
    (0.78, 0.82, False, "close to it, so streaming the weights bounds decode"),
    (0.60, 0.75, False, "probes disagree"),
    (1.3, 1.5, False, "came from caches"),
    (0.78, 0.82, True, "NOISY")])
def test_decode_share_follows_the_numbers(low, high, noisy, expect):
    s = V.decode_share(low, high, noisy=noisy)
    assert expect in s and f"{low:.0%}" in s


def test_decode_share_one_number_when_the_probes_agree():
    assert "reaches 27% of" in V.decode_share(0.271, 0.272)


# gap_explained: "AVX2-like" (slow elementwise work: the score traffic explains the gap) against
# "AVX-512-like" (fast score passes, matmuls below the probe: the traffic closes only part of it).
@pytest.mark.parametrize("measured, base, with_term, expect", [
    (68.0, 32.0, 60.0, "accounts for the measurement"),           # AVX2-like
    (68.0, 32.0, 41.0, "closes 25% of the gap"),                    # AVX-512-like
    (30.0, 32.0, 41.0, "no gap for it to explain"),                 # measured at or below the base
    (45.0, 32.0, 80.0, "overshoots the measurement by 78%"),
])
def test_gap_explained_follows_the_numbers(measured, base, with_term, expect):
    s = V.gap_explained("no-cache / cached at 2,048", measured, base, with_term, "the score-matrix traffic")
    assert expect in s and f"{measured:,.3g}" in s


# decode of four variants (fp32, bf16, int8 kernel, int4 kernel) on the two synthetic machines:
# AVX-512-like: native bf16, step time follows the bytes; AVX2-like: bf16 emulated, slower than fp32.
SPEED_NAMES = ("fp32", "bf16", "int8", "int4")
SPEED_BYTES = (540e6, 270e6, 145e6, 110e6)
SPEED_AVX512 = (26.7, 57.0, 92.5, 111.7)
SPEED_AVX2 = (25.0, 18.0, 60.0, 70.0)


def test_fit_step_time_recovers_a_line():
    floor, per_byte = V.fit_step_time([1e8, 2e8, 4e8], [1 / (0.002 + b / 20e9) for b in (1e8, 2e8, 4e8)])
    assert floor == pytest.approx(0.002) and 1 / per_byte == pytest.approx(20e9)
    with pytest.raises(ValueError):
        V.fit_step_time([1e8, 1e8], [10.0, 12.0])


def test_speed_follows_bytes_on_both_machines():
    fast = V.speed_follows_bytes(SPEED_NAMES, SPEED_BYTES, SPEED_AVX512)
    assert "fp32 14.4, bf16 15.4" in fast and "still scales with the bytes read" in fast
    slow = V.speed_follows_bytes(SPEED_NAMES, SPEED_BYTES, SPEED_AVX2)
    assert "bf16 reads 2.0x fewer bytes than fp32 yet runs 1.39x slower" in slow
    assert "does not follow bytes alone" in slow and "still scales" not in slow


def test_speed_follows_bytes_down_to_a_floor():
    speeds = [1 / (0.010 + b / 50e9) for b in SPEED_BYTES]  # a 10 ms floor: most of the int4 step
    assert "where the fixed floor is most of the step: halving its bytes again would gain at most 1.10x" in (
        V.speed_follows_bytes(SPEED_NAMES, SPEED_BYTES, speeds))
    flat = V.speed_follows_bytes(SPEED_NAMES, SPEED_BYTES, (30.0, 30.0, 30.0, 30.0))
    assert "bytes do not set the step time" in flat


@pytest.mark.parametrize("share, matmul_share, matmul_GBps, probe_GBps, expect", [
    (0.27, 0.80, 16.7, 50.0, "one-row matmul kernel's effective bandwidth"),  # AVX-512 box, matmuls far below the probe
    (0.59, 0.76, 26.2, 22.2, "the rest of the step (24% of it"),              # 2-vCPU box whose probe under-reads
    (0.10, 0.30, 30.0, 25.0, "the rest of the step (70% of it"),
    (0.80, 0.90, 30.0, 25.0, "bandwidth-bound")])
def test_decode_bound_never_calls_a_faster_stream_slow(share, matmul_share, matmul_GBps, probe_GBps, expect):
    s = V.decode_bound(share, matmul_share, matmul_GBps, probe_GBps)
    assert expect in s
    if matmul_GBps >= probe_GBps:
        assert "stream only" not in s


def test_decode_bound_says_above_only_when_above():
    below = V.decode_bound(0.49, 0.79, 25.8, 27.9)  # this machine's run: 92% of the probe
    assert "92% of the 27.9 GB/s probed" in below and "above" not in below
    assert "above the 22.2 GB/s probed" in V.decode_bound(0.59, 0.76, 26.2, 22.2)


def test_ridge_from_curve_finds_the_knee_or_says_beyond():
    from utils.verdicts import batch_curve_verdict, ridge_from_curve

    batches = [1, 2, 4, 8, 16, 32, 64]
    step = [max(0.040, 0.005 * b) for b in batches]  # flat until batch 8, then 5 ms per sequence
    assert ridge_from_curve(batches, step) == pytest.approx(8.0)
    assert ridge_from_curve([1, 2, 4], [0.04, 0.041, 0.043]) is None
    assert "beyond batch 4" in batch_curve_verdict([1, 2, 4], [0.04, 0.041, 0.043], 30)
    assert "bent at batch ~8" in batch_curve_verdict(batches, step, 8.0)
    with pytest.raises(ValueError):
        ridge_from_curve([2, 4], [0.1, 0.2])
    # the EPYC curve: batch 2 dearer than batch 4; pooled, it no longer drags the knee to ~1.2
    assert ridge_from_curve([1, 2, 4, 8], [0.0611, 0.0990, 0.0832, 0.120]) == pytest.approx(0.0611 / (0.120 / 8))


def test_best_goodput_names_the_split_that_sustains_the_most_load_or_a_tie():
    said = V.best_goodput({"4 colocated": 0.18, "2 prefill + 2 decode": 0.96, "1 prefill + 3 decode": 0.5}, 0.1, 2.0)
    assert said == ("2 prefill + 2 decode has the most goodput: 0.96 req/s with 90% of requests on time, "
                    "5.3x 4 colocated's 0.18 req/s.")
    assert "no split beats 4 colocated" in V.best_goodput({"4 colocated": 1.0, "B": 0.5}, 0.1, 2.0)
    assert "a tie at these loads" in V.best_goodput({"4 colocated": 1.0, "B": 1.02}, 0.1, 2.0)
    assert "at least 2 req/s" in V.best_goodput({"A": 1.0, "B": 2.0}, 0.1, 2.0)
    assert "A misses it even at 0.1" in V.best_goodput({"A": 0.0, "B": 1.0}, 0.1, 2.0)
    assert V.best_goodput({"A": 0.0, "B": 0.0}, 0.1, 2.0).startswith("none keeps 90%")

def test_decide_near_judges_both_sides_of_the_band(capsys):
    from utils.decide import PASSED, UNDECIDED, TimingCheckFailed
    assert V.decide_near("total / predicted", [0.95, 1.0, 1.1]) == (PASSED, PASSED)
    assert "✓ total / predicted < 2x" in capsys.readouterr().out
    with pytest.raises(TimingCheckFailed, match="total / predicted < 2x"):
        V.decide_near("total / predicted", [3.1, 3.0, 2.9])  # a planted slowdown
    with pytest.raises(TimingCheckFailed, match="total / predicted > 0.5x"):
        V.decide_near("total / predicted", [0.3, 0.31, 0.29])
    assert V.decide_near("noisy", [0.5, 1.0, 3.0]) == (UNDECIDED, UNDECIDED)
    # three rounds 0.9-1.15 against a band of a third: their IQR (12.5%) would decide it, their range says 20%
    assert V.decide_near("drifting", [0.9, 1.0, 1.15], low=0.75, high=1.33) == (UNDECIDED, UNDECIDED)
    assert "spread 20%" in capsys.readouterr().out
    assert V.decide_near("steady", [0.97, 1.0, 1.03], low=0.75, high=1.33) == (PASSED, PASSED)
    with pytest.raises(ValueError, match="3 or more"):
        V.decide_near("two", [1.0, 1.0])


def test_costlier_at_fewer_names_a_smaller_batch_that_costs_more_beyond_the_noise():
    from utils.timing import Timing
    steady = lambda ms: Timing((ms * 0.99e-3, ms * 1e-3, ms * 1e-3, ms * 1.01e-3))  # ~1% spread
    notes = V.costlier_at_fewer([1, 2, 4], [steady(61.1), steady(99.0), steady(83.2)])  # the EPYC run
    assert notes == ["a batch of 2 costs 19% more than a batch of 4 here, beyond their spreads: a slower kernel for "
                     "that shape on this machine (the cost models use the non-decreasing curve)"]
    assert V.costlier_at_fewer([1, 2, 4], [steady(37.3), steady(38.7), steady(61.7)]) == []  # rising: nothing to say
    noisy = lambda ms: Timing((ms * 0.7e-3, ms * 1e-3, ms * 1e-3, ms * 1.3e-3))
    assert V.costlier_at_fewer([2, 4], [noisy(99.0), noisy(83.2)]) == []  # within the noise
    said = V.costlier_at_fewer([2, 4], [steady(1.65), steady(1.38)], what="pass over {n} positions")
    assert said[0].startswith("a pass over 2 positions costs 20% more than a pass over 4 positions here")

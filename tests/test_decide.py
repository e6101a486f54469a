"""The one rule for timing checks, on synthetic timings: decided only when the prediction clears the noise."""

from __future__ import annotations

import math

import pytest

from utils import results
from utils.decide import (MIN_SPREAD, PASSED, UNDECIDED, Claim, TimingCheckFailed, clearance, decide,
                          decide_ratio, few_values_spread, is_decidable, ratio_spread)
from utils.errors import WorkbookError
from utils.timing import Timing


def steady(seconds: float, wobble: float = 0.01, n: int = 5) -> Timing:
    """``n`` samples around ``seconds`` spread by ``wobble`` (relative) each way."""
    return Timing(tuple(seconds * (1 + wobble * (2 * i / (n - 1) - 1)) for i in range(n)))


def test_a_large_predicted_effect_with_a_small_spread_is_decided_and_passes(capsys):
    assert decide("cache speeds decode", 8.0, bar=2.0, predicted=10.0, spread=0.1) == PASSED
    assert capsys.readouterr().out.startswith("✓ cache speeds decode: measured 8x > 2x")


def test_a_planted_regression_fails_a_decided_check():
    with pytest.raises(TimingCheckFailed, match="measured 1.02x, the check needs > 2x"):
        decide("cache speeds decode", 1.02, bar=2.0, predicted=10.0, spread=0.1)


def test_a_failure_is_an_assertion_error_so_nbval_and_pytest_report_it():
    assert issubclass(TimingCheckFailed, AssertionError)


def test_a_prediction_close_to_the_bar_is_not_decided_whatever_was_measured(capsys):
    # predicted 1.1x against a bar of 1.0x with 12% noise: the measured side means nothing.
    for measured in (0.9, 1.05, 1.3):
        assert decide("chunking lowers the worst gap", measured, bar=1.0, predicted=1.1, spread=0.12) == UNDECIDED
    out = capsys.readouterr().out
    assert out.count("not decided here: chunking lowers the worst gap: predicted 1.1x, spread 12%") == 3


def test_noise_turns_a_decided_check_into_an_undecided_one():
    assert is_decidable(3.0, 0.10, Claim("x", 2.0))  # ln 1.5 = 0.41 >= 2 * ln 1.1 = 0.19
    assert not is_decidable(3.0, 0.30, Claim("x", 2.0))  # 0.41 < 2 * ln 1.3 = 0.52


def test_the_spread_is_never_taken_below_its_floor():
    # A single sample reports zero spread; a prediction 5% past the bar is still not enough.
    assert not is_decidable(1.05, 0.0, Claim("x", 1.0))
    assert is_decidable(1.0 * (1 + MIN_SPREAD) ** 2.01, 0.0, Claim("x", 1.0))


def test_a_prediction_on_the_wrong_side_of_the_bar_is_not_decided(capsys):
    # The formula says the claim should not hold on this machine: nothing to check here.
    assert decide("bf16 faster than float32", 1.2, bar=1.0, predicted=0.6, spread=0.02) == UNDECIDED
    assert "not decided here" in capsys.readouterr().out


def test_below_claims_mirror_above_claims():
    claim = Claim("chunked gap below unchunked", 1.0, above=False)
    assert clearance(0.25, claim) == pytest.approx(math.log(4))
    assert decide(claim.name, 0.4, bar=1.0, predicted=0.25, spread=0.1, above=False) == PASSED
    with pytest.raises(TimingCheckFailed, match="< 1x"):
        decide(claim.name, 1.1, bar=1.0, predicted=0.25, spread=0.1, above=False)


def test_ratio_spread_adds_relative_spreads_in_quadrature():
    a, b = steady(1.0, 0.03), steady(2.0, 0.04)
    assert ratio_spread(a, b) == pytest.approx(math.hypot(a.relative_spread, b.relative_spread))
    assert ratio_spread(a, b) > max(a.relative_spread, b.relative_spread)


def test_few_values_spread_reads_what_their_range_implies_below_five_values():
    # three values: the IQR is half the range; the population IQR a normal sample's range implies is 0.797 of it
    assert Timing((0.9, 1.0, 1.15)).relative_spread == pytest.approx(0.125)
    assert few_values_spread([0.9, 1.0, 1.15]) == pytest.approx(0.25 * 1.349 / 1.693)
    assert few_values_spread([1.0, 1.15, 0.9, 1.05]) == pytest.approx(0.25 * 1.349 / 2.059 / 1.025)
    five = [0.9, 1.0, 1.0, 1.0, 1.15]  # from 5 values on, the IQR itself
    assert few_values_spread(five) == pytest.approx(Timing(tuple(five)).relative_spread) == 0.0
    assert few_values_spread([1.0, 1.0, 1.0]) == 0.0


def test_decide_ratio_divides_medians_and_combines_spreads():
    slow, fast = steady(0.5, 0.02), steady(0.1, 0.02)
    assert decide_ratio("no cache / cache", slow, fast, bar=2.0, predicted=6.0) == PASSED
    with pytest.raises(TimingCheckFailed):
        decide_ratio("no cache / cache", fast, fast, bar=2.0, predicted=6.0)
    noisy = Timing((0.1, 0.3, 0.5, 0.7, 0.9))
    assert decide_ratio("no cache / cache", noisy, fast, bar=2.0, predicted=3.0) == UNDECIDED
    # a prediction made from a noisy timing carries its spread: the same steady ratio is then not decided
    assert decide_ratio("no cache / cache", slow, fast, bar=2.0, predicted=3.0) == PASSED
    assert decide_ratio("no cache / cache", slow, fast, bar=2.0, predicted=3.0, predicted_from=(noisy,)) == UNDECIDED


def test_every_verdict_is_published_for_the_report(tmp_path, monkeypatch):
    path = tmp_path / "figures.jsonl"
    monkeypatch.setenv(results.ENV_FILE, str(path))
    monkeypatch.setenv(results.ENV_NOTEBOOK, "05_kv_cache")
    decide("a", 3.0, bar=2.0, predicted=4.0, spread=0.05)
    decide("b", 3.0, bar=2.0, predicted=2.1, spread=0.05)
    with pytest.raises(TimingCheckFailed):
        decide("c", 1.0, bar=2.0, predicted=4.0, spread=0.05)
    lines = [line for line in results.read_lines(path) if line["kind"] == "check"]
    assert [(c["name"], c["outcome"], c["notebook"]) for c in lines] == [
        ("a", "passed", "05_kv_cache"), ("b", "undecided", "05_kv_cache"), ("c", "failed", "05_kv_cache")]


@pytest.mark.parametrize("kwargs", [dict(measured=0.0), dict(bar=-1.0), dict(predicted=math.nan),
                                    dict(spread=-0.1), dict(spread=math.inf)])
def test_bad_numbers_get_a_clear_error(kwargs):
    args = dict(measured=2.0, bar=1.0, predicted=3.0, spread=0.1) | kwargs
    with pytest.raises(WorkbookError, match="timing check 'x'"):
        decide("x", args.pop("measured"), **args)

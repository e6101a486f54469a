"""Conclusions computed from this run's numbers, never typed from another machine's.

Which dtype is faster, what bounds decode, whether two outputs matched: these differ
from machine to machine (an AVX2-only CPU runs bf16 matmuls slower than fp32; one
with AVX-512-BF16 runs them faster). A chapter states the general rule in markdown
and prints the sentence for *this* machine from one of these functions, so the
sentence always agrees with the numbers printed beside it. Each function is tested
against synthetic measurements of both kinds (``tests/test_verdicts.py``).

A comparison within ``tie`` (relative) is called a tie, not a win: a 3 % gap on a
shared 2-core machine is noise.
"""

from __future__ import annotations

from .errors import check_number

TIE = 0.10
"""Relative gap below which two speeds are reported as about the same."""


def compare_speeds(name_a: str, a: float, name_b: str, b: float, *, unit: str = "tok/s",
                   what: str = "runs", tie: float = TIE) -> str:
    """"bf16 runs 1.90x faster than float32 (57.0 vs 30.0 tok/s)", or "about the same" within ``tie``."""
    a, b = check_number(a, name_a, unit), check_number(b, name_b, unit)
    hi_name, hi, lo_name, lo = (name_a, a, name_b, b) if a >= b else (name_b, b, name_a, a)
    numbers = f"({name_a} {a:,.1f} vs {name_b} {b:,.1f} {unit})"
    if hi / lo - 1 < tie:
        return f"{name_a} and {name_b} {what} at about the same speed on this machine {numbers}."
    return f"{hi_name} {what} {hi / lo:.2f}x faster than {lo_name} on this machine {numbers}."


def agreement(matched: int, total: int, what: str = "tokens") -> str:
    """"matched the baseline on all 64 tokens" or "on 67 of 144 tokens (47%)"."""
    if total <= 0:
        raise ValueError(f"total must be positive, got {total}")
    if matched == total:
        return f"matched the baseline on all {total} {what}"
    return f"matched the baseline on {matched} of {total} {what} ({matched / total:.0%})"


def relative_change(name: str, new: float, old: float) -> str:
    """"perplexity rises by 6.6%" / "falls by 2.0%" / "is unchanged"."""
    change = new / old - 1
    if abs(change) < 0.0005:
        return f"{name} is unchanged"
    return f"{name} {'rises' if change > 0 else 'falls'} by {abs(change):.1%}"


def measured_vs_predicted(what: str, measured: float, predicted: float, *, close: float = 0.25) -> str:
    """"measured 68x against 32x predicted: 2.1x more than the model explains" or "within 25% of it"."""
    ratio = measured / predicted
    if abs(ratio - 1) <= close:
        return f"{what}: measured {measured:,.3g} against {predicted:,.3g} predicted, within {close:.0%} of the prediction."
    side = "more" if ratio > 1 else "less"
    return (f"{what}: measured {measured:,.3g} against {predicted:,.3g} predicted, {max(ratio, 1 / ratio):.1f}x "
            f"{side} than the model explains.")


def decode_limit(share_of_ceiling: float, matmul_share_of_step: float, matmul_GBps: float,
                 probe_GBps: float) -> str:
    """What bounds decode here, from the step's profile and the bandwidth reached.

    - near the ceiling (share >= 70 %): memory bandwidth;
    - matmuls are most of the step but stream far below the probe: the matmul kernel's
      effective bandwidth (one row through each weight matrix) -- time still scales with bytes;
    - matmuls are a minority of the step: per-operator overhead (dispatch, small kernels).
    """
    if share_of_ceiling >= 0.7:
        return (f"Decode reaches {share_of_ceiling:.0%} of the bandwidth ceiling: it is bandwidth-bound "
                "here, and fewer bytes per token is the only way to go faster.")
    if matmul_share_of_step >= 0.5:
        return (f"Decode reaches {share_of_ceiling:.0%} of the ceiling. The matmuls take {matmul_share_of_step:.0%} "
                f"of the step but stream only {matmul_GBps:.1f} GB/s against {probe_GBps:.1f} GB/s probed: decode "
                "is limited by the one-row matmul kernel's effective bandwidth, and its time still scales "
                "with the bytes read.")
    return (f"Decode reaches {share_of_ceiling:.0%} of the ceiling and the matmuls take only "
            f"{matmul_share_of_step:.0%} of the step: per-operator overhead (dispatch, small kernels) "
            "bounds decode here, not the bytes.")

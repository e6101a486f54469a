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

import math
from typing import Sequence

from .decide import decide, few_values_spread, ratio_spread
from .errors import check_number
from .simulator import Validation, non_decreasing
from .timing import Timing

TIE = 0.10
"""Relative gap below which two speeds are reported as about the same."""


def compare_speeds(name_a: str, a: float, name_b: str, b: float, *, unit: str = "tok/s",
                   what: str = "runs", tie: float = TIE) -> str:
    """"bf16 runs 1.90x faster than float32 (57.0 vs 30.0 tok/s)", or "about the same" within ``tie``."""
    a, b = check_number(a, name_a, unit), check_number(b, name_b, unit)
    hi_name, hi, lo_name, lo = (name_a, a, name_b, b) if a >= b else (name_b, b, name_a, a)
    numbers = f"({name_a} {a:,.1f} vs {name_b} {b:,.1f} {unit})"
    if hi / lo - 1 < tie:
        return f"{name_a} {what} at about the same speed as {name_b} on this machine {numbers}."
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


def _decode_below_probe(share_of_ceiling: float, matmul_share_of_step: float, matmul_GBps: float,
                        probe_GBps: float) -> str:
    """:func:`decode_bound` where the matmuls stream well below the probe (or decode is near the ceiling).

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


def prefill_bound(n_tokens: int, measured_s: float, compute_s: float, memory_s: float,
                  fixed_s: float, *, attention_s: float = 0.0, attention_floor_s: float = 0.0,
                  explained: float = 0.7) -> str:
    """What sets the time of one prefill pass of ``n_tokens``, from the roofline's two floors.

    ``compute_s`` = FLOPs / measured large-matmul FLOP/s, ``memory_s`` = bytes read / bandwidth,
    ``fixed_s`` = the cost of a pass whatever its length (the fixed term of
    :func:`utils.roofline.fit_prefill_time`), ``attention_s`` = that fit's attention term at
    ``n_tokens`` and ``attention_floor_s`` = attention's FLOPs / FLOP/s (its part of ``compute_s``).
    When the larger floor explains at least ``explained`` of the measured time, that limit binds;
    otherwise the time is split into the fixed cost, attention and the weights' matmuls, each with
    the rate it runs at against one large square matmul.
    """
    t = check_number(measured_s, "measured_s", "seconds")
    floor = max(check_number(compute_s, "compute_s", "seconds"), check_number(memory_s, "memory_s", "seconds"))
    which = "compute" if compute_s >= memory_s else "memory-bandwidth"
    head = (f"At n = {n_tokens:,}: measured {t * 1e3:,.1f} ms against roofline floors of {compute_s * 1e3:,.1f} ms "
            f"(compute) and {memory_s * 1e3:,.1f} ms (memory)")
    if floor >= explained * t:
        return f"{head}; the {which} floor explains {floor / t:.0%} of it: prefill is {which}-bound here."
    fixed = min(max(fixed_s, 0.0), t)
    attn = min(max(attention_s, 0.0), t - fixed)
    attn_part = (f"; attention, the fit's n-squared term, {attn * 1e3:,.1f} ms ({attn / t:.0%}), runs at "
                 f"{attention_floor_s / attn:.0%} of the large-matmul rate" if attn >= 0.01 * t else "")
    rest, matmul_floor = t - fixed - attn, max(compute_s - attention_floor_s, 0.0)
    left_out = "the fixed cost and attention are" if attn_part else "the fixed cost is"
    why = (f"the weights' matmuls, the other {rest * 1e3:,.1f} ms, run at {matmul_floor / rest:.0%} of the rate of "
           "one large square matmul" + (f": near the compute floor, so {left_out} what the roofline leaves out"
                                        if rest * explained <= matmul_floor else ""))
    return (f"{head}; neither explains it (the larger is {floor / t:.0%} of it). The fixed cost of a pass "
            f"({fixed * 1e3:,.1f} ms) is {fixed / t:.0%} of it{attn_part}; {why}.")


def slowest_stream(rates: dict[str, float], *, unit: str = "GB/s", tie: float = TIE) -> str:
    """Which of several weight shapes streams slowest through a one-row matmul, or that none does.

    ``rates``: achieved bandwidth per shape (``{"[192, 576]": 16.4e9, ...}``, any one unit).
    """
    if not rates:
        raise ValueError("rates must name at least one shape")
    lo = min(rates, key=lambda k: rates[k])
    hi = max(rates, key=lambda k: rates[k])
    slow, fast = check_number(rates[lo], lo, unit), check_number(rates[hi], hi, unit)
    if fast / slow - 1 < tie:
        return (f"Every shape streams at about the same rate ({slow:,.1f} to {fast:,.1f} {unit}): "
                "no shape suffers more than another on this machine.")
    return (f"{lo} streams slowest ({slow:,.1f} {unit}), {fast / slow:.2f}x below the fastest, "
            f"{hi} ({fast:,.1f} {unit}).")


def decode_share(low: float, high: float, *, noisy: bool = False, near: float = 0.7) -> str:
    """How close measured decode came to the bandwidth ceiling, as a range over the probes' readings.

    ``low``/``high``: the share against the best and the worst bandwidth probe
    (:func:`utils.hardware.share_of_ceiling`). Above 100 %, part of the bytes came from
    caches faster than the probe's memory; at or above ``near``, streaming the weights
    bounds decode; below, the rest of each step goes elsewhere. ``noisy``: the decode
    timing's spread was too large to draw a conclusion from.
    """
    lo, hi = check_number(low, "low", "share"), check_number(high, "high", "share")
    span = f"{lo:.0%}" if round(lo, 2) == round(hi, 2) else f"{lo:.0%}-{hi:.0%}"
    head = f"Decode reaches {span} of the bandwidth ceiling on this machine (best-worst probe)"
    if noisy:
        return f"{head}, but the decode timing is NOISY: run it again before drawing a conclusion."
    if lo > 1.0:
        return (f"{head}: above it, so part of the bytes read per token came from caches faster than the "
                "memory the probe measured; the ceiling does not bind for a model this small here.")
    if lo >= near:
        return f"{head}: close to it, so streaming the weights bounds decode here."
    if hi >= near:
        return (f"{head}: near it against the worst probe only; the probes disagree too much to say "
                "whether bandwidth binds.")
    return (f"{head}: below it. Streaming the weights at the probed bandwidth accounts for only that share of "
            "each step; the rest goes to something else (matmul kernels streaming below the probe, "
            "per-operator overhead): chapter 04 profiles where.")


def gap_explained(what: str, measured: float, base: float, with_term: float, term: str) -> str:
    """How much of the gap between a measurement and a base prediction one more term of the model closes.

    ``base``: the prediction without ``term``; ``with_term``: with it. "the score-matrix traffic closes
    40% of the gap ...", "accounts for the gap", or that there was no gap to explain.
    """
    m, b, w = (check_number(x, n, "") for x, n in ((measured, "measured"), (base, "base"), (with_term, "with_term")))
    head = f"{what}: measured {m:,.3g}, predicted {b:,.3g} without {term} and {w:,.3g} with it"
    if m <= b * (1 + TIE):
        return f"{head}. The measurement is not above the prediction without {term}: there is no gap for it to explain."
    share = (w - b) / (m - b)
    if abs(w / m - 1) <= 0.25:
        return f"{head}. With {term} the model accounts for the measurement (within 25%)."
    if w > m:
        return f"{head}. With {term} the model overshoots the measurement by {w / m - 1:.0%}: it overestimates {term}."
    return (f"{head}. {term[0].upper() + term[1:]} closes {share:.0%} of the gap; the rest is a cost the model "
            "leaves out (e.g. kernels running below the probed FLOP/s or bandwidth).")


def fit_step_time(bytes_per_token: Sequence[float], tok_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares line through (bytes read per token, seconds per token) of several variants.

    ``(floor_s, seconds_per_byte)``: step ≈ floor + bytes x seconds_per_byte. The floor is
    what a step costs whatever it reads (dispatch, norms, attention); ``1 / seconds_per_byte``
    is the bandwidth the matmuls effectively stream at. Needs two or more distinct sizes.
    """
    xs = [check_number(b, "bytes_per_token", "bytes") for b in bytes_per_token]
    ys = [1 / check_number(t, "tok_s", "tokens per second") for t in tok_s]
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("fit_step_time needs as many speeds as sizes, and two or more distinct sizes.")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def _slower_with_fewer_bytes(names: Sequence[str], sizes: Sequence[float], speeds: Sequence[float],
                             tie: float) -> list[str]:
    """Sentences for each variant that reads fewer bytes than another yet runs slower (beyond ``tie``)."""
    found = []
    for i, j in ((i, j) for i in range(len(names)) for j in range(len(names))):
        if sizes[i] < sizes[j] and speeds[j] / speeds[i] - 1 >= tie:
            found.append(f"{names[i]} reads {sizes[j] / sizes[i]:.1f}x fewer bytes than {names[j]} yet runs "
                         f"{speeds[j] / speeds[i]:.2f}x slower: its kernel, not its bytes, sets its speed here.")
    return found


def speed_follows_bytes(names: Sequence[str], bytes_per_token: Sequence[float], tok_s: Sequence[float], *,
                        tie: float = TIE) -> str:
    """Does decode speed follow the bytes read per token, across variants (dtypes, quantizations)?

    Prints bytes x tok/s for each (the bandwidth each decode achieved), fits step = floor +
    bytes ÷ bandwidth, and says which bound holds: the matmuls' effective bandwidth (time
    scales with bytes), a fixed floor (at the smallest variant), or neither (a variant
    with fewer bytes runs slower).
    """
    achieved = ", ".join(f"{n} {b * t / 1e9:.1f}" for n, b, t in zip(names, bytes_per_token, tok_s))
    head = f"Bytes x tok/s (the bandwidth each decode achieved): {achieved} GB/s."
    exceptions = _slower_with_fewer_bytes(names, bytes_per_token, tok_s, tie)
    if exceptions:  # no one line fits: say which variant breaks the rule
        return f"{head} Speed does not follow bytes alone: " + " ".join(exceptions)
    floor, per_byte = fit_step_time(bytes_per_token, tok_s)
    if per_byte <= 0:
        return f"{head} Speed does not grow as bytes shrink here: bytes do not set the step time."
    small = min(range(len(names)), key=lambda i: bytes_per_token[i])
    floor_share = min(max(floor, 0.0) * tok_s[small], 1.0)
    fit = (f"Fit over the {len(names)} variants: step ≈ {max(floor, 0.0) * 1e3:.2f} ms + bytes ÷ "
           f"{1 / per_byte / 1e9:.1f} GB/s; the fixed part is {floor_share:.0%} of the {names[small]} step.")
    if floor_share >= 0.5:
        gain = 1 / (floor_share + (1 - floor_share) / 2)  # halving the smallest variant's bytes again
        return (f"{head} {fit} Fewer bytes made decode faster down to {names[small]}, where the fixed floor is "
                f"most of the step: halving its bytes again would gain at most {gain:.2f}x; removing the floor "
                "would gain more.")
    return (f"{head} {fit} Decode is limited by the matmul kernels' effective bandwidth and its time still "
            "scales with the bytes read; only a fixed floor remains beside it.")


def decode_bound(share_of_ceiling: float, matmul_share_of_step: float, matmul_GBps: float,
                 probe_GBps: float, *, at_probe: float = 0.9) -> str:
    """What bounds decode here, from the step's profile and the bandwidth reached.

    - near the ceiling (share >= 70 %): memory bandwidth;
    - matmuls are most of the step but stream far below the probe: the matmul kernel's
      effective bandwidth (one row through each weight matrix) -- time still scales with bytes;
    - matmuls are a minority of the step: per-operator overhead (dispatch, small kernels);
    - matmuls stream at the probe's rate or above it (``at_probe``): they already run at the memory's
      speed (a probe that a one-row matmul beats under-reads the bandwidth), and what keeps decode from
      the ceiling is the rest of the step.
    """
    if matmul_GBps < at_probe * check_number(probe_GBps, "probe_GBps", "GB/s") or share_of_ceiling >= 0.7:
        return _decode_below_probe(share_of_ceiling, matmul_share_of_step, matmul_GBps, probe_GBps)
    if matmul_GBps >= probe_GBps:
        rate = (f"above the {probe_GBps:.1f} GB/s probed: they run at the memory's speed (the probe "
                "under-reads it)")
    else:
        rate = (f"{matmul_GBps / probe_GBps:.0%} of the {probe_GBps:.1f} GB/s probed: they run at about "
                "the memory's speed")
    return (f"Decode reaches {share_of_ceiling:.0%} of the ceiling. The matmuls stream {matmul_GBps:.1f} GB/s, "
            f"{rate}, so what keeps decode from the ceiling is the rest of the step "
            f"({1 - matmul_share_of_step:.0%} of it in the profile): per-operator overhead, attention, the cache update.")


def ridge_from_curve(batches: Sequence[int], step_s: Sequence[float], *, rise: float = 1.5) -> float | None:
    """Where a measured decode step stops being flat in the batch: the knee of ``t(B) ≈ max(t1, B x c)``.

    ``t1`` is the batch-1 step; ``c`` (seconds per sequence once compute dominates) is the median
    of ``t(B) / B`` over the points whose step is more than ``rise`` x ``t1``. The knee is
    ``t1 / c``. None when no point rose that far: the ridge lies beyond the largest batch measured.
    The curve is made non-decreasing first (:func:`utils.simulator.non_decreasing`): a batch that costs
    more than a larger one (a slower kernel for that shape, :func:`costlier_at_fewer`) moves no knee.
    """
    pairs = sorted(zip(batches, (check_number(t, "step_s", "seconds") for t in step_s)))
    pairs = list(zip([b for b, _ in pairs], non_decreasing([t for _, t in pairs])))
    if len(pairs) < 2 or pairs[0][0] != 1:
        raise ValueError("ridge_from_curve needs the batch-1 step and at least one larger batch.")
    t1 = pairs[0][1]
    per_seq = sorted(t / b for b, t in pairs if t > rise * t1)
    if not per_seq:
        return None
    return t1 / per_seq[len(per_seq) // 2]


def costlier_at_fewer(sizes: Sequence[int], timings: Sequence[Timing], what: str = "batch of {n}") -> list[str]:
    """Where a pass over fewer rows (or positions) costs more than one over more, beyond both spreads.

    More rows never need less work, so such a point is a slower kernel for that shape on this
    machine (e.g. a matmul of 2 rows dispatched to a worse kernel than one of 4). One sentence per
    pair of neighbours; the cost models keep it out (:func:`utils.simulator.non_decreasing`).
    ``timings``: :class:`~utils.timing.Timing` per size (median and relative spread); ``what`` names
    one size (``{n}``), e.g. ``"pass over {n} positions"``.
    """
    notes = []
    for (a, ta), (b, tb) in zip(zip(sizes, timings), list(zip(sizes, timings))[1:]):
        excess = ta.median / tb.median - 1
        if excess > 2 * ratio_spread(ta, tb):
            notes.append(f"a {what.format(n=a)} costs {excess:.0%} more than a {what.format(n=b)} here, beyond their spreads: "
                         f"a slower kernel for that shape on this machine (the cost models use the non-decreasing curve)")
    return notes


def batch_curve_verdict(batches: Sequence[int], step_s: Sequence[float], predicted_ridge: float) -> str:
    """The sentence on a batch curve: how flat the step stayed and where it bent, against the roofline."""
    measured = ridge_from_curve(batches, step_s)
    b_max, growth = max(batches), step_s[list(batches).index(max(batches))] / step_s[list(batches).index(1)]
    flat = f"from batch 1 to {b_max} the step grew {growth:.1f}x while the tokens per step grew {b_max}x"
    if measured is None:
        return (f"{flat}: it never rose {1.5:.1f}x above batch 1, so the ridge lies beyond batch {b_max} "
                f"(the roofline predicts {predicted_ridge:,.0f}).")
    return (f"{flat}, and bent at batch ~{measured:,.0f} (the knee of the measured curve). "
            + measured_vs_predicted("Ridge batch", measured, predicted_ridge))


def best_goodput(goodputs: dict[str, float], lowest_load: float, highest_load: float, *, share: float = 0.9,
                 unit: str = "req/s", tie: float = TIE) -> str:
    """Which way of using the machines has the most goodput, from each one's (:meth:`Sweep.goodput`).

    ``goodputs``: label -> the highest load at which ``share`` of requests were on time, the first
    label the baseline (colocated); ``lowest_load`` / ``highest_load``: the loads tried. "2 prefill
    + 2 decode has the most goodput: 0.96 req/s with 90% on time, 5.3x 4 colocated's 0.18 req/s."
    """
    if not goodputs:
        raise ValueError("best_goodput needs at least one goodput.")
    base, *_ = goodputs
    best = max(goodputs, key=lambda k: (goodputs[k], k == base))
    g, g0 = goodputs[best], goodputs[base]
    if g == 0:
        return f"none keeps {share:.0%} of requests on time even at the lowest load tried ({lowest_load:.3g} {unit})."
    at_least = "at least " if g >= highest_load else ""
    head = f"{best} has the most goodput: {at_least}{g:.3g} {unit} with {share:.0%} of requests on time"
    if best == base or g <= g0 * (1 + tie):
        return (f"{head}; no split beats {base} by more than {tie:.0%}." if best == base else
                f"{head}, within {tie:.0%} of {base}'s {g0:.3g} {unit}: a tie at these loads.")
    than = f"{g / g0:.2g}x {base}'s {g0:.3g} {unit}" if g0 > 0 else f"{base} misses it even at {lowest_load:.3g} {unit}"
    return f"{head}, {than}."


def decide_near(name: str, ratios: Sequence[float], *, low: float = 0.5, high: float = 2.0,
                predicted: float = 1.0) -> tuple[str, str]:
    """Decide that measured / predicted stays within ``[low, high]``: two timing checks through
    :func:`utils.decide.decide`, on the median of ``ratios`` (one per repeat, ``>= 3`` for a spread).

    ``predicted``: the ratio the time model expects (1.0 when each ratio is measured over its own
    prediction). The spread: :func:`utils.decide.few_values_spread` of the ratios (below 5 rounds, what their
    range implies, not the half-range three values' IQR reads). Returns both verdicts (high, low).
    """
    if len(ratios) < 3:
        raise ValueError(f"{name}: a spread needs 3 or more ratios, got {len(ratios)}")
    t = Timing(tuple(check_number(r, name, "ratio") for r in ratios))
    spread = few_values_spread(t.samples)
    return (decide(f"{name} < {high:g}x", t.median, bar=high, predicted=predicted, spread=spread, above=False),
            decide(f"{name} > {low:g}x", t.median, bar=low, predicted=predicted, spread=spread))


def decide_simulator(validation: Validation, cost_noise: float, *, bar: float = 2.0) -> list[str]:
    """Decide, per figure of ``validation``, that the simulator is within ``bar``x of the served runs (either way).

    The spread: ``cost_noise`` (how well the costs fit their points: :func:`utils.simulator.fit_noise`), how
    far the simulated figure moved between the cost timings (a queue amplifies them) and the runs' own noise.
    """
    return [decide(f"the simulator's {a.what} within {bar:g}x of the measured run", max(a.ratio, 1 / a.ratio),
                   bar=bar, predicted=1.0, above=False,
                   spread=math.hypot(cost_noise, validation.sim_spread[a.what], validation.run_spread[a.what]))
            for a in validation.agreement]

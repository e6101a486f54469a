"""Deciding a timing check by its prediction and its noise: the one rule for every check on measured times.

A check on times ("the cached loop decodes faster than the uncached one", "chunked prefill lowers the worst
gap between tokens") is a claim about a **ratio** of measurements: ``measured > bar`` (or ``< bar``). Noise
can flip any such claim when the effect the chapter predicts sits close to the bar compared with how much
the measurements wobble. Retrying until it passes hides that; loosening the bar kills the check. Instead:

- ``predicted``: the ratio the chapter's formula expects on this machine (from bytes, FLOPs, or a
  measurement independent of the one checked, so a planted regression cannot move it);
- ``spread``: the measured ratio's relative uncertainty (:func:`ratio_spread` combines the spreads of
  the timings it divides; it is never taken below :data:`MIN_SPREAD`);
- the check is **decided** when the prediction clears the bar by at least :data:`MARGIN` spreads,
  ``|ln(predicted / bar)| >= MARGIN · ln(1 + spread)``, on the side the claim needs. Then the measured
  ratio must be on that side, or the check fails (a planted regression still fails it);
- otherwise it prints ``not decided here: <name>: predicted X, spread Y`` and returns
  :data:`UNDECIDED`: neither a pass nor a failure. The report and the gradebook count it as undecided.

Every verdict is also published with :func:`utils.results.record_check`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .errors import WorkbookError
from .results import record_check
from .timing import Timing

MARGIN = 2.0
"""How many spreads the prediction must clear the bar by for the check to be decided."""

MIN_SPREAD = 0.05
"""The smallest relative spread assumed: a few repeats under-read the noise, and timers have a grain."""

PASSED, UNDECIDED = "passed", "undecided"


class TimingCheckFailed(AssertionError):
    """A decided timing check whose measurement fell on the wrong side of its bar."""


@dataclass(frozen=True)
class Claim:
    """What a timing check states: ``measured > bar`` (``above=True``) or ``measured < bar``."""

    name: str
    bar: float
    above: bool = True

    def holds(self, value: float) -> bool:
        return value > self.bar if self.above else value < self.bar

    def __str__(self) -> str:
        return f"{'>' if self.above else '<'} {_x(self.bar)}"


def _x(ratio: float) -> str:
    return f"{ratio:.3g}x"


def ratio_spread(*timings: Timing) -> float:
    """Relative spread of a ratio of medians: the timings' relative spreads added in quadrature."""
    return math.sqrt(sum(t.relative_spread ** 2 for t in timings))


# A normal sample of n values spans d2(n) standard deviations on average, and its population's IQR is 1.349 of them.
_IQR_PER_RANGE = {3: 1.349 / 1.693, 4: 1.349 / 2.059}


def few_values_spread(values: Sequence[float]) -> float:
    """Relative spread of a few values (one per round): their IQR over their median, or, below 5 values, the
    population IQR their range implies (range × 1.349 / d2(n)) when that is larger.

    Three values' IQR is half their range, about 0.5σ on average against the population's 1.35σ: a check
    judged on three rounds then under-reads the machine's drift between them (chapter 06 failed on that)."""
    t = Timing(tuple(values))
    scale = _IQR_PER_RANGE.get(len(values), 0.0)
    return max(t.relative_spread, scale * (max(values) - min(values)) / t.median if t.median > 0 else 0.0)


def clearance(predicted: float, claim: Claim) -> float:
    """How far (in log units) the prediction lies past the bar on the claim's side; negative if short of it."""
    gap = math.log(predicted / claim.bar)
    return gap if claim.above else -gap


def is_decidable(predicted: float, spread: float, claim: Claim, margin: float = MARGIN) -> bool:
    """True when the prediction clears the bar by ``margin`` spreads (spread at least :data:`MIN_SPREAD`)."""
    return clearance(predicted, claim) >= margin * math.log1p(max(spread, MIN_SPREAD))


def _positive(name: str, **values: float) -> None:
    for key, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise WorkbookError(f"timing check {name!r}: {key} must be a positive finite number, got {v!r}.")


def decide(name: str, measured: float, *, bar: float, predicted: float, spread: float,
           above: bool = True, margin: float = MARGIN) -> str:
    """Decide the timing check ``measured > bar`` (or ``< bar`` with ``above=False``); see the module doc.

    Returns :data:`PASSED` or :data:`UNDECIDED` (and prints the verdict); raises
    :class:`TimingCheckFailed` (an ``AssertionError``) when decided and the measurement misses the bar.
    """
    _positive(name, measured=measured, bar=bar, predicted=predicted)
    if not (math.isfinite(spread) and spread >= 0):
        raise WorkbookError(f"timing check {name!r}: spread must be a finite number >= 0, got {spread!r}.")
    claim = Claim(name, bar, above)
    detail = f"predicted {_x(predicted)}, spread {max(spread, MIN_SPREAD):.0%}"
    if not is_decidable(predicted, spread, claim, margin):
        record_check(name, UNDECIDED, measured, bar, predicted, spread)
        print(f"not decided here: {name}: {detail} (bar {claim}; measured {_x(measured)}, not judged)")
        return UNDECIDED
    if not claim.holds(measured):
        record_check(name, "failed", measured, bar, predicted, spread)
        raise TimingCheckFailed(f"✗ {name}: measured {_x(measured)}, the check needs {claim} ({detail}, "
                                "so noise does not explain the miss)")
    record_check(name, PASSED, measured, bar, predicted, spread)
    print(f"✓ {name}: measured {_x(measured)} {claim} ({detail})")
    return PASSED


def decide_ratio(name: str, numerator: Timing, denominator: Timing, *, bar: float, predicted: float,
                 above: bool = True, margin: float = MARGIN, predicted_from: tuple[Timing, ...] = ()) -> str:
    """:func:`decide` on ``numerator.median / denominator.median`` with its :func:`ratio_spread`; where the
    prediction itself comes from other timings (``predicted_from``), their spreads are added in too."""
    return decide(name, numerator.median / denominator.median, bar=bar, predicted=predicted,
                  spread=ratio_spread(numerator, denominator, *predicted_from), above=above, margin=margin)

"""Timing that can be trusted: warm-up, repeats, median and spread, noise flagged.

Protocol (the design's measurement protocol):

- run the function a few times untimed first (warm-up: caches, lazy init, allocator);
- time each repeat separately and report the **median** (robust to one slow run)
  and the **spread** (interquartile range);
- on CUDA, kernels run asynchronously: ``torch.cuda.synchronize()`` before each
  timer read, or the timer measures only the launch;
- a measurement whose spread is large against its median (``IQR / median >``
  :data:`NOISE_THRESHOLD`) is **noisy**: :func:`measure` re-measures it once, and
  a result that is still noisy says so when printed, so it is not published as is;
- to compare variants on a shared machine, time them **interleaved**
  (A, B, A, B, ...: :func:`interleaved`), so a slow spell weighs on all alike.

:func:`op_kind` and :func:`profile_self_time` group a ``torch.profiler`` trace into
matmul / attention / everything else: where the time of a step goes.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

NOISE_THRESHOLD = 0.25
"""IQR / median above which a measurement is called noisy (re-measured, then flagged)."""


def quick() -> bool:
    """True when ``WORKBOOK_QUICK=1``: CI's short settings instead of the learner's full ones."""
    return os.environ.get("WORKBOOK_QUICK", "") not in ("", "0")


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (CUDA or MPS); a no-op on CPU."""
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(dev if dev is not None and dev.index is not None else None)
    elif dev is not None and dev.type == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class Timing:
    """Seconds of each timed repeat, with the summary statistics."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """Interquartile range in seconds (0 with fewer than 2 samples)."""
        if len(self.samples) < 2:
            return 0.0
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[2] - q[0]

    @property
    def relative_spread(self) -> float:
        """``spread / median``: 0.05 is a steady measurement, 0.5 a noisy one."""
        return self.spread / self.median if self.median > 0 else 0.0

    @property
    def noisy(self) -> bool:
        """True when ``relative_spread > NOISE_THRESHOLD``: do not draw conclusions from it."""
        return self.relative_spread > NOISE_THRESHOLD

    @property
    def min(self) -> float:
        return min(self.samples)

    def __str__(self) -> str:
        flag = f"  NOISY: spread {self.relative_spread:.0%} of the median" if self.noisy else ""
        return f"{self.median * 1e3:.2f} ms (IQR {self.spread * 1e3:.2f} ms, n={len(self.samples)}){flag}"


@contextmanager
def timer(device: torch.device | str | None = None) -> Iterator[dict[str, float]]:
    """``with timer(dev) as t: ...`` then ``t["seconds"]``; synchronizes on both edges."""
    result: dict[str, float] = {}
    synchronize(device)
    start = time.perf_counter()
    try:
        yield result
    finally:
        synchronize(device)
        result["seconds"] = time.perf_counter() - start


def _progress(runs: range, show: bool, desc: str) -> Any:
    if not show:
        return runs
    from tqdm.auto import tqdm  # imported here: only a long measurement needs it

    return tqdm(runs, desc=desc, leave=False)


def measure(fn: Callable[..., Any], *, setup: Callable[[], Any] | None = None,
            warmup: int = 1, repeats: int = 5, device: torch.device | str | None = None,
            progress: bool | None = None, desc: str = "measuring",
            remeasure_noisy: bool = True) -> Timing:
    """Time ``fn`` ``repeats`` times after ``warmup`` untimed calls.

    ``setup``, if given, runs untimed before each call and its result is passed to ``fn``
    (e.g. a fresh prefill before timing decode steps). ``progress=None`` shows a progress
    bar only when the run looks longer than a few seconds. A noisy result (see
    :data:`NOISE_THRESHOLD`) is measured once more and the steadier of the two kept.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")

    def once() -> float:
        arg = setup() if setup is not None else None
        with timer(device) as t:
            fn(arg) if setup is not None else fn()
        return t["seconds"]

    first = [once() for _ in range(warmup)]
    show = progress if progress is not None else bool(first) and first[-1] * repeats > 3.0
    result = Timing(tuple(once() for _ in _progress(range(repeats), show, desc)))
    if remeasure_noisy and result.noisy and repeats >= 3:
        again = Timing(tuple(once() for _ in _progress(range(repeats), show, desc + " (again)")))
        result = min(result, again, key=lambda t: t.relative_spread)
    return result


def interleaved(fns: Mapping[str, Callable[..., Any]], *, repeats: int = 5, warmup: int = 1,
                device: torch.device | str | None = None, progress: bool | None = None,
                desc: str = "interleaved", setup: Mapping[str, Callable[[], Any]] | None = None,
                remeasure_noisy: bool = False) -> dict[str, Timing]:
    """Time several functions round-robin (A, B, C, A, B, C, ...): ``{name: Timing}``.

    On a shared or throttling machine a slow spell then hits every variant alike, so
    their *ratio* stays meaningful even when each absolute time wobbles. ``setup[name]``,
    if given, runs untimed before each call of ``fns[name]`` and its result is passed to it
    (as in :func:`measure`). With ``remeasure_noisy``, a round in which any timing is noisy is
    run once more (warm-up included) and the steadier round kept: the one whose timings' relative
    spreads, added in quadrature (the spread of their ratio), are smaller.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    setup = setup or {}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    show = progress if progress is not None else repeats * len(fns) > 20
    for i in _progress(range(warmup + repeats), show, desc):
        for name, fn in fns.items():
            args = (setup[name](),) if name in setup else ()
            with timer(device) as t:
                fn(*args)
            if i >= warmup:
                samples[name].append(t["seconds"])
    result = {name: Timing(tuple(s)) for name, s in samples.items()}
    if remeasure_noisy and any(t.noisy for t in result.values()):
        again = interleaved(fns, repeats=repeats, warmup=warmup, device=device, progress=progress, desc=desc + " (again)",
                            setup=setup)
        result = min(result, again, key=lambda ts: sum(t.relative_spread ** 2 for t in ts.values()))
    return result


# ----------------------------------------------------------------------------- profiles


def op_kind(name: str) -> str:
    """Sort an operator (CPU) or kernel (CUDA) name into ``matmul``, ``attention`` or ``everything else``."""
    n = name.lower()
    if "attention" in n or "flash" in n or "fmha" in n or "softmax" in n:
        return "attention"
    if (n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")
            or "gemm" in n or "gemv" in n or "pack_mm" in n or "_linear_pointwise" in n
            or n in ("workbook::int8_linear", "workbook::int4_linear", "workbook::float_linear",
                      "workbook::bf16_tiles_linear")):
        return "matmul"
    return "everything else"


def profile_self_time(prof: Any, device: torch.device) -> dict[str, float]:
    """Self time (µs) of a finished ``torch.profiler.profile`` grouped by :func:`op_kind`, largest first."""
    cuda = device.type == "cuda"
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        t = e.self_device_time_total if cuda else e.self_cpu_time_total
        totals[op_kind(e.key)] = totals.get(op_kind(e.key), 0.0) + t
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main_ops(fn: Callable[..., Any], *args: Any, share: float = 0.05) -> list[str]:
    """The aten operators that take more than ``share`` of one call's CPU self time.

    Answers "which kernel did this really run?" (e.g. an int8 matmul or a float fallback).
    """
    fn(*args)  # warm-up: lazy initialisation is not the kernel
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return [e.key for e in events if e.key.startswith("aten::") and e.self_cpu_time_total > share * total]

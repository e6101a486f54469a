"""Timing that can be trusted: warm-up, repeats, median and spread.

Protocol (the design's measurement protocol):

- run the function a few times untimed first (warm-up: caches, lazy init, allocator);
- time each repeat separately and report the **median** (robust to one slow run)
  and the **spread** (interquartile range);
- on CUDA, kernels run asynchronously: ``torch.cuda.synchronize()`` before each
  timer read, or the timer measures only the launch.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch


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
    def min(self) -> float:
        return min(self.samples)

    def __str__(self) -> str:
        return f"{self.median * 1e3:.2f} ms (IQR {self.spread * 1e3:.2f} ms, n={len(self.samples)})"


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


def measure(fn: Callable[..., Any], *, setup: Callable[[], Any] | None = None,
            warmup: int = 1, repeats: int = 5, device: torch.device | str | None = None,
            progress: bool | None = None, desc: str = "measuring") -> Timing:
    """Time ``fn`` ``repeats`` times after ``warmup`` untimed calls.

    ``setup``, if given, runs untimed before each call and its result is passed to ``fn``
    (e.g. a fresh prefill before timing decode steps). ``progress=None`` shows a progress
    bar only when the run looks longer than a few seconds.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")

    def once() -> float:
        arg = setup() if setup is not None else None
        with timer(device) as t:
            fn(arg) if setup is not None else fn()
        return t["seconds"]

    first = [once() for _ in range(warmup)]
    if progress is None:
        progress = bool(first) and first[-1] * repeats > 3.0
    runs: Any = range(repeats)
    if progress:
        from tqdm.auto import tqdm
        runs = tqdm(runs, desc=desc, leave=False)
    return Timing(tuple(once() for _ in runs))

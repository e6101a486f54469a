"""The first cell of every chapter and lab: load the model, print the machine.

    from utils.chapter import setup_chapter
    lm, machine = setup_chapter()

prints the device, dtype, threads, versions and model (and says when the model's
weights are random, so its text means nothing), and returns the loaded model and
the machine description every result should be recorded with. The machine, model and
settings are also published through :func:`utils.results.record_setup` (kept only when the
report runner asks for them).
"""

from __future__ import annotations

import os
from typing import Any

from .device import dtype_name
from .hardware import describe_machine
from .models import LoadedModel, load_model
from .results import record_setup
from .timing import quick


def openmp_wait() -> str:
    """How torch's idle OpenMP threads wait between parallel regions (GNU OpenMP reads it once,
    when torch is imported, so it is set before Python starts).

    Spinning (libgomp's default, 300,000 spins) is fastest on an idle machine, but when another
    program keeps one core busy a spinning team waits for its preempted thread and a chapter runs
    many times slower. ``make lab`` and ``make test`` set ``GOMP_SPINCOUNT=10000``: spin briefly,
    then sleep (measured in the README).
    """
    policy, spins = os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")
    if policy:
        return f"OpenMP wait {policy.lower()}"
    if spins:
        return f"OpenMP spin {spins}"
    return "OpenMP spin default (slow when another program is busy: make lab sets GOMP_SPINCOUNT)"


def describe_setup(lm: LoadedModel, machine: dict[str, Any]) -> list[str]:
    """The lines :func:`setup_chapter` prints."""
    s = lm.spec
    lines = [
        f"device   {lm.device} ({machine['device_name']}), {dtype_name(lm.dtype)}, "
        f"{machine['torch_threads']} torch threads, {openmp_wait()}",
        f"versions torch {machine['torch_version']}, transformers {machine['transformers_version']}, "
        f"python {machine['python_version']}",
        f"model    {lm.name} ({s.architecture}): {s.n_params / 1e6:,.1f} M parameters, {s.n_layers} layers, "
        f"context {s.max_context:,} tokens",
        f"settings {'quick (CI)' if quick() else 'full'}",
    ]
    if lm.random_weights:
        lines.append("NOTE     this model has random weights: its speeds are real, its text is meaningless.")
    return lines


def setup_chapter(name: str | None = None, device: str | None = None,
                  dtype: str | None = None) -> tuple[LoadedModel, dict[str, Any]]:
    """Load the configured model (``WORKBOOK_MODEL`` / ``_DEVICE`` / ``_DTYPE``) and print the setup."""
    lm = load_model(name, device, dtype)
    machine = describe_machine(lm.device)
    print("\n".join(describe_setup(lm, machine)))
    record_setup(machine, lm.spec.as_dict(), {"model": lm.name, "device": str(lm.device), "dtype": dtype_name(lm.dtype),
                                              "quick": quick(), "random_weights": lm.random_weights})
    return lm, machine


def fit_to_context(points: list[int], max_context: int, new_tokens: int = 0, what: str = "points",
                   add_longest: bool = False) -> list[int]:
    """The grid ``points`` (prompt or context lengths) that fit the model's context, with
    ``new_tokens`` decoded after each; the dropped ones are printed with the reason.

    ``add_longest`` appends the longest length that still fits when something was dropped,
    so that a small model's grid still reaches its own limit.
    """
    room = max_context - new_tokens
    kept = [p for p in points if p <= room]
    dropped = [p for p in points if p > room]
    if dropped:
        after = f" with {new_tokens} new tokens after them" if new_tokens else ""
        print(f"dropped {what} {dropped}:{after} longer than the model's {max_context:,}-token context")
        if add_longest and room > 0 and (not kept or kept[-1] < room):
            kept.append(room)
            print(f"added {room:,}: the longest that fits")
    return kept

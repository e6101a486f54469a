"""The figures a run measured, as data: what the chapters publish and a report collects.

    from utils.results import record
    record("decode_tok_s", decode.tok_s, unit="tok/s", predicted=ceiling, context_tokens=48)

:func:`record` returns the value and keeps the figure in memory (:data:`RECORDED`), so it
costs nothing in a learner's session or under nbval. When the report runner
(:mod:`utils.report`) executes a notebook it sets ``WORKBOOK_RESULTS`` to a file, and each
figure is appended to it as one JSON line, with ``WORKBOOK_NOTEBOOK`` naming the notebook.
:func:`record_setup` does the same for the machine and model a notebook ran on
(:func:`utils.chapter.setup_chapter` calls it).

The report's ``results.json`` is one document (:data:`SCHEMA`, :data:`SCHEMA_VERSION`):
the machine, the settings, each notebook's status, and every figure, each with its unit,
its prediction where the chapter makes one, and ``ratio = value / predicted``.
:func:`load` reads one, upgrading older versions (version 0 is the JSON line that
``make bench`` printed) and naming the file in every error. Plain ``json`` only: the
chapters import this module cheaply.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any

from .errors import WorkbookError

SCHEMA = "prefill-decode-workbook/results"
SCHEMA_VERSION = 2
ENV_FILE = "WORKBOOK_RESULTS"
ENV_NOTEBOOK = "WORKBOOK_NOTEBOOK"
NAME = re.compile(r"^[a-z][a-z0-9_]*$")

RECORDED: list[dict[str, Any]] = []
"""The figures recorded in this process, in order (a notebook's kernel keeps its own)."""

CHECKS: list[dict[str, Any]] = []
"""The timing checks decided in this process (:func:`record_check`), in order."""

OUTCOMES = ("passed", "failed", "undecided")
"""What a timing check can come to (:mod:`utils.decide`)."""


class ResultsError(WorkbookError):
    """A results file that cannot be read: not JSON, not a workbook report, or an unknown version."""


def _number(value: Any, what: str) -> float | int:
    """A finite int or float from a Python, numpy or torch scalar."""
    if hasattr(value, "item") and not isinstance(value, numbers.Number):
        value = value.item()  # numpy / torch scalars
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise WorkbookError(f"{what} must be a finite number, got {value!r}.")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _plain(value: Any, key: str) -> str | int | float | bool:
    """A context value as JSON can hold it: str, bool, or a finite number."""
    if isinstance(value, (str, bool)):
        return value
    return _number(value, f"context {key!r}")


def figure(name: str, value: Any, unit: str = "", predicted: Any = None, notebook: str = "",
           **context: Any) -> dict[str, Any]:
    """One figure as the schema stores it (checked: a snake_case name, finite numbers)."""
    if not isinstance(name, str) or not NAME.match(name):
        raise WorkbookError(f"A figure's name must be snake_case (like 'decode_tok_s'), got {name!r}.")
    value = _number(value, f"figure {name!r}")
    predicted = None if predicted is None else _number(predicted, f"prediction of {name!r}")
    ratio = value / predicted if predicted else None
    return {"notebook": notebook, "name": name, "value": value, "unit": str(unit), "predicted": predicted,
            "ratio": ratio, "context": {k: _plain(v, k) for k, v in context.items()}}


def _append(line: dict[str, Any]) -> None:
    """Append one JSON line to ``$WORKBOOK_RESULTS`` when the report runner set it."""
    path = os.environ.get(ENV_FILE)
    if path:
        with open(path, "a", encoding="utf8") as f:
            f.write(json.dumps(line) + "\n")


def record(name: str, value: Any, unit: str = "", predicted: Any = None, **context: Any) -> Any:
    """Publish one measured figure (and the chapter's prediction of it); returns ``value``.

    ``context`` says where it was measured (``prompt_tokens=256``, ``variant="int8"``...).
    """
    fig = figure(name, value, unit, predicted, os.environ.get(ENV_NOTEBOOK, ""), **context)
    RECORDED.append(fig)
    _append({"kind": "figure", **fig})
    return value


def record_bandwidth(probe: Any) -> float:
    """Publish the bandwidth reading a notebook's ceilings use (a :class:`~utils.hardware.BandwidthProbe`);
    returns it (B/s).

    Every notebook that probes publishes its best reading under one name, ``bandwidth_gb_s``, so a
    report lists the best and the lowest over a whole run: how far the machine's bandwidth moved
    between notebooks, and so how far shares of a ceiling from different notebooks compare.
    """
    record("bandwidth_gb_s", probe.best / 1e9, unit="GB/s", probe=f"best of {len(probe.readings)}")
    return float(probe.best)


def record_check(name: str, outcome: str, measured: float, bar: float, predicted: float,
                 spread: float) -> None:
    """Publish one timing check's verdict (:mod:`utils.decide` calls it): passed, failed or undecided."""
    line = check_entry(name, outcome, measured, bar, predicted, spread, os.environ.get(ENV_NOTEBOOK, ""))
    CHECKS.append(line)
    _append({"kind": "check", **line})


def check_entry(name: str, outcome: str, measured: float, bar: float, predicted: float, spread: float,
                notebook: str = "") -> dict[str, Any]:
    """One timing check's verdict as the schema stores it."""
    if outcome not in OUTCOMES:
        raise WorkbookError(f"a check's outcome must be one of {OUTCOMES}, got {outcome!r}.")
    return {"notebook": notebook, "name": str(name), "outcome": outcome,
            **{k: _number(v, f"check {name!r} {k}") for k, v in
               (("measured", measured), ("bar", bar), ("predicted", predicted), ("spread", spread))}}


def record_setup(machine: dict[str, Any], model: dict[str, Any], settings: dict[str, Any]) -> None:
    """Publish what a notebook ran on: the machine, the model's spec and the settings."""
    _append({"kind": "setup", "notebook": os.environ.get(ENV_NOTEBOOK, ""), "machine": machine,
             "model": model, "settings": settings})


def read_lines(path: str | Path) -> list[dict[str, Any]]:
    """The JSON lines :func:`record` and :func:`record_setup` appended (none if no file)."""
    path = Path(path)
    if not path.exists():
        return []
    lines = []
    for i, text in enumerate(path.read_text(encoding="utf8").splitlines(), 1):
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError as e:
            raise ResultsError(f"{path}:{i}: not a JSON line ({e.msg}).") from None
    return lines


# --------------------------------------------------------------------------------- the document

REQUIRED = {"schema": str, "schema_version": int, "machine_id": str, "machine": dict, "model": dict,
            "settings": dict, "notebooks": list, "figures": list, "checks": list}
CHECK_KEYS = {"notebook", "name", "outcome", "measured", "bar", "predicted", "spread"}
FIGURE_KEYS = {"notebook", "name", "value", "unit", "predicted", "ratio", "context"}


def validate(doc: Any, source: str = "results") -> dict[str, Any]:
    """``doc`` if it is a valid current-version document; else :class:`ResultsError` naming ``source``."""
    if not isinstance(doc, dict):
        raise ResultsError(f"{source}: expected a JSON object, got {type(doc).__name__}.")
    for key, kind in REQUIRED.items():
        if not isinstance(doc.get(key), kind):
            raise ResultsError(f"{source}: '{key}' is missing or not a {kind.__name__}.")
    if doc["schema"] != SCHEMA or doc["schema_version"] != SCHEMA_VERSION:
        raise ResultsError(f"{source}: schema {doc['schema']!r} v{doc['schema_version']}, "
                           f"expected {SCHEMA!r} v{SCHEMA_VERSION}.")
    for i, fig in enumerate(doc["figures"]):
        if not isinstance(fig, dict) or set(fig) != FIGURE_KEYS:
            raise ResultsError(f"{source}: figure {i} must have exactly the keys {sorted(FIGURE_KEYS)}.")
        try:
            again = figure(fig["name"], fig["value"], fig["unit"], fig["predicted"], fig["notebook"],
                           **fig["context"])
        except (WorkbookError, TypeError) as e:
            raise ResultsError(f"{source}: figure {i} ({fig.get('name')!r}): {e}") from None
        if (fig["ratio"] is None) != (again["ratio"] is None) or (
                fig["ratio"] is not None and not math.isclose(fig["ratio"], again["ratio"], rel_tol=1e-9)):
            raise ResultsError(f"{source}: figure {i} ({fig['name']!r}): ratio is not value / predicted.")
    for i, chk in enumerate(doc["checks"]):
        if not isinstance(chk, dict) or set(chk) != CHECK_KEYS:
            raise ResultsError(f"{source}: check {i} must have exactly the keys {sorted(CHECK_KEYS)}.")
        try:
            check_entry(chk["name"], chk["outcome"], chk["measured"], chk["bar"], chk["predicted"], chk["spread"])
        except WorkbookError as e:
            raise ResultsError(f"{source}: check {i} ({chk.get('name')!r}): {e}") from None
    for i, nb in enumerate(doc["notebooks"]):
        if not isinstance(nb, dict) or not isinstance(nb.get("name"), str) or nb.get("status") not in ("ok", "failed"):
            raise ResultsError(f"{source}: notebook entry {i} needs a 'name' and a 'status' of 'ok' or 'failed'.")
    return doc


def _from_bench(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 0: the JSON line ``make bench`` printed, as a version-1 document."""
    machine, model = dict(doc["machine"]), dict(doc["model"])
    machine["dtype"] = model.get("dtype", "")
    figs = [figure("bandwidth_gb_s", doc["bandwidth_GBps"], "GB/s", notebook="bench"),
            figure("matmul_gflop_s", doc["matmul_GFLOPs"], "GFLOP/s", notebook="bench", dtype=machine["dtype"])]
    figs += [figure("prefill_tok_s", v, "tok/s", notebook="bench", prompt_tokens=int(n))
             for n, v in doc["prefill_tok_s"].items()]
    ceiling = doc["decode_tok_s_transformers"] / doc["decode_share_of_ceiling"]
    figs.append(figure("decode_tok_s", doc["decode_tok_s_transformers"], "tok/s", ceiling, notebook="bench",
                       context_tokens=doc["decode_context_tokens"]))
    host = re.sub(r"[^a-z0-9]+", "-", f"bench-{machine.get('device_name', '')}-{machine['dtype']}".lower())
    return {"schema": SCHEMA, "schema_version": 1, "machine_id": host.strip("-"), "machine": machine,
            "model": model, "settings": {"from": "make bench (schema version 0)"},
            "notebooks": [{"name": "bench", "status": "ok"}], "figures": figs}


def _add_checks(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 1 had no timing-check verdicts: the same document with an empty list of them."""
    return {**doc, "schema_version": 2, "checks": []}


UPGRADES = {0: lambda doc: _add_checks(_from_bench(doc)), 1: _add_checks}
"""Older schema versions this module reads, each turned into the current version."""


def upgrade(doc: Any, source: str = "results") -> dict[str, Any]:
    """A current-version document from any version this module reads; a clear error otherwise."""
    if isinstance(doc, dict) and "schema" not in doc and {"machine", "bandwidth_GBps", "prefill_tok_s"} <= set(doc):
        doc = {**doc, "schema": SCHEMA, "schema_version": 0}
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ResultsError(f"{source}: not a workbook results file (no \"schema\": {SCHEMA!r}); "
                           "expected the results.json that `make report` writes.")
    version = doc.get("schema_version")
    if version == SCHEMA_VERSION:
        return validate(doc, source)
    if version in UPGRADES:
        try:
            return validate(UPGRADES[version](doc), source)
        except (KeyError, TypeError, ZeroDivisionError) as e:
            raise ResultsError(f"{source}: a schema version {version} file, but incomplete ({e!r}).") from None
    readable = ", ".join(str(v) for v in sorted([*UPGRADES, SCHEMA_VERSION]))
    raise ResultsError(f"{source}: schema version {version!r} cannot be read by this workbook (it reads "
                       f"versions {readable}); {'update the workbook' if isinstance(version, int) and version > SCHEMA_VERSION else 'rewrite it with make report'}.")


def load(path: str | Path) -> dict[str, Any]:
    """Read a ``results.json`` (or a ``make bench`` JSON line) as a current-version document."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf8")
    except OSError as e:
        raise ResultsError(f"{path}: cannot be read ({e.strerror}).") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}).") from None
    return upgrade(doc, str(path))


def save(doc: dict[str, Any], path: str | Path) -> Path:
    """Validate ``doc`` and write it as indented JSON."""
    path = Path(path)
    validate(doc, str(path))
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf8")
    return path

"""The reference report: every chapter and solved lab run on this machine, as HTML and as data.

    python -m utils.report run [--quick]            # make report [QUICK=1]
    python -m utils.report compare reports/*/results.json   # make compare
    python -m utils.report validate reports/*/results.json
    python -m utils.report index reports/<machine-id>/results.json   # rewrite its index.html

``run`` executes every ``notebooks/*.ipynb`` and ``solutions/*.ipynb`` (found, not listed) in a
fresh kernel of this interpreter, one progress line each, and writes to ``reports/<machine-id>/``:
each executed notebook as HTML, ``results.json`` (:mod:`utils.results`: the machine, the
settings, each notebook's status and every figure the notebooks published with
:func:`utils.results.record` in this run, nothing else) and ``index.html``, a one-page summary
with the key plots. A failing notebook is named, the rest still run and are written, and the
exit status is 1. ``compare`` lines many reports up: a table of the headline figures, plots,
and the machines whose ratios fall outside the others' spread.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import os
import re
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import ipykernel.kernelspec
import nbformat
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from matplotlib.figure import Figure
from nbclient import NotebookClient
from nbconvert import HTMLExporter

from .device import dtype_name, pick_device, resolve_dtype
from .hardware import describe_machine
from .models import EMBEDDED, REPO_ROOT, resolve_name
from .plotting import COLORS
from .results import (ENV_FILE, ENV_NOTEBOOK, SCHEMA, SCHEMA_VERSION, ResultsError, load, read_lines, save,
                      validate)

REPORTS = REPO_ROOT / "reports"
NOTEBOOK_DIRS = ("notebooks", "solutions")
FLAG_MARGIN = 0.10
"""A ratio is flagged when it lies more than this fraction outside the other machines' range."""

# ------------------------------------------------------------------------------ running notebooks


def discover(root: Path = REPO_ROOT) -> list[Path]:
    """Every chapter and solved lab, in order: ``notebooks/*.ipynb`` then ``solutions/*.ipynb``."""
    return [p for d in NOTEBOOK_DIRS for p in sorted((root / d).glob("*.ipynb"))]


def slug(text: str) -> str:
    """``"My Host.local"`` -> ``"my-host-local"``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def machine_id(quick: bool, host: str | None = None) -> str:
    """``<host>-<device>-<dtype>[-<model>][-quick]``: readable, stable, one folder per setting."""
    dev = pick_device(None)
    parts = [host or socket.gethostname(), dev.type, dtype_name(resolve_dtype(None, dev))]
    model = resolve_name()
    if model != EMBEDDED:
        parts.append(Path(model).name)
    return "-".join(slug(p) for p in parts + (["quick"] if quick else []))


def _kernel_manager() -> Any:
    """A kernel manager for this interpreter's ipykernel (what nbval's --nbval-current-env does)."""
    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> Any:
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    return KernelManager(kernel_name="workbook-current-env", kernel_spec_manager=CurrentEnv())


def _error_summary(err: BaseException) -> str:
    """The one line that says why a notebook failed (the exception, not the whole traceback)."""
    ename, evalue = getattr(err, "ename", type(err).__name__), getattr(err, "evalue", str(err))
    return f"{ename}: {evalue}".strip()[:500]


SLOW_CELL_S = 10.0
"""A cell that runs longer than this owes the reader a progress bar (tqdm, e.g. through utils.timing)."""


def slow_cells(nb: nbformat.NotebookNode, over_s: float = SLOW_CELL_S) -> list[dict[str, Any]]:
    """The executed code cells that took over ``over_s`` seconds (from nbclient's execution timestamps):
    index, seconds, first line, and whether the cell showed a progress bar (a tqdm widget or bar on stderr)."""
    slow = []
    for i, cell in enumerate(nb.cells):
        stamps = cell.get("metadata", {}).get("execution", {})
        began, ended = stamps.get("iopub.execute_input"), stamps.get("shell.execute_reply")
        if cell.cell_type != "code" or not began or not ended:
            continue
        seconds = (_stamp(ended) - _stamp(began))
        if seconds > over_s:
            slow.append({"cell": i, "seconds": round(seconds, 1), "first_line": cell.source.split("\n")[0][:80],
                         "progress_bar": any(_is_progress(o) for o in cell.get("outputs", []))})
    return slow


def _stamp(iso: str) -> float:
    """Seconds since the epoch of a Jupyter timestamp (``2026-12-01T16:22:21.123456Z``)."""
    from datetime import datetime
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _is_progress(output: dict[str, Any]) -> bool:
    """A tqdm bar: an ipywidget in a notebook, or ``|####| 3/5 [...]`` written to stderr elsewhere."""
    if "application/vnd.jupyter.widget-view+json" in output.get("data", {}):
        return True
    return output.get("name") == "stderr" and bool(re.search(r"\|\s*\d+/\d+ \[", output.get("text", "")))


def execute(path: Path, html_path: Path, env: dict[str, str], cell_timeout: int, log: Path,
            slow: list[dict[str, Any]] | None = None) -> str | None:
    """Run ``path`` in a fresh kernel, write its HTML (also when it fails); the error or None.

    The kernel's own stderr (profiler chatter, a crash's last words) goes to ``log``; the cells over
    :data:`SLOW_CELL_S` are appended to ``slow`` when it is given.
    """
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, km=_kernel_manager(), timeout=cell_timeout, allow_errors=False,
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],  # not its TCP warning
                            resources={"metadata": {"path": str(path.parent)}})
    error = None
    with open(log, "w", encoding="utf8") as stderr:
        try:
            client.execute(env=env, stderr=stderr)
        except Exception as err:  # a failing cell, a timeout, a dead kernel: the report says which
            error = _error_summary(err)
    if slow is not None:
        slow.extend(slow_cells(nb))
    body, _ = HTMLExporter().from_notebook_node(nb, resources={"metadata": {"name": path.stem}})
    html_path.write_text(body, encoding="utf8")
    return error


def prepare_out(out: Path) -> Path:
    """``out`` emptied of an earlier report's files (only those), with a fresh ``figures/``."""
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.html"), *out.glob("*.png"), *out.glob("shard-*.json"), out / "results.json"]:
        old.unlink(missing_ok=True)
    shutil.rmtree(out / "figures", ignore_errors=True)
    (out / "figures").mkdir()
    return out


def run_all(paths: Sequence[Path], out: Path, quick: bool, cell_timeout: int = 1800) -> list[dict[str, Any]]:
    """Execute each notebook with its own figures file; one progress line each; their entries."""
    names = [p.stem for p in paths]
    if len(set(names)) != len(names):
        raise ResultsError(f"two notebooks share a name: {names}")
    entries = []
    for i, path in enumerate(paths, 1):
        figures = out / "figures" / f"{path.stem}.jsonl"
        env = {**os.environ, ENV_FILE: str(figures), ENV_NOTEBOOK: path.stem, "WORKBOOK_QUICK": "1" if quick else "0"}
        print(f"[{i}/{len(paths)}] {path.parent.name}/{path.name} ...", end=" ", flush=True)
        start = time.perf_counter()
        slow: list[dict[str, Any]] = []
        error = execute(path, out / f"{path.stem}.html", env, cell_timeout, figures.with_suffix(".log"), slow)
        seconds = round(time.perf_counter() - start, 1)
        n = sum(1 for line in read_lines(figures) if line.get("kind") == "figure")
        print(f"ok, {seconds} s, {n} figures" if error is None else f"FAILED after {seconds} s: {error}", flush=True)
        for cell in slow:
            if not cell["progress_bar"]:
                print(f"    cell {cell['cell']} ran {cell['seconds']} s with no progress bar: {cell['first_line']}")
        entries.append({"name": path.stem, "path": f"{path.parent.name}/{path.name}", "status": "failed" if error else "ok",
                        "seconds": seconds, "figures": n, "html": f"{path.stem}.html", "error": error,
                        "slow_cells": slow})
    return entries


def collect(out: Path, entries: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """The results document of one run: only what its notebooks published in ``out/figures``."""
    lines = [line for e in entries for line in read_lines(out / "figures" / f"{e['name']}.jsonl")]
    setups = [line for line in lines if line.get("kind") == "setup"]
    for e in entries:  # the setting each notebook ran in (the quantization lab always loads float32)
        own = [s for s in setups if s["notebook"] == e["name"]]
        e["dtype"] = own[0]["settings"]["dtype"] if own else None
    main = next((s for s in setups if s["settings"]["dtype"] == settings["dtype"]), setups[0] if setups else None)
    machine = dict(main["machine"]) if main else describe_machine(settings["device"])
    machine["dtype"] = settings["dtype"]
    of_kind = lambda kind: [{k: v for k, v in line.items() if k != "kind"}  # noqa: E731
                            for line in lines if line.get("kind") == kind]
    return validate({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "machine_id": out.name, "machine": machine,
                     "model": main["model"] if main else {}, "settings": settings, "notebooks": entries,
                     "figures": of_kind("figure"), "checks": of_kind("check")}, str(out / "results.json"))


def run_report(paths: Sequence[Path], out: Path, quick: bool, cell_timeout: int = 1800) -> dict[str, Any]:
    """Execute ``paths`` and write the HTML, ``results.json`` and ``index.html`` into ``out``."""
    settings = run_settings(quick)
    start = time.perf_counter()
    entries = run_all(paths, prepare_out(out), quick, cell_timeout)
    return write_report(out, entries, settings, time.perf_counter() - start)


def run_settings(quick: bool) -> dict[str, Any]:
    """What a run of the notebooks ran with: model, device, dtype, quick or full, when."""
    dev = pick_device(None)
    return {"model": resolve_name(), "device": str(dev), "dtype": dtype_name(resolve_dtype(None, dev)),
            "quick": quick, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_report(out: Path, entries: list[dict[str, Any]], settings: dict[str, Any], seconds: float) -> dict[str, Any]:
    """``results.json`` and ``index.html`` in ``out`` from the notebooks' entries and figure files."""
    doc = collect(out, entries, {**settings, "seconds": round(seconds, 1)})
    save(doc, out / "results.json")
    (out / "index.html").write_text(index_html(doc), encoding="utf8")
    return doc


def write_shard(out: Path, name: str, entries: list[dict[str, Any]], settings: dict[str, Any], seconds: float) -> Path:
    """One share of a report run in parallel (``make test`` runs the default model's notebooks in two lanes):
    its notebooks' entries in ``out/shard-<name>.json``; :func:`join_shards` writes the report from all of them."""
    path = out / f"shard-{name}.json"
    path.write_text(json.dumps({"entries": entries, "settings": settings, "seconds": round(seconds, 1)}), encoding="utf8")
    return path


def join_shards(out: Path) -> dict[str, Any]:
    """``results.json`` and ``index.html`` in ``out`` from every ``shard-*.json`` there (their figure files
    are already in ``out/figures``): the notebooks in path order, the earliest start, the longest shard's time."""
    shards = [json.loads(p.read_text(encoding="utf8")) for p in sorted(out.glob("shard-*.json"))]
    if not shards:
        raise ResultsError(f"no shard-*.json in {out}: nothing to join")
    entries = sorted((e for s in shards for e in s["entries"]), key=lambda e: e["path"])
    settings = min((s["settings"] for s in shards), key=lambda st: st["started"])
    return write_report(out, entries, settings, max(s["seconds"] for s in shards))


def check_counts(doc: dict[str, Any], notebook: str | None = None) -> dict[str, int]:
    """How many timing checks passed, failed and were not decided (in one notebook, or in all)."""
    counts = dict.fromkeys(("passed", "failed", "undecided"), 0)
    for c in doc["checks"]:
        if notebook is None or c["notebook"] == notebook:
            counts[c["outcome"]] += 1
    return counts


def checks_summary(doc: dict[str, Any], notebook: str | None = None) -> str:
    """``"5 passed, 1 undecided"``: the timing checks' verdicts in a few words."""
    counts = check_counts(doc, notebook)
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none"


# ------------------------------------------------------------------------------ reading figures


def figures_of(doc: dict[str, Any], name: str, notebooks: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Figures called ``name``, from the first of ``notebooks`` that has any (or from all)."""
    found = [f for f in doc["figures"] if f["name"] == name]
    for nb in notebooks:
        mine = [f for f in found if f["notebook"] == nb]
        if mine:
            return mine
    return found


def _by(key: str, largest: bool) -> Callable[[list[dict[str, Any]]], dict[str, Any] | None]:
    """Chooses the figure with the largest (smallest) ``context[key]``."""
    def choose(figs: list[dict[str, Any]]) -> dict[str, Any] | None:
        figs = [f for f in figs if key in f["context"]]
        return (max if largest else min)(figs, key=lambda f: f["context"][key]) if figs else None
    return choose


def _first(figs: list[dict[str, Any]]) -> dict[str, Any] | None:
    return figs[0] if figs else None


def _best(figs: list[dict[str, Any]]) -> dict[str, Any] | None:
    return max(figs, key=lambda f: f["value"]) if figs else None


def _lowest(figs: list[dict[str, Any]]) -> dict[str, Any] | None:
    return min(figs, key=lambda f: f["value"]) if figs else None


HEADLINES: list[tuple[str, str, tuple[str, ...], Callable[[list[dict[str, Any]]], dict[str, Any] | None]]] = [
    ("bandwidth GB/s", "bandwidth_gb_s", (), _best),
    ("bandwidth GB/s, lowest notebook", "bandwidth_gb_s", (), _lowest),  # each notebook publishes its best: the range over a run
    ("matmul GFLOP/s", "matmul_gflop_s", ("03_prefill",), _first),
    ("prefill tok/s", "prefill_tok_s", ("03_prefill",), _by("prompt_tokens", True)),
    ("decode tok/s", "decode_tok_s", ("04_decode", "00_setup"), _first),
    ("KV bytes", "kv_cache_bytes", ("03_prefill", "05_kv_cache"), _first),
    ("no-cache/cached", "no_cache_over_cached", ("05_kv_cache",), _first),
    ("quantized speed-up", "quant_speedup", ("quantization",), _first),
]
"""(label, figure name, notebooks to take it from, which one): the figures every summary shows."""


def headline(doc: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
    """label -> the chosen figure (None when the run did not publish it)."""
    return {label: choose(figures_of(doc, name, nbs)) for label, name, nbs, choose in HEADLINES}


def request_model_ratio(doc: dict[str, Any]) -> float | None:
    """Median measured / predicted total time of chapter 06's requests (the time model's fit)."""
    ratios = [f["ratio"] for f in figures_of(doc, "request_total_s") if f["ratio"] is not None]
    return statistics.median(ratios) if ratios else None


def fmt(x: float | None, digits: int = 3) -> str:
    """A number in a table: about ``digits`` significant figures, thousands separated."""
    if x is None:
        return "-"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _context(f: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in f["context"].items())


def headline_rows(doc: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(figure, measured, unit, predicted, measured/predicted) for this run's headline figures."""
    rows = []
    for label, f in headline(doc).items():
        if f is None:
            rows.append((label, "not measured", "", "", ""))
            continue
        where = f" ({f['notebook']}" + (f": {_context(f)})" if f["context"] else ")")
        rows.append((label + where, fmt(f["value"]), f["unit"], fmt(f["predicted"]), fmt(f["ratio"], 2)))
    rows.append(("request time, median of 06's requests", "", "", "", fmt(request_model_ratio(doc), 2)))
    return rows


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    def line(r: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


HEADLINE_HEADER = ("figure", "measured", "unit", "predicted", "measured/predicted")

# ------------------------------------------------------------------------------ index.html


def _png(fig: Figure) -> str:
    """A matplotlib figure as an inline <img>."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _series(doc: dict[str, Any], name: str, notebook: str, key: str) -> list[dict[str, Any]]:
    return sorted((f for f in doc["figures"] if f["name"] == name and f["notebook"] == notebook and key in f["context"]),
                  key=lambda f: f["context"][key])


def key_plots(doc: dict[str, Any]) -> str:
    """Prefill tok/s by prompt length and decode tok/s by context, measured against their ceilings;
    then measured / predicted for every figure that has a prediction (median per figure)."""
    fig = Figure(figsize=(14, 4))
    for ax, (name, nb, key, color, title) in zip(fig.subplots(1, 2), [
            ("prefill_tok_s", "03_prefill", "prompt_tokens", COLORS["prefill"], "prefill tok/s by prompt length (03)"),
            ("decode_tok_s_by_context", "04_decode", "context_tokens", COLORS["decode"], "decode tok/s by context (04)")]):
        series = _series(doc, name, nb, key)
        x = [f["context"][key] for f in series]
        ax.plot(x, [f["value"] for f in series], "o-", color=color, label="measured")
        if any(f["predicted"] for f in series):
            ax.plot(x, [f["predicted"] or float("nan") for f in series], "--", color=COLORS["ceiling"],
                    label="ceiling (predicted)")
        ax.set(title=title, xlabel=key.replace("_", " "), ylabel="tok/s", xscale="log")
        ax.set_xticks(x, [str(v) for v in x])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(frameon=False)
    return _png(fig) + _png(ratio_plot(doc))


def ratio_plot(doc: dict[str, Any]) -> Figure:
    """One dot per predicted figure: its measured / predicted (the median where it was measured at several points)."""
    groups: dict[str, list[float]] = {}
    for f in doc["figures"]:
        if f["ratio"]:
            groups.setdefault(f"{f['notebook']}: {f['name']}", []).append(f["ratio"])
    labels = list(groups)[::-1]
    fig = Figure(figsize=(9, 0.28 * len(labels) + 1.2))
    ax = fig.subplots()
    ax.plot([statistics.median(groups[k]) for k in labels], range(len(labels)), "o", color=COLORS["measured"])
    ax.axvline(1, ls="--", color=COLORS["predicted"])
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set(title="measured / predicted (1 = as predicted)", xscale="log", xlabel="ratio")
    ax.minorticks_off()
    lo, hi = ax.get_xlim()
    ticks = [v for v in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) if lo <= v <= hi]
    ax.set_xticks(ticks, [f"{v:g}" for v in ticks])
    ax.grid(alpha=0.3)
    return fig


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


STYLE = ("<style>body{font-family:sans-serif;max-width:80em;margin:2em auto}table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}td:first-child,th:first-child{text-align:left}"
         ".failed{color:#b00;font-weight:bold}img{max-width:100%}</style>")


def index_html(doc: dict[str, Any]) -> str:
    """One self-contained page: setup, headline table, key plots, notebooks, every figure."""
    m, s = doc["machine"], doc["settings"]
    nbs = [(f'<a href="{html.escape(e["html"])}">{html.escape(e["path"])}</a>' if e.get("html") else e["name"],
            f'<span class="{e["status"]}">{e["status"]}</span>' + (f': {html.escape(e["error"])}' if e.get("error") else ""),
            e.get("seconds", ""), e.get("figures", ""), checks_summary(doc, e["name"])) for e in doc["notebooks"]]
    nb_rows = "".join("<tr>" + "".join(f"<td>{v}</td>" for v in row) + "</tr>" for row in nbs)
    undecided = [(c["notebook"], html.escape(c["name"]), fmt(c["predicted"], 3), f"{c['spread']:.0%}", fmt(c["bar"], 3),
                  fmt(c["measured"], 3)) for c in doc["checks"] if c["outcome"] == "undecided"]
    every = [(f["notebook"], f["name"], _context(f), fmt(f["value"]), f["unit"], fmt(f["predicted"]), fmt(f["ratio"], 2))
             for f in doc["figures"]]
    return "\n".join([
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(doc['machine_id'])}</title>{STYLE}</head><body>",
        f"<h1>Prefill/decode report: {html.escape(doc['machine_id'])}</h1>",
        f"<p>{html.escape(str(m.get('device_name')))} ({html.escape(str(m.get('device')))}), {html.escape(m['dtype'])}, "
        f"{m.get('torch_threads')} threads; torch {m.get('torch_version')}, transformers {m.get('transformers_version')}; "
        f"model {html.escape(str(s.get('model')))}; {'quick (CI)' if s.get('quick') else 'full'} settings; "
        f"{s.get('started', '')}, {s.get('seconds', '?')} s.</p>",
        "<h2>Headline figures</h2>", _html_table(HEADLINE_HEADER, headline_rows(doc)),
        "<h2>Key plots</h2>", key_plots(doc),
        "<h2>Notebooks</h2><table><tr><th>notebook</th><th>status</th><th>seconds</th><th>figures</th>"
        f"<th>timing checks</th></tr>{nb_rows}</table>",
        f"<h2>Timing checks not decided here ({len(undecided)} of {len(doc['checks'])})</h2>"
        "<p>A timing check runs only where its predicted effect clears the measured noise (utils.decide); "
        "the others are neither passed nor failed on this machine.</p>",
        _html_table(("notebook", "check", "predicted", "spread", "bar", "measured"), undecided),
        f"<h2>Every figure ({len(every)})</h2>",
        _html_table(("notebook", "figure", "where", "measured", "unit", "predicted", "ratio"), every),
        "</body></html>"])


# ------------------------------------------------------------------------------ compare


COMPARE_HEADER = ("machine", "device", "dtype", "bandwidth GB/s", "matmul GFLOP/s", "prefill tok/s", "decode tok/s",
                  "share of ceiling", "request meas/pred")


def compare_row(doc: dict[str, Any]) -> list[str]:
    """One machine's line in the comparison table."""
    h = headline(doc)
    value = lambda label: h[label]["value"] if h[label] else None  # noqa: E731
    prefill = h["prefill tok/s"]
    decode = h["decode tok/s"]
    return [doc["machine_id"], str(doc["machine"].get("device_name", doc["machine"].get("device", "?"))),
            str(doc["machine"].get("dtype", "?")), fmt(value("bandwidth GB/s")), fmt(value("matmul GFLOP/s")),
            fmt(prefill["value"]) + (f" @{prefill['context']['prompt_tokens']}" if prefill and "prompt_tokens"
                                     in prefill["context"] else "") if prefill else "-",
            fmt(value("decode tok/s")), fmt(decode["ratio"], 2) if decode else "-", fmt(request_model_ratio(doc), 2)]


def ratio_keys(doc: dict[str, Any]) -> dict[str, float]:
    """The ratios compared across machines, by a readable key (figure name and context)."""
    keys = {}
    for f in doc["figures"]:
        if f["ratio"] is not None:
            keys.setdefault(f"{f['notebook']}/{f['name']}" + (f" ({_context(f)})" if f["context"] else ""), f["ratio"])
    return keys


def outliers(docs: Sequence[dict[str, Any]], margin: float = FLAG_MARGIN) -> list[str]:
    """Lines naming each machine whose ratio lies outside the others' range (needs 2 others)."""
    if len(docs) < 3:
        return [f"outliers: not judged; {len(docs)} report(s), and a spread needs at least 2 other machines"]
    ratios = [ratio_keys(d) for d in docs]
    flags = []
    for key in sorted(set.intersection(*(set(r) for r in ratios))):
        for i, doc in enumerate(docs):
            others = [r[key] for j, r in enumerate(ratios) if j != i]
            lo, hi = min(others) * (1 - margin), max(others) * (1 + margin)
            if not lo <= ratios[i][key] <= hi:
                flags.append(f"FLAG {doc['machine_id']}: {key} = {ratios[i][key]:.2f}, others {min(others):.2f}"
                             f" to {max(others):.2f}")
    return flags or ["outliers: none; every machine's ratios lie within the others' spread"]


def compare_plots(docs: Sequence[dict[str, Any]]) -> Figure:
    """Decode tok/s against bandwidth, share of the decode ceiling, prefill tok/s against FLOP/s."""
    fig = Figure(figsize=(15, 4.5))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for d in docs:
        h = headline(d)
        bw, fl, dec, pre = (h[k] for k in ("bandwidth GB/s", "matmul GFLOP/s", "decode tok/s", "prefill tok/s"))
        for ax, x, y in ((ax1, bw, dec), (ax3, fl, pre)):
            if x and y:
                ax.plot(x["value"], y["value"], "o")
                ax.annotate(d["machine_id"], (x["value"], y["value"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax2.barh(d["machine_id"], dec["ratio"] if dec and dec["ratio"] else 0, color=COLORS["decode"])
    ax1.set(title="decode against measured bandwidth", xlabel="bandwidth (GB/s)", ylabel="decode tok/s")
    ax2.set(title="share of the decode ceiling", xlabel="measured / (bandwidth / bytes per token)")
    ax3.set(title="prefill against matmul FLOP/s", xlabel="matmul GFLOP/s", ylabel="prefill tok/s")
    ax2.axvline(1, ls="--", color=COLORS["predicted"])
    ax2.tick_params(axis="y", labelsize=7)
    for ax in (ax1, ax3):  # from zero: a 3% difference should look like one
        ax.set_xlim(left=0, right=ax.get_xlim()[1] * 1.15)
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.1)
    return fig


def compare(paths: Sequence[str | Path], out: Path | None = None) -> str:
    """The comparison of the reports at ``paths`` as text; with ``out``, also compare.html there."""
    docs = [load(p) for p in paths]
    table = text_table(COMPARE_HEADER, [compare_row(d) for d in docs])
    text = "\n".join([table, "", *outliers(docs)])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        page = (f"<!doctype html><html><head><meta charset='utf-8'><title>compare</title>{STYLE}</head><body>"
                f"<h1>{len(docs)} reports compared</h1>{_html_table(COMPARE_HEADER, [compare_row(d) for d in docs])}"
                f"<pre>{html.escape(chr(10).join(outliers(docs)))}</pre>{_png(compare_plots(docs))}</body></html>")
        (out / "compare.html").write_text(page, encoding="utf8")
    return text


# ------------------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    """``run`` / ``compare`` / ``validate``; returns the exit status."""
    p = argparse.ArgumentParser(description="The workbook's reference report.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="execute every notebook and write reports/<machine-id>/")
    r.add_argument("--quick", action="store_true", help="CI's short settings (WORKBOOK_QUICK=1)")
    r.add_argument("--out", type=Path, default=None, help="folder (default reports/<machine-id>)")
    r.add_argument("--cell-timeout", type=int, default=1800, help="seconds one cell may run")
    r.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb solutions/*.ipynb")
    c = sub.add_parser("compare", help="line up several results.json")
    c.add_argument("files", nargs="+")
    c.add_argument("--out", type=Path, default=REPORTS / "compare")
    v = sub.add_parser("validate", help="check results.json files against the schema")
    v.add_argument("files", nargs="+")
    i = sub.add_parser("index", help="(re)write the index.html beside a results.json")
    i.add_argument("files", nargs="+")
    j = sub.add_parser("join", help="write the report of a folder from its shard-*.json (a run in parallel lanes)")
    j.add_argument("folder", type=Path)
    j.add_argument("--validate", nargs="*", default=None, metavar="FILE",
                   help="then validate the joined results.json and these (one process: make test's last step)")
    a = p.parse_args(argv)
    try:
        return {"run": _run, "compare": _compare, "validate": _validate, "index": _index, "join": _join}[a.command](a)
    except ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    out = (a.out or REPORTS / machine_id(a.quick)).resolve()  # absolute: each kernel runs in its notebook's folder
    paths = [n.resolve() for n in a.notebooks] or discover()
    print(f"report of {len(paths)} notebooks into {out}/ ({'quick' if a.quick else 'full'} settings)", flush=True)
    doc = run_report(paths, out, a.quick, a.cell_timeout)
    print("\n" + text_table(HEADLINE_HEADER, headline_rows(doc)))
    failed = [e["path"] for e in doc["notebooks"] if e["status"] == "failed"]
    print(f"\n{len(doc['figures'])} figures from {len(paths)} notebooks in {doc['settings']['seconds']} s; "
          f"timing checks: {checks_summary(doc)}; "
          f"wrote {out}/index.html" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _join(a: argparse.Namespace) -> int:
    doc = join_shards(a.folder.resolve())
    print(f"joined {len(doc['notebooks'])} notebooks into {a.folder}/results.json; timing checks: {checks_summary(doc)}")
    if a.validate is None:
        return 0
    return _validate(argparse.Namespace(files=[a.folder / "results.json", *a.validate]))


def _compare(a: argparse.Namespace) -> int:
    print(compare(a.files, a.out))
    print(f"\nwrote {a.out}/compare.html")
    return 0


def _validate(a: argparse.Namespace) -> int:
    for f in a.files:
        doc = load(f)
        print(f"{f}: valid (schema v{SCHEMA_VERSION}), {len(doc['figures'])} figures, "
              f"{sum(e['status'] == 'ok' for e in doc['notebooks'])}/{len(doc['notebooks'])} notebooks ok, "
              f"timing checks: {checks_summary(doc)}")
    return 0


def _index(a: argparse.Namespace) -> int:
    for f in a.files:
        page = Path(f).parent / "index.html"
        page.write_text(index_html(load(f)), encoding="utf8")
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

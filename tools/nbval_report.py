"""A pytest plugin: the notebooks that nbval runs become the report, so each runs once per model.

    pytest notebooks solutions --nbval-lax --nbval-current-env -p tools.nbval_report --report-out DIR

nbval executes every code cell of a notebook in one kernel and keeps each cell's outputs on its test
item (``item.test_outputs``). This plugin gives each notebook's kernel the figures file that
:func:`utils.results.record` and :func:`utils.decide.decide` append to (by setting ``WORKBOOK_RESULTS``
and ``WORKBOOK_NOTEBOOK`` only while that kernel starts), puts the outputs back into the notebook,
and at the end writes what ``python -m utils.report run`` writes: each executed notebook as HTML,
``results.json`` (with every figure and every timing check's verdict) and ``index.html``. A notebook
whose cell failed is marked failed with that cell's error; the report is written all the same.
With ``--report-shard NAME`` it writes only ``shard-NAME.json`` (two pytest runs share one folder, and
``python -m utils.report join DIR`` writes the report from their shards).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from nbconvert import HTMLExporter

from utils import report
from utils.results import ENV_FILE, ENV_NOTEBOOK, read_lines
from utils.timing import quick


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--report-out", type=Path, default=None,
                     help="write the notebooks nbval runs as a workbook report into this folder")
    parser.addoption("--report-shard", default=None,
                     help="this run is one share of the report (another pytest writes the rest into the same "
                          "folder): write shard-NAME.json there, for `python -m utils.report join FOLDER`")


def pytest_configure(config: Any) -> None:
    out = config.getoption("--report-out")
    if out is not None:
        config.pluginmanager.register(NotebookRecorder(out.resolve(), config.getoption("--report-shard")),
                                      "workbook-nbval-report")


class NotebookRecorder:
    """Follows nbval's cells notebook by notebook; writes the report when the session ends."""

    def __init__(self, out: Path, shard: str | None = None) -> None:
        # a shard shares its folder with another run: it empties nothing (the caller starts from an empty folder)
        self.out, self.shard = (report.prepare_out(out) if shard is None else out), shard
        (self.out / "figures").mkdir(parents=True, exist_ok=True)
        self.runs: dict[Path, dict[str, Any]] = {}
        self.started = time.perf_counter()

    def _run(self, item: Any) -> dict[str, Any] | None:
        """The record of ``item``'s notebook (None for items that are not notebook cells)."""
        if not hasattr(item, "test_outputs") and not hasattr(item, "cell_num"):
            return None
        path = Path(str(item.parent.fspath))
        if path not in self.runs:
            self.runs[path] = {"nb": item.parent.nb, "start": time.perf_counter(), "end": time.perf_counter(),
                               "error": None}
        return self.runs[path]

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: Any) -> Iterator[None]:
        """Around the first cell's setup (where nbval starts the kernel), point the kernel at a figures file."""
        first = hasattr(item, "cell_num") and Path(str(item.parent.fspath)) not in self.runs
        run = self._run(item)
        saved = {k: os.environ.get(k) for k in (ENV_FILE, ENV_NOTEBOOK)}
        if first and run is not None:
            stem = Path(str(item.parent.fspath)).stem
            os.environ[ENV_FILE], os.environ[ENV_NOTEBOOK] = str(self.out / "figures" / f"{stem}.jsonl"), stem
        try:
            yield
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any) -> Iterator[None]:
        outcome = yield
        run = self._run(item)
        if run is None:
            return
        rep = outcome.get_result()
        if call.when == "call" and hasattr(item, "test_outputs"):
            item.cell.outputs = list(item.test_outputs)
        if rep.failed and run["error"] is None:
            run["error"] = f"cell {item.cell_num}: {first_line(rep.longreprtext)}"
        run["end"] = time.perf_counter()

    def pytest_sessionfinish(self, session: Any) -> None:
        entries = [self._entry(path, run) for path, run in self.runs.items()]
        if entries and self.shard is not None:
            path = report.write_shard(self.out, self.shard, entries, report.run_settings(quick()),
                                      time.perf_counter() - self.started)
            print(f"\nreport shard: {len(entries)} notebooks; wrote {path}")
        elif entries:
            doc = report.write_report(self.out, entries, report.run_settings(quick()),
                                      time.perf_counter() - self.started)
            print(f"\nreport: {len(entries)} notebooks, {len(doc['figures'])} figures, timing checks "
                  f"{report.checks_summary(doc)}; wrote {self.out}/index.html")

    def _entry(self, path: Path, run: dict[str, Any]) -> dict[str, Any]:
        """The notebook's HTML, written, and its line in ``results.json``."""
        body, _ = HTMLExporter().from_notebook_node(run["nb"], resources={"metadata": {"name": path.stem}})
        (self.out / f"{path.stem}.html").write_text(body, encoding="utf8")
        figures = [line for line in read_lines(self.out / "figures" / f"{path.stem}.jsonl") if line.get("kind") == "figure"]
        return {"name": path.stem, "path": f"{path.parent.name}/{path.name}",
                "status": "failed" if run["error"] else "ok", "seconds": round(run["end"] - run["start"], 1),
                "figures": len(figures), "html": f"{path.stem}.html", "error": run["error"]}


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def first_line(text: str) -> str:
    """The line that says why a cell failed: the last exception line of its traceback, else the first line."""
    lines = [line.strip() for line in ANSI.sub("", text).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "✗" in line or line.startswith("E ")]
    return (errors[-1] if errors else lines[0] if lines else "failed")[:500]

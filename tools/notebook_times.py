"""Say at the top of every chapter and lab how long it takes at full settings, from a measured report.

    python -m tools.notebook_times reports/<machine-id>/results.json   # a full-settings `make report`
    python -m tools.notebook_times --check                             # exit 1 if a notebook's line is stale

The seconds come from a report's per-notebook entries (``make report``, the learner's full settings, never
``--quick``), are kept with where they were measured in ``data/notebook_times.json``, and are written as one
line under each notebook's title. A report of some notebooks (``python -m utils.report run solutions/roofline.ipynb``)
updates theirs; each line names the run it came from. A notebook over :data:`LONG_S` says why it needs the time. A notebook
the report did not time says so instead of guessing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat

from utils.report import discover
from utils.results import load

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMES = REPO_ROOT / "data" / "notebook_times.json"
MARK = "*Time at full settings:"
LONG_S = 300
WHY = {
    "05_kv_cache": "the no-cache loop recomputes the whole context at every token, on purpose, so that its "
                   "quadratic cost can be measured against the cache's linear one",
    "06_whole_request": "it times whole requests over a grid of prompt and output lengths, each against its "
                        "prediction, with repeats",
    "batching": "it measures a grid of batch sizes and serves the same arrival trace with several schedulers",
    "roofline": "each compiled variant is built once per context (by layer groups: 11-17 s each on a 2-core Xeon; "
                "11-37 s on a 2-core EPYC, where the first build in a process is the slowest) the first time on a "
                "machine; a later run loads them from disk in a second or so each. llama.cpp is measured beside them",
    "speculative": "every draft and every k is timed against plain decoding, interleaved, on several tasks",
}


def times_from_report(path: Path) -> dict:
    """``{"source": ..., "seconds": {notebook: s}}`` from a full-settings ``results.json``."""
    doc = load(path)
    if doc["settings"].get("quick"):
        raise SystemExit(f"{path}: a quick report; the times must come from full settings (make report)")
    m = doc["machine"]
    source = (f"`make report` on {m.get('device_name', '?')}, {m.get('torch_threads', '?')} threads, "
              f"{doc['settings'].get('started', '')[:10]}")
    return {"source": source, "seconds": {e["name"]: e["seconds"] for e in doc["notebooks"] if e["status"] == "ok"}}


def minutes(seconds: float) -> str:
    return f"about {max(1, round(seconds / 60))} min" if seconds >= 90 else f"about {round(seconds, -1):.0f} s"


def line_for(name: str, times: dict) -> str:
    """The line under the notebook's title."""
    seconds = times["seconds"].get(name)
    if seconds is None:
        return f"{MARK} not measured yet (`make report` times every notebook; then `python -m tools.notebook_times`).*"
    why = f" It needs the time because {WHY[name]}." if seconds > LONG_S and name in WHY else ""
    source = times.get("sources", {}).get(name, times["source"])
    return f"{MARK} {minutes(seconds)} on a 2-core CPU (measured by {source}).{why}*"


def merged(stored: dict, new: dict) -> dict:
    """``stored`` with every notebook that ``new`` timed replaced, each notebook keeping where it was measured
    (a report of a few notebooks updates those and leaves the others' lines as they were)."""
    sources = {n: stored.get("sources", {}).get(n, stored["source"]) for n in stored["seconds"]}
    sources.update({n: new["source"] for n in new["seconds"]})
    return {"source": new["source"], "seconds": {**stored["seconds"], **new["seconds"]}, "sources": sources}


def stamped(path: Path, times: dict) -> tuple[nbformat.NotebookNode, bool]:
    """The notebook with its time line written under the title; whether that changed it."""
    nb = nbformat.read(path, as_version=4)
    cell = nb.cells[0]
    lines = cell.source.split("\n")
    if len(lines) > 2 and lines[2].startswith(MARK):
        del lines[1:3]  # the old line and the blank line before it
    new = "\n".join([lines[0], "", line_for(path.stem, times), *lines[1:]])
    changed = new != cell.source
    cell.source = new
    return nb, changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", nargs="?", type=Path, help="a full-settings results.json (default: keep the stored times)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a notebook's line is stale")
    a = p.parse_args(argv)
    stored = json.loads(TIMES.read_text()) if TIMES.exists() else {"source": "", "seconds": {}}
    times = merged(stored, times_from_report(a.report)) if a.report else stored
    stale = []
    for path in discover(REPO_ROOT):
        nb, changed = stamped(path, times)
        if changed and a.check:
            stale.append(str(path.relative_to(REPO_ROOT)))
        elif changed:
            nbformat.write(nb, path)
    if a.check:
        print("\n".join(f"stale time line: {s}" for s in stale) or "every notebook's time line is current")
        return 1 if stale else 0
    if a.report:
        TIMES.write_text(json.dumps(times, indent=1) + "\n")
    from tools import make_labs  # the stubs in labs/ carry their solution's title cell: regenerate them

    make_labs.main([])
    print(f"time lines written from {', '.join(sorted(set(times.get('sources', {}).values()) or {times['source']}))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

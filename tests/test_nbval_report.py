"""The report written from nbval's own run (tools/nbval_report.py) and make test's step timer (tools/step.py)."""

from __future__ import annotations

import subprocess
import sys

import nbformat

from tools import step
from utils.models import REPO_ROOT
from utils.results import load

CELLS = ["from utils.results import record\nrecord('x_s', 1.5, unit='s')\nprint('hello from the cell')",
         "from utils.decide import decide\ndecide('clear', 3.0, bar=2.0, predicted=4.0, spread=0.05)\n"
         "decide('in the noise', 1.0, bar=1.0, predicted=1.02, spread=0.1)"]


def write(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# a notebook")] + [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)
    return path


def test_one_nbval_run_is_also_the_report(tmp_path):
    good = write(tmp_path / "a_good.ipynb", *CELLS)
    bad = write(tmp_path / "b_bad.ipynb", CELLS[0], "assert 1 + 1 == 3, 'a planted failure'", "print('still runs')")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "pytest", str(good), str(bad), "--nbval-lax", "--nbval-current-env",
                          "-p", "no:cacheprovider", "-p", "tools.nbval_report", "--report-out", str(out), "-q"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-2000:]  # the planted failure fails nbval as before
    doc = load(out / "results.json")
    status = {e["name"]: (e["status"], e["error"]) for e in doc["notebooks"]}
    assert status["a_good"] == ("ok", None)
    assert status["b_bad"][0] == "failed" and "a planted failure" in status["b_bad"][1]
    assert [(f["notebook"], f["name"]) for f in doc["figures"]] == [("a_good", "x_s"), ("b_bad", "x_s")]
    assert [(c["name"], c["outcome"]) for c in doc["checks"]] == [("clear", "passed"), ("in the noise", "undecided")]
    assert "hello from the cell" in (out / "a_good.html").read_text()  # the outputs went back into the notebook
    assert "Timing checks not decided here (1 of 2)" in (out / "index.html").read_text()


def test_two_shards_run_at_once_join_into_one_report(tmp_path):
    out = tmp_path / "out"
    books = [write(tmp_path / "b_second.ipynb", CELLS[0]), write(tmp_path / "a_first.ipynb", *CELLS)]
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", str(nb), "--nbval-lax", "--nbval-current-env",
                              "-p", "no:cacheprovider", "-p", "tools.nbval_report", "--report-out", str(out),
                              "--report-shard", name, "-q"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
            for nb, name in zip(books, "ab")]
    assert [r.wait(timeout=300) for r in runs] == [0, 0]
    assert not (out / "results.json").exists()  # a shard writes only its share
    joined = subprocess.run([sys.executable, "-m", "utils.report", "join", str(out), "--validate"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert joined.returncode == 0, joined.stderr
    assert f"{out / 'results.json'}: valid" in joined.stdout  # make test joins and validates in one process
    doc = load(out / "results.json")
    assert [e["name"] for e in doc["notebooks"]] == ["a_first", "b_second"]  # in path order
    assert [(f["notebook"], f["name"]) for f in doc["figures"]] == [("a_first", "x_s"), ("b_second", "x_s")]
    assert [(c["name"], c["outcome"]) for c in doc["checks"]] == [("clear", "passed"), ("in the noise", "undecided")]
    assert "hello from the cell" in (out / "a_first.html").read_text()
    empty = subprocess.run([sys.executable, "-m", "utils.report", "join", str(tmp_path)], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "no shard-*.json" in empty.stderr


def test_the_step_timer_logs_each_step_and_fails_with_the_table(tmp_path, capsys):
    log = tmp_path / "steps.tsv"
    assert step.main([str(log), "quick", "--", sys.executable, "-c", "pass"]) == 0
    assert step.main([str(log), "broken", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    out = capsys.readouterr().out
    assert "== step broken: FAILED (exit 3)" in out and "total" in out
    names = [line.split("\t")[0] for line in log.read_text().splitlines()]
    assert names == ["quick", "broken"]
    assert step.minutes(754.2) == "12 min 34 s" and step.minutes(9.6) == "10 s"


def test_two_lanes_run_at_once_and_the_total_counts_their_wall_time(tmp_path, capsys):
    log = tmp_path / "steps.tsv"
    lane = (f"{sys.executable} {REPO_ROOT / 'tools' / 'step.py'} {log} {{name}} -- "
            f"{sys.executable} -c \"import time; time.sleep(1); print('{{name}} says hi')\"")
    assert step.main([str(log), "--side-by-side", lane.format(name="one"), lane.format(name="two")]) == 0
    out = capsys.readouterr().out
    assert out.index("lane a: ") < out.index("one says hi") < out.index("two says hi")  # replayed lane after lane
    rows = [line.split("\t") for line in log.read_text().splitlines()]
    assert sorted((r[0], r[3]) for r in rows[:2]) == [("one", "a"), ("two", "b")]
    assert rows[2][0].startswith("wall") and 1 <= float(rows[2][1]) < 1.9  # at once: not 2 s one after the other
    table = step.summary(log)
    assert "lane a: one" in table and "lane b: two" in table
    total = table.splitlines()[-1]
    assert total.split()[-2:] in (["1", "s"], ["2", "s"])  # the wall row, not 1 + 1 + wall
    assert step.main([str(log), "--side-by-side", f"{sys.executable} -c 'raise SystemExit(4)'", "true"]) == 4

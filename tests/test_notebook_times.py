"""tools/notebook_times.py: the time line under each notebook's title comes from a measured report."""

from __future__ import annotations

import nbformat
import pytest

from tools import notebook_times as nt

TIMES = {"source": "`make report` on a test CPU", "seconds": {"short": 42, "long": 480, "roofline": 606}}


def notebook(path, title="# 99 · A chapter"):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"{title}\n\n**Question:** why?"), nbformat.v4.new_code_cell("1")]
    nbformat.write(nb, path)
    return path


def test_the_line_says_the_measured_time_and_where_it_was_measured():
    assert nt.line_for("short", TIMES) == "*Time at full settings: about 40 s on a 2-core CPU (measured by `make report` on a test CPU).*"
    assert "about 8 min" in nt.line_for("long", TIMES) and "needs the time" not in nt.line_for("long", TIMES)
    assert "It needs the time because each compiled variant" in nt.line_for("roofline", TIMES)
    assert "not measured yet" in nt.line_for("unknown", TIMES)


def test_stamping_twice_changes_nothing_the_second_time(tmp_path):
    path = notebook(tmp_path / "short.ipynb")
    nb, changed = nt.stamped(path, TIMES)
    assert changed and nb.cells[0].source.split("\n")[:4] == [
        "# 99 · A chapter", "", nt.line_for("short", TIMES), ""]
    nbformat.write(nb, path)
    again, changed = nt.stamped(path, TIMES)
    assert not changed and again.cells[0].source == nb.cells[0].source
    newer = {**TIMES, "seconds": {"short": 100}}
    assert nt.stamped(path, newer)[0].cells[0].source.count(nt.MARK) == 1


def test_a_quick_report_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(nt, "load", lambda p: {"settings": {"quick": True}})
    with pytest.raises(SystemExit, match="quick report"):
        nt.times_from_report(tmp_path / "results.json")


def test_a_report_of_some_notebooks_updates_theirs_and_keeps_where_the_others_were_measured():
    new = {"source": "`make report` on another CPU", "seconds": {"long": 200, "fresh": 30}}
    both = nt.merged(TIMES, new)
    assert both["seconds"] == {"short": 42, "long": 200, "roofline": 606, "fresh": 30}
    assert "on a test CPU" in nt.line_for("short", both) and "on another CPU" in nt.line_for("long", both)
    assert "on another CPU" in nt.line_for("fresh", both) and "about 30 s" in nt.line_for("fresh", both)
    assert nt.merged(both, new) == both  # the same report twice changes nothing

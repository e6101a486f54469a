"""tools.make_labs: solution regions become stubs, outputs go, --check sees drift."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # `tools` is a script folder, not an installed package

from tools import make_labs  # noqa: E402

FUNCTION_CELL = '''import torch

def absmax_scale(w):
    """Scale per row."""
    ### BEGIN SOLUTION
    s = w.abs().amax(dim=1)
    return s / 127
    ### END SOLUTION

print("kept")'''

TOP_LEVEL_CELL = '''x = 1
### BEGIN SOLUTION compute y
y = x + 1
### END SOLUTION
### BEGIN SOLUTION
z = y * 2
### END SOLUTION'''

ANSWER_CELL = '''**Question:** why?
<!-- BEGIN SOLUTION -->
Because decode is bandwidth-bound.
<!-- END SOLUTION -->'''


def synthetic_solution() -> nbformat.NotebookNode:
    """A small solved notebook with every kind of cell the generator handles."""
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    function = nbformat.v4.new_code_cell(FUNCTION_CELL, execution_count=3,
                                         outputs=[nbformat.v4.new_output("stream", text="kept\n")])
    function.metadata["execution"] = {"iopub.status.idle": "2025-01-01T00:00:00Z"}
    function.metadata["tags"] = ["exercise"]
    nb.cells = [
        nbformat.v4.new_markdown_cell("# A lab"),
        function,
        nbformat.v4.new_code_cell(TOP_LEVEL_CELL, execution_count=4),
        nbformat.v4.new_code_cell("check(absmax_scale)", execution_count=5),
        nbformat.v4.new_markdown_cell(ANSWER_CELL),
        nbformat.v4.new_code_cell("### HIDE\nassert secret == 42"),
        nbformat.v4.new_code_cell("also_hidden = True", metadata={"tags": ["hide-in-lab"]}),
        nbformat.v4.new_markdown_cell("<!-- HIDE -->\nOnly in the solution."),
    ]
    return nb


def test_function_region_becomes_indented_stub() -> None:
    out = make_labs.strip_code_solution(FUNCTION_CELL)
    assert "s = w.abs()" not in out and "return s / 127" not in out
    assert '    # YOUR CODE HERE\n    raise NotImplementedError("Exercise: complete absmax_scale()")' in out
    assert '    """Scale per row."""' in out and out.startswith("import torch\n")
    assert out.endswith('print("kept")')
    assert "BEGIN SOLUTION" not in out and "END SOLUTION" not in out


def test_top_level_regions_and_labels() -> None:
    out = make_labs.strip_code_solution(TOP_LEVEL_CELL)
    assert out.splitlines() == [
        "x = 1",
        "# YOUR CODE HERE", 'raise NotImplementedError("Exercise: compute y")',
        "# YOUR CODE HERE", 'raise NotImplementedError("Exercise: fill in this cell")',
    ]
    compile(out, "<stub>", "exec")  # the stub is valid Python


def test_markdown_answer_is_stubbed() -> None:
    out = make_labs.strip_markdown_solution(ANSWER_CELL)
    assert out == "**Question:** why?\n*Your answer here.*"


@pytest.mark.parametrize("source", [
    "### BEGIN SOLUTION\nx = 1",
    "x = 1\n### END SOLUTION",
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION",
])
def test_unbalanced_markers_are_errors(source: str) -> None:
    with pytest.raises(make_labs.MarkerError):
        make_labs.strip_code_solution(source)


def test_make_lab_strips_outputs_hides_cells_keeps_the_rest() -> None:
    solution = synthetic_solution()
    before = nbformat.writes(solution)
    lab = make_labs.make_lab(solution, "solutions/x.ipynb")
    assert nbformat.writes(solution) == before, "the solved notebook must not be modified"
    sources = [cell.source for cell in lab.cells]
    assert len(lab.cells) == 5
    assert not any("secret" in s or "also_hidden" in s or "Only in the solution" in s for s in sources)
    assert sources[0] == "# A lab" and sources[3] == "check(absmax_scale)"
    for cell in lab.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
            assert "execution" not in cell.metadata
    assert lab.cells[1].metadata["tags"] == ["exercise"]
    assert [c.id for c in lab.cells] == [solution.cells[i].id for i in range(5)]
    assert lab.metadata["kernelspec"]["name"] == "python3"
    assert lab.metadata["workbook"]["generated_from"] == "solutions/x.ipynb"
    nbformat.validate(lab)


def _write_solution(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "demo.ipynb"
    nbformat.write(synthetic_solution(), path)
    return path


def test_write_then_check_in_sync(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sol, labs = tmp_path / "solutions", tmp_path / "labs"
    _write_solution(sol)
    assert make_labs.main(["--solutions", str(sol), "--labs", str(labs)]) == 0
    text = (labs / "demo.ipynb").read_text(encoding="utf8")
    lab = nbformat.reads(text, as_version=4)
    assert text == nbformat.writes(lab) + "\n", "written exactly as nbformat.write writes"
    assert make_labs.write_labs(sol, labs) == [], "a second run rewrites nothing"
    assert make_labs.main(["--check", "--solutions", str(sol), "--labs", str(labs)]) == 0
    assert "in sync" in capsys.readouterr().out


def test_check_fails_when_out_of_sync(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sol, labs = tmp_path / "solutions", tmp_path / "labs"
    path = _write_solution(sol)
    assert make_labs.main(["--check", "--solutions", str(sol), "--labs", str(labs)]) == 1
    assert "missing" in capsys.readouterr().out
    make_labs.write_labs(sol, labs)
    solution = nbformat.read(path, as_version=4)
    solution.cells[3].source = "check(absmax_scale, strict=True)"
    nbformat.write(solution, path)
    assert make_labs.main(["--check", "--solutions", str(sol), "--labs", str(labs)]) == 1
    out = capsys.readouterr().out
    assert "out of date" in out and "strict=True" in out and "OUT OF SYNC" in out
    make_labs.write_labs(sol, labs)
    (labs / "orphan.ipynb").write_text((labs / "demo.ipynb").read_text())
    assert make_labs.check_labs(sol, labs) == [f"no solution for: {labs / 'orphan.ipynb'} "
                                               "(delete it, or add solutions/orphan.ipynb)"]


def test_real_labs_are_in_sync_with_solutions() -> None:
    expected = make_labs.expected_labs()
    solutions = sorted(make_labs.SOLUTIONS_DIR.glob("*.ipynb"))
    assert [p.name for p in expected] == [p.name for p in solutions]  # none yet -> nothing generated
    problems = make_labs.check_labs()
    assert problems == [], "labs/ is stale; run `python -m tools.make_labs`:\n" + "\n".join(problems)

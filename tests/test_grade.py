"""utils.grade: a gradebook from submitted labs, robust to what students hand in.

Grading runs kernels, so the robustness cases use a tiny synthetic lab (three exercises, no torch) made by
the real generator (``tools.make_labs``); the real labs' claims are checked cheaply here (their metadata)
and in full, by execution, under the ``grade_full`` marker (``make test-grade``).
"""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from utils import grade

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # `tools` is a script folder, not an installed package

from tools import make_labs  # noqa: E402

SETUP = '''import json, os
def check_equal(name, got, want):
    assert got == want, f"✗ {name}: got {got!r}, expected {want!r}"
    print(f"✓ {name}")'''

DOUBLE = '''def double(x):
    """Twice x."""
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION'''

SQUARE = '''def square(x):
    ### BEGIN SOLUTION
    return x * x
    ### END SOLUTION'''

TIMED = '''def speedup(fast_s, slow_s):
    ### BEGIN SOLUTION
    return slow_s / fast_s
    ### END SOLUTION'''

UNDECIDED = '''from utils.results import record, record_check
record("toy_tok_s", 42.0, unit="tok/s", context_tokens=8)
check_equal("speedup(1, 3)", speedup(1, 3), 3.0)
record_check("toy speed-up > 2x", "undecided", speedup(1, 2.1), 2.0, 2.1, 0.2)  # as utils.decide does
print("not decided here: toy speed-up > 2x: predicted 2.1x, spread 20%")'''


def fake_solution(timed: bool = True) -> nbformat.NotebookNode:
    """A solved lab: three exercises; the third's second check cannot be decided on any machine
    (``timed=False``: the first two only)."""
    code, md = nbformat.v4.new_code_cell, nbformat.v4.new_markdown_cell
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [md("# Toy lab"), code(SETUP), code(DOUBLE),
                code('check_equal("double(2)", double(2), 4)\nD = double(21)'),
                code('check_equal("double(-1)", double(-1), -2)'),
                code(SQUARE), code('check_equal("square(3)", square(3), 9)\ncheck_equal("D", D, 42)'),
                code("### HIDE\nassert square(4) == 16"),
                code(TIMED), code('check_equal("speedup(2, 4)", speedup(2, 4), 2.0)'), code(UNDECIDED)]
    nb.cells = nb.cells if timed else nb.cells[:8]
    return nb


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """solutions/toy.ipynb and the labs/toy.ipynb the generator makes of it."""
    root = tmp_path_factory.mktemp("course")
    (root / "solutions").mkdir()
    nbformat.write(fake_solution(), root / "solutions" / "toy.ipynb")
    make_labs.write_labs(root / "solutions", root / "labs")
    return {"solutions": root / "solutions", "labs": root / "labs", "root": root}


def lab_nb(toy: dict[str, Path]) -> nbformat.NotebookNode:
    return nbformat.read(toy["labs"] / "toy.ipynb", as_version=4)


def solved_nb(toy: dict[str, Path]) -> nbformat.NotebookNode:
    """The lab filled in with the solutions, as a student who solved everything hands it in."""
    nb = lab_nb(toy)
    solved = grade.load_lab("toy", toy["labs"], toy["solutions"]).solved
    for cell in nb.cells:
        if grade.role(cell) and grade.role(cell)[0] == "exercise":
            cell.source = solved[grade.role(cell)[1]]
    return nb


def with_exercise(nb: nbformat.NotebookNode, exercise: str, source: str) -> nbformat.NotebookNode:
    for cell in nb.cells:
        if grade.role(cell) == ("exercise", exercise):
            cell.source = source
    return nb


def scores(graded: grade.Graded) -> dict[str, tuple[int, int, str]]:
    return {o.exercise: (o.points, o.out_of, o.verdict) for o in graded.outcomes}


# ------------------------------------------------------------------------------ metadata (cheap)


def test_generator_writes_nbgrader_and_workbook_metadata(toy: dict[str, Path]) -> None:
    cells = lab_nb(toy).cells
    meta = [(c.metadata.get("workbook"), c.metadata.get("nbgrader")) for c in cells]
    roles = [m[0] and (m[0]["role"], m[0]["exercise"]) for m in meta]
    assert roles == [None, None, ("exercise", "double"), ("check", "double"), ("check", "double"),
                     ("exercise", "square"), ("check", "square"), ("exercise", "speedup"),
                     ("check", "speedup"), ("check", "speedup")]
    assert meta[2][1] == {"grade": False, "grade_id": "double", "locked": False, "schema_version": 3,
                          "solution": True, "task": False}
    assert meta[4][1] == {"grade": True, "grade_id": "double-check-2", "locked": True, "points": 1,
                          "schema_version": 3, "solution": False, "task": False}
    lab = grade.load_lab("toy", toy["labs"], toy["solutions"])
    assert lab.points == {"double": 2, "square": 1, "speedup": 2}
    assert "return 2 * x" in lab.solved["double"] and "return 2 * x" not in cells[2].source


def test_nbgrader_source_is_the_lab_with_solved_exercises(tmp_path: Path) -> None:
    solution = fake_solution()
    solution.cells.append(nbformat.v4.new_markdown_cell("Why?\n<!-- BEGIN SOLUTION -->\nBecause.\n<!-- END SOLUTION -->"))
    nbformat.write(solution, tmp_path / "toy.ipynb")
    [path] = make_labs.write_nbgrader_course(tmp_path / "course", tmp_path)
    assert path == tmp_path / "course" / "source" / "toy" / "toy.ipynb"
    source, lab = nbformat.read(path, as_version=4), make_labs.make_lab(solution)
    assert [c.metadata for c in source.cells] == [c.metadata for c in lab.cells]
    assert source.cells[2].source == DOUBLE and "assert square(4)" not in str(source.cells)
    assert source.cells[-1].source == "Why?\n*Your answer here.*"  # nbgrader would take a marker for a region


def test_check_cells_need_a_check_call_on_a_learners_name() -> None:
    code = nbformat.v4.new_code_cell
    plan = make_labs.grading_plan([
        code("check_equal('setup', 1, 1)"),  # before any exercise: the lab's own
        code("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"),
        code("check_equal('f', f(), 1)"),
        code("# f is great\ncheck_equal('not f', 'f()', 'f()')"),  # f only in a comment and strings
        code("print(f())"),  # no check call
    ])
    assert plan == {1: {"exercise": "f", "role": "exercise"}, 2: {"exercise": "f", "role": "check", "check": 1}}


def test_real_labs_carry_valid_grading_metadata() -> None:
    """Every real lab: each exercise has at least one check cell; grade ids unique; nbgrader's schema."""
    for path in sorted((REPO_ROOT / "labs").glob("*.ipynb")):
        lab = grade.load_lab(path.stem, REPO_ROOT / "labs", REPO_ROOT / "solutions")
        assert lab.points and all(points >= 1 for points in lab.points.values()), (path.name, lab.points)
        ids = [c.metadata["nbgrader"]["grade_id"] for c in lab.cells if "nbgrader" in c.metadata]
        assert len(ids) == len(set(ids)), path.name
        for cell in lab.cells:
            nbg = cell.metadata.get("nbgrader")
            if nbg:
                assert set(nbg) >= {"grade", "grade_id", "locked", "schema_version", "solution", "task"}
                assert nbg["schema_version"] == 3 and (not nbg["grade"] or nbg["points"] > 0)
                assert cell.cell_type == "code" and nbg["locked"] == nbg["grade"] != nbg["solution"]
                assert ("BEGIN SOLUTION" in lab.solved[nbg["grade_id"]]) if nbg["solution"] else True


def test_student_name_and_lab_from_the_path() -> None:
    labs = ["quantization", "batching"]
    assert grade.student_name(Path("class/alice/quantization.ipynb"), labs) == "alice"
    assert grade.student_name(Path("class/alice_quantization.ipynb"), labs) == "alice"
    assert grade.student_name(Path("class/bob-batching.ipynb"), labs) == "bob"
    assert grade.student_name(Path("class/carol.ipynb"), labs) == "carol"
    assert grade.student_name(Path("course/submitted/dan/batching/batching.ipynb"), labs) == "dan"  # nbgrader's
    assert grade.lab_in_name("alice_quantization", labs) == "quantization"
    assert grade.lab_in_name("carol", labs) is None


def test_merge_restores_edited_and_deleted_checks(toy: dict[str, Path]) -> None:
    lab = grade.load_lab("toy", toy["labs"], toy["solutions"])
    nb = solved_nb(toy)
    nb.cells[3].source = "print('trust me')"  # the first check of double, edited
    del nb.cells[6]  # the check of square, deleted
    nb.cells.insert(5, nbformat.v4.new_code_cell("helper = 1"))  # a cell of the student's own
    cells, problems = grade.merge(nb.cells, lab)
    assert [c.source for c in cells if grade.role(c) and grade.role(c)[0] == "check"] == \
           [c.source for c in lab.cells if grade.role(c) and grade.role(c)[0] == "check"]
    assert cells[5].source == "helper = 1" and grade.role(cells[5]) is None
    assert [grade.role(c) for c in cells[6:8]] == [("exercise", "square"), ("check", "square")]
    assert problems == ["check cell double-check-1 was edited: graded with the original check",
                        "check cell square-check-1 was deleted: restored"]


# ------------------------------------------------------------------------------ grading (kernels)

BAD_SQUARE = "def square(x):\n    return x + x"  # right for 2, wrong for 3
LOOP = "def square(x):\n    while True:\n        pass"
CRASH = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer sends"


def write(nb: nbformat.NotebookNode, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def graded_class(toy: dict[str, Path]) -> tuple[dict[str, grade.Graded], Path]:
    """Ten submissions, every bad case among them, graded in one run."""
    cls, out = toy["root"] / "class", toy["root"] / "grades"
    edited = solved_nb(toy)
    edited.cells[3].source = "print('all good')"
    deleted = solved_nb(toy)
    del deleted.cells[6]
    other = lab_nb(toy)
    other.metadata["workbook"]["generated_from"] = "solutions/other.ipynb"
    other_lab = toy["root"] / "labs" / "other.ipynb"
    shutil.copy(toy["labs"] / "toy.ipynb", other_lab)  # a second lab in the course
    shutil.copy(toy["solutions"] / "toy.ipynb", toy["solutions"] / "other.ipynb")
    (cls / "zoe").mkdir(parents=True)
    (cls / "zoe" / "toy.ipynb").write_text("this is not JSON")
    paths = [write(solved_nb(toy), cls / "ada" / "toy.ipynb"),
             write(lab_nb(toy), cls / "bo_toy.ipynb"),  # the stub, untouched
             write(with_exercise(solved_nb(toy), "square", BAD_SQUARE), cls / "cy" / "toy.ipynb"),
             write(edited, cls / "di" / "toy.ipynb"), write(deleted, cls / "ed" / "toy.ipynb"),
             write(with_exercise(solved_nb(toy), "square", LOOP), cls / "flo" / "toy.ipynb"),
             write(with_exercise(solved_nb(toy), "square", CRASH), cls / "gus" / "toy.ipynb"),
             write(with_exercise(solved_nb(toy), "double", "import leftpad_magic\n" + DOUBLE.replace(
                 "### BEGIN SOLUTION", "").replace("### END SOLUTION", "")), cls / "hal" / "toy.ipynb"),
             write(other, cls / "ivy" / "toy.ipynb"), cls / "zoe" / "toy.ipynb"]
    try:
        graded = grade.grade_class(paths, out, toy["labs"], toy["solutions"], grade.Limits(cell_s=8, notebook_s=60))
    finally:
        other_lab.unlink()
        (toy["solutions"] / "other.ipynb").unlink()
    return {g.student: g for g in graded}, out


FULL = {"double": (2, 2, "passed"), "square": (1, 1, "passed"), "speedup": (1, 1, "passed")}


def test_solved_full_marks_stub_zero(graded_class: tuple[dict[str, grade.Graded], Path]) -> None:
    graded, _ = graded_class
    assert scores(graded["ada"]) == FULL and graded["ada"].problems == []
    assert scores(graded["bo"]) == {"double": (0, 2, "not attempted"), "square": (0, 1, "not attempted"),
                                    "speedup": (0, 2, "not attempted")}  # its undecided check raises too
    assert "NotImplementedError" in graded["bo"].first_error and "cell 3" in graded["bo"].first_error


def test_a_mistake_loses_exactly_its_exercise(graded_class: tuple[dict[str, grade.Graded], Path]) -> None:
    graded, _ = graded_class
    assert scores(graded["cy"]) == {**FULL, "square": (0, 1, "failed")}
    assert "square(3): got 6, expected 9" in graded["cy"].outcomes[1].messages[0]


def test_not_gradable_here_is_neither_pass_nor_failure(graded_class: tuple[dict[str, grade.Graded], Path]) -> None:
    ada = graded_class[0]["ada"]
    speedup = ada.outcomes[2]
    assert (speedup.points, speedup.out_of) == (1, 1) and "1 of 2 checks not gradable here" in speedup.messages
    assert any(m.startswith("not decided here: toy speed-up") for m in speedup.messages)
    assert [(f["name"], f["value"]) for f in ada.figures] == [("toy_tok_s", 42.0)]


def test_edited_and_deleted_checks_are_flagged_and_graded_with_the_original(
        graded_class: tuple[dict[str, grade.Graded], Path]) -> None:
    graded, _ = graded_class
    assert scores(graded["di"]) == FULL and graded["di"].problems == [
        "check cell double-check-1 was edited: graded with the original check"]
    assert scores(graded["ed"]) == FULL and graded["ed"].problems == ["check cell square-check-1 was deleted: restored"]


def test_endless_loop_and_crash_stop_only_that_submission(graded_class: tuple[dict[str, grade.Graded], Path]) -> None:
    graded, _ = graded_class
    flo, gus = graded["flo"], graded["gus"]
    assert scores(flo)["double"] == (2, 2, "passed") and scores(flo)["square"][2] == "failed"
    assert scores(flo)["speedup"][2] == "not reached"
    assert any("ran over the time limit" in p for p in flo.problems), flo.problems
    assert scores(gus)["double"] == (2, 2, "passed")
    assert scores(gus)["square"] == (0, 1, "not reached") and scores(gus)["speedup"][0] == 0
    assert any("the kernel died" in p for p in gus.problems), gus.problems


def test_a_memory_limit_turns_a_huge_allocation_into_a_failed_exercise(toy: dict[str, Path], tmp_path: Path) -> None:
    hog = "def square(x):\n    return len(bytearray(8 * 2**30)) and x * x  # 8 GB"
    path = write(with_exercise(solved_nb(toy), "square", hog), tmp_path / "hog" / "toy.ipynb")
    [graded] = grade.grade_class([path], tmp_path / "grades", toy["labs"], toy["solutions"],
                                 grade.Limits(cell_s=20, notebook_s=60, memory_gb=3))
    assert scores(graded) == {**FULL, "square": (0, 1, "failed")}
    assert graded.outcomes[1].messages == ["MemoryError"] and graded.problems == ["ran out of memory in cell 6"]


def test_missing_module_wrong_lab_and_garbage_are_named(graded_class: tuple[dict[str, grade.Graded], Path],
                                                       toy: dict[str, Path]) -> None:
    graded, out = graded_class
    hal = graded["hal"]
    assert scores(hal) == {**FULL, "double": (0, 2, "failed")}
    assert "imports leftpad_magic, a module the course does not ship" in hal.problems
    assert graded["ivy"].problems == ["a notebook of the other lab, handed in as toy: not graded"]
    only_toy = {"toy": grade.load_lab("toy", toy["labs"], toy["solutions"])}  # "other" is no lab of this course
    again = grade.grade_one(graded["ivy"].path, only_toy, out, grade.Limits())
    assert again.problems == ["a notebook of the other lab, handed in as toy: not graded"]
    assert all(o.points == 0 for o in graded["ivy"].outcomes)
    assert graded["zoe"].problems[0].startswith("not a notebook")
    assert [o.points for o in graded["zoe"].outcomes] == [0, 0, 0]


def test_gradebook_files(graded_class: tuple[dict[str, grade.Graded], Path]) -> None:
    graded, out = graded_class
    rows = list(csv.DictReader(open(out / "grades.csv", encoding="utf8")))
    assert len(rows) == 10 * 3 and set(rows[0]) == {"student", "lab", "exercise", "points", "out_of", "verdict", "detail"}
    assert {(r["exercise"], r["points"], r["verdict"]) for r in rows if r["student"] == "cy"} == {
        ("double", "2", "passed"), ("square", "0", "failed"), ("speedup", "1", "passed")}
    rates = grade.pass_rates(list(graded.values()))
    assert [r[1] for r in rates][0] == "square" and rates == sorted(rates, key=lambda r: r[2])
    page = (out / "grades.html").read_text(encoding="utf8")
    assert "+1 not gradable here" in page
    assert "hardest first" in page and "leftpad_magic" in page and page.index("square") < page.rindex("double")
    text = (out / "feedback" / "bo-toy.md").read_text(encoding="utf8")
    assert "0 of 5 points" in text and "The first error" in text and "NotImplementedError" in text
    assert "toy_tok_s" in (out / "feedback" / "ada-toy.md").read_text(encoding="utf8")
    summary = grade.summary(list(graded.values()))
    assert summary.count("\n  ") == sum(len(g.problems) for g in graded.values()) >= 7


def test_a_check_after_its_exercise_was_repaired_earns_nothing(tmp_path: Path) -> None:
    """An exercise checked again further down (the quantization lab's quantize_model): once a failed
    exercise is repaired with the solution, its later checks run on the solution, so they score nothing."""
    code = nbformat.v4.new_code_cell
    solution = fake_solution(timed=False)
    solution.cells = solution.cells[:4] + [code(SQUARE), code('check_equal("square(3)", square(3), 9)'),
                                           code('check_equal("double(5)", double(5), 10)')]
    (tmp_path / "solutions").mkdir()
    nbformat.write(solution, tmp_path / "solutions" / "later.ipynb")
    make_labs.write_labs(tmp_path / "solutions", tmp_path / "labs")
    stub = nbformat.read(tmp_path / "labs" / "later.ipynb", as_version=4)
    assert [grade.role(c) for c in stub.cells][-1] == ("check", "double")
    wrong = with_exercise(nbformat.read(tmp_path / "labs" / "later.ipynb", as_version=4), "double",
                          "def double(x):\n    return 3 * x")
    wrong = with_exercise(wrong, "square", "def square(x):\n    return x * x")
    paths = [write(stub, tmp_path / "class" / "stub" / "later.ipynb"),
             write(wrong, tmp_path / "class" / "wrong" / "later.ipynb")]
    graded = {g.student: g for g in grade.grade_class(paths, tmp_path / "grades", tmp_path / "labs",
                                                      tmp_path / "solutions", grade.Limits(cell_s=8, notebook_s=60))}
    assert scores(graded["stub"]) == {"double": (0, 2, "not attempted"), "square": (0, 1, "not attempted")}
    assert scores(graded["wrong"]) == {"double": (0, 2, "failed"), "square": (1, 1, "passed")}
    assert any("ran on the solution" in m for m in graded["wrong"].outcomes[0].messages)

"""nbgrader runs on the generated labs' metadata, and its autograder's scores equal ``utils.grade``'s.

A small course (the synthetic lab of tests/test_grade.py, without its undecided timing check: nbgrader
cannot tell "not gradable here" from a pass) goes through ``nbgrader generate_assignment`` and
``nbgrader autograde`` with one solved and one stub submission. Needs the ``grade`` extra
(``pip install -e ".[grade]"``; ``make test`` installs it); skipped with its reason without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from utils import grade

nbgrader = pytest.importorskip("nbgrader", reason="nbgrader is not installed: pip install -e '.[grade]'")

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_grade import fake_solution  # noqa: E402
from tools import make_labs  # noqa: E402


def nbgrader_cli(course: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}  # its alembic
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={course}"],
                          cwd=course, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_nbgrader_validates_every_real_lab() -> None:
    from nbgrader.nbgraderformat import MetadataValidator
    for path in sorted((REPO_ROOT / "labs").glob("*.ipynb")):
        MetadataValidator().validate_nb(nbformat.read(path, as_version=4))  # raises on a schema error


def test_nbgrader_autograde_agrees_with_make_grade(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nbgrader.api import Gradebook
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    course, labs, solutions = tmp_path / "course", tmp_path / "labs", tmp_path / "solutions"
    solutions.mkdir()
    nbformat.write(fake_solution(timed=False), solutions / "toy.ipynb")
    make_labs.write_labs(solutions, labs)
    make_labs.write_nbgrader_course(course, solutions)
    (course / "nbgrader_config.py").write_text("c = get_config()\nc.CourseDirectory.course_id = 'workbook'\n")
    nbgrader_cli(course, "generate_assignment", "toy", "--force")
    released = nbformat.read(course / "release" / "toy" / "toy.ipynb", as_version=4)
    ours_lab = nbformat.read(labs / "toy.ipynb", as_version=4).cells
    assert len(released.cells) == len(ours_lab)
    for theirs, mine in zip(released.cells, ours_lab):  # the same lab; only the stubs' wording differs
        solution = grade.role(mine) and grade.role(mine)[0] == "exercise"
        assert theirs.source == mine.source or (solution and "raise NotImplementedError" in theirs.source
                                                 and "BEGIN SOLUTION" not in theirs.source)

    lab = grade.load_lab("toy", labs, solutions)
    stub = nbformat.read(labs / "toy.ipynb", as_version=4)
    solved = nbformat.read(labs / "toy.ipynb", as_version=4)
    for cell in solved.cells:
        if grade.role(cell) and grade.role(cell)[0] == "exercise":
            cell.source = lab.solved[grade.role(cell)[1]]
    paths = []
    for student, nb in (("solved", solved), ("stub", stub)):
        target = course / "submitted" / student / "toy" / "toy.ipynb"
        target.parent.mkdir(parents=True)
        nbformat.write(nb, target)
        paths.append(target)
    nbgrader_cli(course, "autograde", "toy", "--force")
    ours = {g.student: g for g in grade.grade_class(paths, tmp_path / "grades", labs, solutions)}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for student in ("solved", "stub"):
            theirs = {g.name: g.score for g in gb.find_submission_notebook("toy", "toy", student).grades}
            by_exercise = {o.exercise: sum(s for gid, s in theirs.items() if gid.startswith(o.exercise + "-check-"))
                           for o in ours[student].outcomes}
            assert by_exercise == {o.exercise: o.points for o in ours[student].outcomes}, (student, theirs)
            assert gb.find_submission("toy", student).score == sum(o.points for o in ours[student].outcomes)
    assert sum(o.points for o in ours["solved"].outcomes) == 3 and sum(o.points for o in ours["stub"].outcomes) == 0

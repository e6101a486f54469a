"""Grading the real labs, by execution (slow: ``make test-grade``, or WORKBOOK_GRADE_FULL=1 with -m grade_full).

For every lab: the solved lab scores full marks, the stub scores zero on every exercise, and a planted
mistake that the checks catch loses exactly its exercise's points (the others keep theirs).
``make test`` skips it: it runs each lab three times (the cheap version is tests/test_grade.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

from utils import grade

REPO_ROOT = Path(__file__).resolve().parent.parent
LABS, SOLUTIONS = REPO_ROOT / "labs", REPO_ROOT / "solutions"

pytestmark = [pytest.mark.grade_full,
              pytest.mark.skipif(not os.environ.get("WORKBOOK_GRADE_FULL"),
                                 reason="runs every lab three times: make test-grade (WORKBOOK_GRADE_FULL=1)")]

PLANTED = {  # lab: (exercise, a line of its solution, the same line with a mistake the checks catch)
    "quantization": ("int8_scales", "amax(dim=1) / 127", "amax(dim=1) / 128"),
    "batching": ("padding_share_by_hand", "return 1 - sum(lengths)", "return sum(lengths)"),
    "roofline": ("ceiling_tok_s", "return bandwidth /", "return 2 * bandwidth /"),
    "speculative": ("prompt_lookup_by_hand", "context[start + n:start + n + k]", "context[start + n:start + n + k + 1]"),
}


def submission(lab: grade.Lab, solved: set[str], planted: tuple[str, str, str] | None = None) -> nbformat.NotebookNode:
    """labs/<lab>.ipynb with the exercises in ``solved`` filled in from the solution (one maybe wrong)."""
    nb = nbformat.read(LABS / f"{lab.name}.ipynb", as_version=4)
    for cell in nb.cells:
        found = grade.role(cell)
        if found and found[0] == "exercise" and found[1] in solved:
            cell.source = lab.solved[found[1]]
            if planted and planted[0] == found[1]:
                assert planted[1] in cell.source, f"the planted mistake no longer applies to {lab.name}"
                cell.source = cell.source.replace(planted[1], planted[2])
    return nb


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_solved_full_stub_zero_planted_mistake_costs_its_exercise(name: str, tmp_path: Path) -> None:
    lab = grade.load_lab(name, LABS, SOLUTIONS)
    assert sorted(PLANTED) == grade.available_labs(LABS), "every lab needs a planted mistake here"
    every = set(lab.exercises)
    paths = []
    for student, nb in (("solved", submission(lab, every)), ("stub", submission(lab, set())),
                        ("planted", submission(lab, every, PLANTED[name]))):
        paths.append(tmp_path / "class" / student / f"{name}.ipynb")
        paths[-1].parent.mkdir(parents=True)
        nbformat.write(nb, paths[-1])
    graded = {g.student: g for g in grade.grade_class(paths, tmp_path / "grades", LABS, SOLUTIONS,
                                                      grade.Limits(cell_s=900, notebook_s=2400))}
    for g in graded.values():
        print(f"{name} {g.student}: {g.seconds} s; " + ", ".join(
            f"{o.exercise} {o.points}/{o.out_of} {o.verdict}" for o in g.outcomes) + f"; problems {g.problems}")
    full = {o.exercise: o.out_of for o in graded["solved"].outcomes}
    assert all(o.verdict == grade.PASSED and o.points == o.out_of > 0 for o in graded["solved"].outcomes), \
        graded["solved"].outcomes
    assert graded["solved"].problems == []
    assert all(o.points == 0 and o.verdict == grade.NOT_ATTEMPTED for o in graded["stub"].outcomes), \
        graded["stub"].outcomes
    wrong = PLANTED[name][0]
    assert {o.exercise: o.points for o in graded["planted"].outcomes} == {**full, wrong: 0}

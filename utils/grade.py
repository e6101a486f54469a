"""Grading submitted lab notebooks: a gradebook from the labs' own check cells.

    python -m utils.grade "class/*/quantization.ipynb" --out grades     # make grade SUBMISSIONS=...

**What is graded.** The lab generator (``tools/make_labs.py``) marks every lab cell that matters in
its metadata: an *exercise* cell (it held a ``### BEGIN SOLUTION`` region) and its *check* cells (the
cells below it that call a check on what it defines), with nbgrader's standard ``metadata.nbgrader``
beside the workbook's ``metadata.workbook = {"exercise": id, "role": ...}``. Each check cell is worth
one point (``points`` in its nbgrader metadata), so an exercise is worth as many points as it has checks.

**How a submission runs.** Its cells are merged with the reference lab (``labs/<lab>.ipynb``): the
student's cells are kept, except that every check cell is the original one (a check cell edited or
deleted is flagged and restored) and a deleted exercise cell comes back as the stub. The merged copy
runs in a fresh kernel of this interpreter (cwd a temporary folder, ``PYTHONPATH`` the repository, so
``from utils import ...`` works), cell by cell, each cell under a time limit and the whole notebook under
another; a cell that runs over, or a kernel that dies (a crash, an out-of-memory kill), stops this
submission only, and the exercises not reached score zero.

**One mistake costs one exercise.** When an exercise fails its checks, the solved exercise cell
(``solutions/<lab>.ipynb``) is run in its place and its cells up to its last check are run again,
silently, before the notebook goes on: a later exercise is graded on a correct past, so a wrong
answer early does not fail every check after it (nbgrader's autograder does not do this; on a solved
or an untouched stub notebook the two agree). A check of the repaired exercise further down (an
exercise checked in several places) then runs on the solution, not on the student's code: it earns
nothing and takes the exercise's first failed verdict.

**Not gradable here.** A check cell that runs without error but could not decide on this machine:
a timing check :func:`utils.decide.decide` left undecided (read from the ``WORKBOOK_RESULTS`` file
the kernel writes), or a cell that printed :data:`NOT_GRADABLE` (``utils.checks.not_gradable_here``:
needs a GPU, needs trained weights) or ``not decided here:``. Its point is neither won nor lost: it
is left out of what the exercise is graded out of, and the gradebook says so.

**What comes out** (in ``--out``): ``grades.csv`` (student, lab, exercise, points, out_of, verdict,
detail), ``grades.html`` (the class table, and each exercise's pass rate, hardest first),
``feedback/<student>-<lab>.md`` (the check messages, the first error with its cell, the figures the
student's machine recorded with :func:`utils.results.record`), ``executed/`` (each graded copy),
``logs/`` (each kernel's stderr: a crash's last words) and a summary on stdout with one line per problem.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import glob
import html
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import nbformat
from jupyter_client import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from .checks import NOT_GRADABLE
from .models import REPO_ROOT
from .report import _kernel_manager
from .results import ENV_FILE, ENV_NOTEBOOK, read_lines

UNDECIDED_MARKERS = (NOT_GRADABLE, "not decided here:")
"""A check cell whose output has one of these lines is not gradable on this machine."""

CELL_TIMEOUT_S, NOTEBOOK_TIMEOUT_S = 600, 3600
PASSED, FAILED, NOT_GRADABLE_HERE = "passed", "failed", "not gradable here"
NOT_ATTEMPTED, NOT_REACHED, NOT_GRADED = "not attempted", "not reached", "not graded"


@dataclass(frozen=True)
class Lab:
    """A lab as the grader needs it: the reference cells and each exercise's solved source."""

    name: str
    cells: list[Any]
    solved: dict[str, str]
    points: dict[str, int]

    @property
    def exercises(self) -> list[str]:
        """The exercise ids, in the lab's order."""
        return list(self.points)


@dataclass
class Outcome:
    """One exercise's grade: points won, out of the gradable points, a verdict and its messages."""

    exercise: str
    points: int
    out_of: int
    verdict: str
    messages: list[str] = field(default_factory=list)
    not_gradable: int = 0


@dataclass
class Graded:
    """One submission's grades and what the instructor should know about it."""

    student: str
    lab: str
    path: Path
    outcomes: list[Outcome] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    first_error: str | None = None
    figures: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def role(cell: Any) -> tuple[str, str] | None:
    """``(role, exercise)`` from a cell's workbook metadata (nbgrader's grade_id as a fallback)."""
    meta = cell.get("metadata", {})
    mine = meta.get("workbook", {})
    if mine.get("role") in ("exercise", "check") and mine.get("exercise"):
        return mine["role"], mine["exercise"]
    nbg = meta.get("nbgrader", {})
    grade_id = str(nbg.get("grade_id", ""))
    if nbg.get("solution") and grade_id:
        return "exercise", grade_id
    if nbg.get("grade") and "-check-" in grade_id:
        return "check", grade_id.split("-check-")[0]
    return None


def _key(cell: Any) -> str | None:
    """What matches a cell across copies of a lab: its nbgrader grade_id, else its cell id."""
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") or cell.get("id")


def load_lab(name: str, labs_dir: Path, solutions_dir: Path) -> Lab:
    """The lab ``name`` from ``labs_dir`` (generated, with metadata) and ``solutions_dir``."""
    lab = nbformat.read(Path(labs_dir) / f"{name}.ipynb", as_version=4)
    solution = nbformat.read(Path(solutions_dir) / f"{name}.ipynb", as_version=4)
    by_id = {cell.get("id"): cell for cell in solution.cells}
    solved, points = {}, {}
    for cell in lab.cells:
        found = role(cell)
        if found and found[0] == "exercise":
            points.setdefault(found[1], 0)
            solved[found[1]] = by_id[cell.get("id")].source if cell.get("id") in by_id else cell.source
        elif found:
            points[found[1]] = points.get(found[1], 0) + int(cell.metadata.get("nbgrader", {}).get("points", 1))
    return Lab(name, list(lab.cells), solved, points)


def available_labs(labs_dir: Path) -> list[str]:
    """The names of the labs in ``labs_dir``."""
    return sorted(p.stem for p in Path(labs_dir).glob("*.ipynb"))


# ------------------------------------------------------------------------------ who and which lab


def lab_in_name(stem: str, labs: Sequence[str]) -> str | None:
    """The lab a file name names (``quantization``, ``alice_quantization``), if any."""
    words = set(re.split(r"[^a-z0-9]+", stem.lower()))
    return next((lab for lab in sorted(labs, key=len, reverse=True) if lab == stem.lower() or lab in words), None)


def student_name(path: Path, labs: Sequence[str]) -> str:
    """The parent folder (``class/alice/quantization.ipynb``; nbgrader's ``submitted/alice/<lab>/<lab>.ipynb``),
    else the file name less the lab's name (``class/alice_quantization.ipynb``)."""
    lab = lab_in_name(path.stem, labs)
    folder = next((p.name for p in path.parents if p.name.lower() != lab), path.parent.name)
    if lab is None or lab == path.stem.lower():
        return folder if lab else path.stem
    return re.sub(re.escape(lab), "", path.stem, flags=re.I).strip("_-. ") or folder


def lab_of_notebook(nb: Any, labs: dict[str, Lab]) -> str | None:
    """The lab a notebook was made from: its generator metadata, else the most grade ids shared."""
    origin = nb.get("metadata", {}).get("workbook", {}).get("generated_from", "")
    if Path(origin).stem in labs:
        return Path(origin).stem
    ids = {_key(c) for c in nb.cells if role(c)}
    shared = {name: len(ids & {_key(c) for c in lab.cells if role(c)}) for name, lab in labs.items()}
    best = max(shared, key=lambda n: shared[n], default=None)
    return best if best and shared[best] else None


# ------------------------------------------------------------------------------ the graded copy


def merge(submitted: Sequence[Any], lab: Lab) -> tuple[list[Any], list[str]]:
    """The cells to run: the student's, with every check cell the original; the problems found."""
    reference = {_key(c): c for c in lab.cells if role(c)}
    cells, problems, seen = [], [], set()
    for cell in submitted:
        key = _key(cell)
        if key in reference and key not in seen:
            seen.add(key)
            original = reference[key]
            if role(original)[0] == "check" and cell.source.strip() != original.source.strip():
                problems.append(f"check cell {key} was edited: graded with the original check")
            cell = nbformat.from_dict(dict(original) if role(original)[0] == "check"
                                      else {**dict(cell), "metadata": original.metadata})
        else:  # the student's own cell (or a copy of a graded one): it grades nothing
            meta = {k: v for k, v in cell.get("metadata", {}).items() if k not in ("nbgrader", "workbook")}
            cell = nbformat.from_dict({**dict(cell), "metadata": meta})
        cells.append(cell)
    return _restore_missing(cells, lab, seen, problems), problems


def _restore_missing(cells: list[Any], lab: Lab, seen: set[Any], problems: list[str]) -> list[Any]:
    """Put back each exercise or check cell the student deleted, after the cell that preceded it."""
    for index, original in enumerate(lab.cells):
        key = _key(original)
        if not role(original) or key in seen:
            continue
        what = "check" if role(original)[0] == "check" else "exercise"
        problems.append(f"{what} cell {key} was deleted: " + ("restored" if what == "check" else "graded as the stub"))
        before = {_key(c) for c in lab.cells[:index]}
        at = max((i + 1 for i, c in enumerate(cells) if _key(c) in before), default=0)
        cells.insert(at, nbformat.from_dict(dict(original)))
    return cells


# ------------------------------------------------------------------------------ running it


class NotebookTimeout(Exception):
    """The whole notebook ran over its time limit."""


@dataclass
class CellRun:
    """What one cell did on its first run: its error, its printed text, whether it could decide."""

    error: tuple[str, str] | None
    text: str
    undecided: bool
    figures: list[dict[str, Any]]
    on_solution: bool = False  # a check of an exercise already repaired: it ran on the solution, not the student's


@dataclass(frozen=True)
class Limits:
    """Time limits in seconds: one cell, and the whole notebook (repairs included); optionally the
    kernel's address space in GB (past it an allocation raises ``MemoryError`` in the cell, instead of
    the machine's out-of-memory killer choosing what to kill)."""

    cell_s: float = CELL_TIMEOUT_S
    notebook_s: float = NOTEBOOK_TIMEOUT_S
    memory_gb: float | None = None

    def kernel_arguments(self) -> list[str]:
        """ipykernel's command-line arguments: quiet, and the memory limit when there is one."""
        args = ["--IPKernelApp.log_level=ERROR"]
        if self.memory_gb:
            limit = int(self.memory_gb * 2**30)
            args.append(f"--IPKernelApp.exec_lines=['import resource as _r; _r.setrlimit(_r.RLIMIT_AS, ({limit}, {limit}))']")
        return args


def kernel_manager() -> AsyncKernelManager:
    """An *asynchronous* kernel manager for this interpreter's ipykernel (the report's kernel spec): with
    a blocking one, nbclient waits for a busy kernel's output without ever reaching its time limit."""
    return AsyncKernelManager(kernel_name="workbook-current-env",
                              kernel_spec_manager=_kernel_manager().kernel_spec_manager)


def repair_points(cells: Sequence[Any]) -> dict[int, tuple[str, int]]:
    """``{cell index: (exercise, its exercise cell's index)}``: after that cell, a failed exercise is
    repaired (its last check before the next exercise, or the exercise cell itself)."""
    points: dict[int, tuple[str, int]] = {}
    current: tuple[str, int] | None = None
    for index, cell in enumerate(cells):
        found = role(cell)
        if found and found[0] == "exercise":
            current = (found[1], index)
            points[index] = current
        elif found and current and found == ("check", current[0]):
            points = {k: v for k, v in points.items() if v != current}
            points[index] = current
    return points


def _new_lines(results: Path, before: int) -> list[dict[str, Any]]:
    """The results file's JSON lines after the first ``before`` (figures and timing checks)."""
    try:
        return read_lines(results)[before:]
    except Exception:  # a student who wrote garbage into the file loses the figures, nothing else
        return []


def run_cell(client: NotebookClient, cell: Any, index: int, results: Path, deadline: float,
             limits: Limits) -> CellRun:
    """Run one cell under the cell's and the notebook's time limits; what it did."""
    left = deadline - time.monotonic()
    if left <= 1:
        raise NotebookTimeout()
    client.timeout = int(max(1, min(limits.cell_s, left)))
    before = len(_new_lines(results, 0))
    try:
        client.execute_cell(cell, index)
    except CellTimeoutError:
        raise (NotebookTimeout() if left < limits.cell_s else CellTimeoutError(str(index))) from None
    lines = _new_lines(results, before)
    errors = [(o.get("ename", "Error"), o.get("evalue", "")) for o in cell.outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    undecided = any(line.get("kind") == "check" and line.get("outcome") == "undecided" for line in lines) or any(
        line.lstrip().startswith(UNDECIDED_MARKERS) for line in text.splitlines())
    return CellRun(errors[0] if errors else None, text, undecided,
                   [line for line in lines if line.get("kind") == "figure"])


def repair(client: NotebookClient, cells: Sequence[Any], point: tuple[str, int], end: int, lab: Lab,
           results: Path, deadline: float, limits: Limits) -> None:
    """Run the solved exercise in place of the student's, then its cells up to ``end`` again, silently."""
    exercise, start = point
    solved = nbformat.v4.new_code_cell(lab.solved.get(exercise, cells[start].source))
    run_cell(client, solved, start, results, deadline, limits)
    for j in range(start + 1, end + 1):
        if cells[j].cell_type == "code":
            run_cell(client, nbformat.from_dict(dict(cells[j])), j, results, deadline, limits)


def execute(cells: list[Any], lab: Lab, workdir: Path, env: dict[str, str], limits: Limits,
            log: Path) -> tuple[dict[int, CellRun], str | None]:
    """Run the merged cells in a fresh kernel (cwd ``workdir``, its stderr to ``log``); each code cell's
    first run, and why the run stopped early (None if it did not)."""
    nb, km = nbformat.v4.new_notebook(cells=cells), kernel_manager()
    client = NotebookClient(nb, km=km, allow_errors=True, shutdown_kernel="immediate",
                            extra_arguments=limits.kernel_arguments(),
                            resources={"metadata": {"path": str(workdir)}})
    results, runs, failed, repaired = Path(env[ENV_FILE]), {}, set(), set()
    points, deadline, index, stop = repair_points(cells), time.monotonic() + limits.notebook_s, -1, None
    try:
        with open(log, "w", encoding="utf8") as stderr, client.setup_kernel(env=env, stderr=stderr):
            for index, cell in enumerate(cells):
                if cell.cell_type != "code":
                    continue
                runs[index] = run_cell(client, cell, index, results, deadline, limits)
                if (found := role(cell)) and found[1] in repaired:
                    runs[index] = dataclasses.replace(runs[index], on_solution=True)
                elif found and runs[index].error:
                    failed.add(found[1])
                if index in points and points[index][0] in failed - repaired:
                    repair(client, cells, points[index], index, lab, results, deadline, limits)
                    repaired.add(points[index][0])
    except NotebookTimeout:
        stop = f"the notebook ran over its time limit ({limits.notebook_s:g} s) at cell {index}"
    except CellTimeoutError:
        stop = f"cell {index} ran over the time limit ({limits.cell_s:g} s; an endless loop?): the kernel was stopped"
    except DeadKernelError:
        stop = f"the kernel died in cell {index} (a crash, or out of memory)"
    except Exception as err:  # the kernel would not start, or would not stop: this submission only
        stop = f"the run stopped at cell {index}: {type(err).__name__}: {err}"
    finally:
        stop_kernel(km)
    if stop and index >= 0 and index not in runs:  # the cell that stopped the run failed; the rest not reached
        runs[index] = CellRun(("Stopped", stop), "", False, [])
    return runs, stop


def stop_kernel(km: AsyncKernelManager) -> None:
    """Kill the kernel now (nbclient leaves a kernel it did not create running, even a looping one)."""
    try:
        if run_sync(km.is_alive)():
            run_sync(km.shutdown_kernel)(now=True)
    except Exception:  # already gone
        pass


# ------------------------------------------------------------------------------ scoring


def _first_line(text: str) -> str:
    """The first non-blank line of ``text``, cut to 300 characters."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")[:300]


def check_verdict(run: CellRun | None) -> tuple[str, str]:
    """One check cell's verdict and its message."""
    if run is None:
        return NOT_REACHED, "the run stopped before this check"
    if run.error:
        ename, evalue = run.error
        verdict = NOT_ATTEMPTED if ename == "NotImplementedError" else FAILED
        if evalue.startswith("✗"):  # a check's own verdict says it all
            return verdict, _first_line(evalue)
        return verdict, f"{ename}: {_first_line(evalue)}" if _first_line(evalue) else ename
    if run.undecided:
        marks = [line.strip() for line in run.text.splitlines() if line.lstrip().startswith(UNDECIDED_MARKERS)]
        return NOT_GRADABLE_HERE, "; ".join(marks) or "a timing check was not decided here"
    return PASSED, "; ".join(line.strip() for line in run.text.splitlines() if line.startswith("✓"))


def score(cells: Sequence[Any], runs: dict[int, CellRun], lab: Lab) -> list[Outcome]:
    """Each exercise's outcome from its check cells' runs (see the module doc for the rules)."""
    outcomes = []
    for exercise in lab.exercises:
        won = out_of = 0
        verdicts, messages = [], []
        for index, cell in enumerate(cells):
            if role(cell) != ("check", exercise):
                continue
            points = int(cell.metadata.get("nbgrader", {}).get("points", 1))
            verdict, message = check_verdict(runs.get(index))
            if (run := runs.get(index)) is not None and run.on_solution:  # nothing of the student's was checked
                verdict = next((v for v in verdicts if v in (NOT_ATTEMPTED, FAILED)), FAILED)
                message = f"cell {index}: ran on the solution (this exercise was repaired after its failed check): no point"
            verdicts.append(verdict)
            messages += [message] if message else []
            out_of += 0 if verdict == NOT_GRADABLE_HERE else points
            won += points if verdict == PASSED else 0
        order = (NOT_ATTEMPTED, FAILED, NOT_REACHED, PASSED, NOT_GRADABLE_HERE)
        verdict = next((v for v in order if v in verdicts), NOT_GRADED)
        if verdict == PASSED and NOT_GRADABLE_HERE in verdicts:
            messages.append(f"{verdicts.count(NOT_GRADABLE_HERE)} of {len(verdicts)} checks not gradable here")
        outcomes.append(Outcome(exercise, won, out_of, verdict, messages, verdicts.count(NOT_GRADABLE_HERE)))
    return outcomes


def zero(lab: Lab, verdict: str, message: str) -> list[Outcome]:
    """Every exercise of ``lab`` at zero (a submission that could not be run)."""
    return [Outcome(exercise, 0, points, verdict, [message]) for exercise, points in lab.points.items()]


def _first_error(cells: Sequence[Any], runs: dict[int, CellRun]) -> str | None:
    """The first error of the run, with its cell's number and first line."""
    for index, run in sorted(runs.items()):
        if run.error:
            return f"cell {index} ({_first_line(cells[index].source)!r}): {run.error[0]}: {_first_line(run.error[1])}"
    return None


def _missing_modules(runs: dict[int, CellRun]) -> list[str]:
    """The modules a cell failed to import (``ModuleNotFoundError``), each once."""
    names = [re.findall(r"No module named '([^']+)'", run.error[1]) for run in runs.values()
             if run.error and run.error[0] == "ModuleNotFoundError"]
    return sorted({n[0] for n in names if n})


# ------------------------------------------------------------------------------ one submission


def kernel_env(results: Path, lab: str) -> dict[str, str]:
    """The kernel's environment: this one, the repository on ``PYTHONPATH``, the results file."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, ENV_FILE: str(results), ENV_NOTEBOOK: lab, "MPLBACKEND": "Agg"}


def run_submission(graded: Graded, nb: Any, lab: Lab, out: Path, limits: Limits) -> None:
    """Merge, run and score one readable notebook of the right lab, into ``graded``."""
    cells, problems = merge(nb.cells, lab)
    graded.problems += problems
    workdir = Path(tempfile.mkdtemp(prefix=f"grade-{graded.student}-"))
    try:
        results = workdir / "results.jsonl"
        log = out / "logs" / f"{graded.student}-{lab.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        runs, stop = execute(cells, lab, workdir, kernel_env(results, lab.name), limits, log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    graded.problems += [stop] if stop else []
    graded.problems += [f"imports {m}, a module the course does not ship" for m in _missing_modules(runs)]
    graded.problems += [f"ran out of memory in cell {i}" for i, run in sorted(runs.items())
                        if run.error and run.error[0] == "MemoryError"]
    graded.outcomes = score(cells, runs, lab)
    graded.first_error = _first_error(cells, runs)
    graded.figures = [f for run in runs.values() for f in run.figures]
    executed = out / "executed" / f"{graded.student}-{lab.name}.ipynb"
    executed.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata=nb.metadata), executed)


def grade_one(path: Path, labs: dict[str, Lab], out: Path, limits: Limits, lab_hint: str | None = None) -> Graded:
    """Grade one file; whatever is wrong with it becomes a problem line, never an exception."""
    start = time.monotonic()
    expected = lab_in_name(path.stem, list(labs)) or lab_hint
    graded = Graded(student_name(path, list(labs)), expected or "?", path)
    try:
        nb = nbformat.read(path, as_version=4)
        if not isinstance(nb.get("cells"), list):
            raise ValueError("it has no cells")
    except Exception as err:
        graded.problems.append(f"not a notebook ({type(err).__name__}: {_first_line(err)})")
        graded.outcomes = zero(labs[expected], NOT_GRADED, "not a notebook") if expected in labs else []
        return graded
    actual = lab_of_notebook(nb, labs)
    origin = Path(nb.get("metadata", {}).get("workbook", {}).get("generated_from", "")).stem
    actual = actual if not origin or origin in labs else origin  # a lab this course does not have
    graded.lab = expected = expected or actual or "?"
    if expected not in labs:
        graded.problems.append(f"not a notebook of any lab ({', '.join(labs)})")
    elif actual and actual != expected:
        graded.problems.append(f"a notebook of the {actual} lab, handed in as {expected}: not graded")
        graded.outcomes = zero(labs[expected], NOT_GRADED, f"the {actual} lab was handed in")
    else:
        try:
            run_submission(graded, nb, labs[expected], out, limits)
        except Exception as err:  # the grader's own failure: named, and the class goes on
            graded.problems.append(f"could not be graded: {type(err).__name__}: {_first_line(err)}")
            graded.outcomes = zero(labs[expected], NOT_GRADED, "could not be graded")
    graded.seconds = round(time.monotonic() - start, 1)
    return graded


# ------------------------------------------------------------------------------ the gradebook


def write_csv(class_: Sequence[Graded], path: Path) -> Path:
    """``grades.csv``: one row per student, lab and exercise (a row with exercise ``-`` when none)."""
    with open(path, "w", newline="", encoding="utf8") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "lab", "exercise", "points", "out_of", "verdict", "detail"])
        for g in class_:
            for o in g.outcomes or [Outcome("-", 0, 0, NOT_GRADED, g.problems[:1])]:
                writer.writerow([g.student, g.lab, o.exercise, o.points, o.out_of, o.verdict, " | ".join(o.messages)])
    return path


def pass_rates(class_: Sequence[Graded]) -> list[tuple[str, str, float, int]]:
    """``(lab, exercise, pass rate, students graded)`` per exercise, the hardest first (not gradable
    and not graded outcomes left out of the rate)."""
    tally: dict[tuple[str, str], list[bool]] = {}
    for g in class_:
        for o in g.outcomes:
            if o.verdict not in (NOT_GRADABLE_HERE, NOT_GRADED):
                tally.setdefault((g.lab, o.exercise), []).append(o.verdict == PASSED and o.points == o.out_of)
    rows = [(lab, ex, sum(v) / len(v), len(v)) for (lab, ex), v in tally.items()]
    return sorted(rows, key=lambda r: (r[2], r[0], r[1]))


def _cell(o: Outcome) -> str:
    """One gradebook cell: points out of, and the verdict unless passed."""
    note = "" if o.verdict == PASSED else f"<br><small>{html.escape(o.verdict)}</small>"
    if o.not_gradable and o.verdict != NOT_GRADABLE_HERE:
        note += f"<br><small>+{o.not_gradable} not gradable here</small>"
    return f"<td class='{o.verdict.replace(' ', '-')}'>{o.points}/{o.out_of}{note}</td>"


def write_html(class_: Sequence[Graded], path: Path) -> Path:
    """``grades.html``: the class table per lab, pass rates (hardest first), and the problems."""
    esc, parts = html.escape, ["<h1>Gradebook</h1>"]
    for lab in sorted({g.lab for g in class_}):
        graded = [g for g in class_ if g.lab == lab]
        exercises = list(dict.fromkeys(o.exercise for g in graded for o in g.outcomes))
        head = "".join(f"<th>{esc(e)}</th>" for e in exercises)
        rows = "".join(
            f"<tr><td>{esc(g.student)}</td>" + "".join(
                next((_cell(o) for o in g.outcomes if o.exercise == e), "<td>-</td>") for e in exercises)
            + f"<td>{sum(o.points for o in g.outcomes)}/{sum(o.out_of for o in g.outcomes)}</td></tr>"
            for g in sorted(graded, key=lambda g: g.student))
        parts.append(f"<h2>{esc(lab)}</h2><table><tr><th>student</th>{head}<th>total</th></tr>{rows}</table>")
    rates = "".join(f"<tr><td>{esc(lab)}</td><td>{esc(ex)}</td><td>{rate:.0%}</td><td>{n}</td></tr>"
                    for lab, ex, rate, n in pass_rates(class_))
    parts.append("<h2>Pass rate per exercise, hardest first</h2><table><tr><th>lab</th><th>exercise</th>"
                 f"<th>passed</th><th>students</th></tr>{rates}</table>")
    problems = "".join(f"<li>{esc(g.student)} ({esc(g.lab)}): {esc(p)}</li>" for g in class_ for p in g.problems)
    parts.append(f"<h2>Problems</h2><ul>{problems or '<li>none</li>'}</ul>")
    style = ("<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
             "padding:3px 8px}.failed,.not-attempted,.not-reached{background:#fdd}.not-gradable-here"
             "{background:#eee}</style>")
    path.write_text(f"<!doctype html><meta charset='utf-8'><title>Gradebook</title>{style}{''.join(parts)}",
                    encoding="utf8")
    return path


def feedback(g: Graded) -> str:
    """One student's feedback for one lab, as Markdown."""
    lines = [f"# {g.lab}: feedback for {g.student}", "",
             f"Total: {sum(o.points for o in g.outcomes)} of {sum(o.out_of for o in g.outcomes)} points.", ""]
    for o in g.outcomes:
        lines.append(f"- **{o.exercise}**: {o.points}/{o.out_of}, {o.verdict}")
        lines += [f"    - {m}" for m in o.messages]
    if g.problems:
        lines += ["", "## Problems", *[f"- {p}" for p in g.problems]]
    if g.first_error:
        lines += ["", "## The first error", "", g.first_error]
    if g.figures:
        lines += ["", "## Your machine's figures", "", "| figure | value | unit | where |", "|---|---|---|---|"]
        lines += [f"| {f['name']} | {f['value']:.4g} | {f['unit']} | "
                  f"{', '.join(f'{k}={v}' for k, v in f.get('context', {}).items())} |" for f in g.figures]
    return "\n".join(lines) + "\n"


def write_gradebook(class_: Sequence[Graded], out: Path) -> list[Path]:
    """Write grades.csv, grades.html and feedback/<student>-<lab>.md into ``out``; the paths."""
    (out / "feedback").mkdir(parents=True, exist_ok=True)
    paths = [write_csv(class_, out / "grades.csv"), write_html(class_, out / "grades.html")]
    for g in class_:
        path = out / "feedback" / f"{g.student}-{g.lab}.md"
        path.write_text(feedback(g), encoding="utf8")
        paths.append(path)
    return paths


def summary(class_: Sequence[Graded]) -> str:
    """One line per submission, then one line per problem."""
    lines = [f"{g.student:<16} {g.lab:<14} {sum(o.points for o in g.outcomes):>3}/{sum(o.out_of for o in g.outcomes):<3}"
             f" {g.seconds:>6.1f} s  {g.path}" for g in class_]
    problems = [f"  {g.student} ({g.lab}): {p}" for g in class_ for p in g.problems]
    return "\n".join(lines + [f"{len(problems)} problem(s)" + (":" if problems else ".")] + problems)


# ------------------------------------------------------------------------------ the command line


def expand(patterns: Sequence[str]) -> list[Path]:
    """The files the patterns name (globs expanded here too, for a quoted pattern), sorted, once each."""
    found = [Path(p) for pattern in patterns for p in (sorted(glob.glob(pattern)) or [pattern])]
    return sorted(dict.fromkeys(p for p in found if p.is_file()))


def grade_class(paths: Sequence[Path], out: Path, labs_dir: Path = REPO_ROOT / "labs",
                solutions_dir: Path = REPO_ROOT / "solutions", limits: Limits = Limits(),
                lab: str | None = None) -> list[Graded]:
    """Grade every file, one at a time (one progress line each), and write the gradebook."""
    labs = {name: load_lab(name, labs_dir, solutions_dir) for name in available_labs(labs_dir)}
    out.mkdir(parents=True, exist_ok=True)
    class_ = []
    for i, path in enumerate(paths, 1):
        print(f"[{i}/{len(paths)}] {path} ...", end=" ", flush=True)
        class_.append(grade_one(path, labs, out, limits, lab))
        g = class_[-1]
        print(f"{g.student}: {sum(o.points for o in g.outcomes)}/{sum(o.out_of for o in g.outcomes)} "
              f"({g.seconds} s, {len(g.problems)} problem(s))", flush=True)
    write_gradebook(class_, out)
    return class_


def main(argv: list[str] | None = None) -> int:
    """``python -m utils.grade SUBMISSION...``; exit status 1 only when nothing was found to grade."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("submissions", nargs="+", help="notebook files or glob patterns")
    p.add_argument("--out", type=Path, default=Path("grades"), help="where the gradebook goes (default grades/)")
    p.add_argument("--lab", help="the lab, when the file names do not say it")
    p.add_argument("--labs", type=Path, default=REPO_ROOT / "labs")
    p.add_argument("--solutions", type=Path, default=REPO_ROOT / "solutions")
    p.add_argument("--cell-timeout", type=float, default=CELL_TIMEOUT_S, help="seconds per cell")
    p.add_argument("--notebook-timeout", type=float, default=NOTEBOOK_TIMEOUT_S, help="seconds per notebook")
    p.add_argument("--memory-gb", type=float, help="cap each kernel's address space (MemoryError past it)")
    a = p.parse_args(argv)
    paths = expand(a.submissions)
    if not paths:
        print(f"nothing to grade: no file matches {' '.join(a.submissions)}")
        return 1
    class_ = grade_class(paths, a.out, a.labs, a.solutions, Limits(a.cell_timeout, a.notebook_timeout, a.memory_gb), a.lab)
    print(summary(class_))
    print(f"gradebook: {a.out / 'grades.html'}, {a.out / 'grades.csv'}, feedback in {a.out / 'feedback'}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

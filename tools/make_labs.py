"""Generate the exercise notebooks in ``labs/`` from the solved ones in ``solutions/``.

Run from the repository root::

    python -m tools.make_labs           # (re)write labs/<name>.ipynb for every solutions/<name>.ipynb
    python -m tools.make_labs --check   # write nothing; exit 1 and list what differs if labs/ is stale
    python -m tools.make_labs --nbgrader COURSE   # an nbgrader course's source/ notebooks

Only ``solutions/`` is edited by hand; ``labs/`` is always regenerated.

Conventions, in the solved notebook
-----------------------------------
Code cells
    The lines from ``### BEGIN SOLUTION`` to ``### END SOLUTION`` (markers included)
    become a stub, indented like the ``### BEGIN SOLUTION`` line::

        # YOUR CODE HERE
        raise NotImplementedError("Exercise: <what>")

    ``<what>`` is the text after the marker if there is one
    (``### BEGIN SOLUTION quantize int8``), else ``complete <name>()`` when the
    region sits inside ``def <name>(``, else ``fill in this cell``. A cell may hold
    several regions. Code outside the regions is kept as it is, so a function's
    signature and docstring stay visible and the check cell below it is unchanged.

Markdown cells (written answers)
    The lines from ``<!-- BEGIN SOLUTION -->`` to ``<!-- END SOLUTION -->`` become
    ``*Your answer here.*``.

Hidden cells
    A cell whose first line is ``### HIDE`` (code) or ``<!-- HIDE -->`` (markdown),
    or that carries the metadata tag ``hide-in-lab``, is dropped from the lab:
    use it for what only makes sense once solved (e.g. an assert that the solution's
    numbers are right). The marker stays visible in the solution.

Grading metadata (nbgrader-compatible)
    A code cell with a solution region is an **exercise**; its id is the first name it
    defines (``def int8_scales`` -> ``int8_scales``). A later code cell that calls a check
    (``check_*(...)``, ``decide(...)``) and mentions a name an exercise above it defines is a
    **check cell** of the nearest such exercise; checks before the first exercise, or on
    nothing the learner wrote, are the lab's own and are not graded. Each lab cell gets
    ``metadata.nbgrader`` (schema 3: exercises are solution cells, check cells are locked
    autograded cells worth :data:`POINTS_PER_CHECK` point each, so an exercise is worth as
    many points as it has check cells) and ``metadata.workbook`` (``{"exercise": id, "role":
    "exercise" | "check"}``), which :mod:`utils.grade` reads. ``--nbgrader DIR`` writes an
    nbgrader course's ``source/<lab>/<lab>.ipynb`` (the solved cells with the same metadata,
    written answers stubbed, hidden cells dropped) for ``nbgrader generate_assignment``.

Everything else
    Outputs, execution counts and per-cell ``execution`` timing metadata are stripped;
    cell ids, tags and notebook metadata are kept, and the notebook metadata records
    where the lab came from. Files are written exactly as ``nbformat.write`` writes
    them, so ``--check`` compares text byte for byte.

A marker left open (BEGIN without END, or END without BEGIN) is an error that names
the notebook and the cell.
"""

from __future__ import annotations

import argparse
import difflib
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

import nbformat

REPO_ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS_DIR = REPO_ROOT / "solutions"
LABS_DIR = REPO_ROOT / "labs"

CODE_BEGIN = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION\b(?P<what>.*)$")
CODE_END = re.compile(r"^[ \t]*### END SOLUTION\b")
MD_BEGIN = re.compile(r"^\s*<!--\s*BEGIN SOLUTION\s*-->")
MD_END = re.compile(r"^\s*<!--\s*END SOLUTION\s*-->")
DEF_LINE = re.compile(r"^(?P<indent>[ \t]*)(?:async\s+)?def\s+(?P<name>\w+)\s*\(")
CHECK_CALL = re.compile(r"\b(?:check_\w+|decide|decide_ratio)\s*\(")
DEFINED = re.compile(r"^(?:(?:async\s+)?def\s+(\w+)|class\s+(\w+)|([A-Za-z_]\w*)\s*(?::[^=\n]*)?=(?!=))", re.M)
HIDE_TAG = "hide-in-lab"
POINTS_PER_CHECK = 1
NBGRADER_SCHEMA = 3
MD_STUB = "*Your answer here.*"


class MarkerError(ValueError):
    """A solution marker without its partner."""


def _enclosing_function(lines: list[str], indent: str) -> str | None:
    """Name of the nearest ``def`` above, indented less than ``indent``, if any."""
    for line in reversed(lines):
        found = DEF_LINE.match(line)
        if found and len(found["indent"]) < len(indent):
            return found["name"]
    return None


def _code_stub(indent: str, what: str) -> list[str]:
    """The two stub lines that replace a code solution region."""
    message = "Exercise: " + what.replace("\\", "\\\\").replace('"', '\\"')
    return [f"{indent}# YOUR CODE HERE", f'{indent}raise NotImplementedError("{message}")']


def strip_code_solution(source: str) -> str:
    """Replace every ``### BEGIN/END SOLUTION`` region of a code cell by a stub."""
    out: list[str] = []
    begin: re.Match[str] | None = None
    for number, line in enumerate(source.split("\n"), start=1):
        if begin is None:
            begin = CODE_BEGIN.match(line)
            if begin is None:
                if CODE_END.match(line):
                    raise MarkerError(f"line {number}: ### END SOLUTION without ### BEGIN SOLUTION")
                out.append(line)
        elif CODE_BEGIN.match(line):
            raise MarkerError(f"line {number}: ### BEGIN SOLUTION inside another solution region")
        elif CODE_END.match(line):
            what = begin["what"].strip(" :-") or (
                f"complete {name}()" if (name := _enclosing_function(out, begin["indent"]))
                else "fill in this cell")
            out.extend(_code_stub(begin["indent"], what))
            begin = None
    if begin is not None:
        raise MarkerError("### BEGIN SOLUTION without ### END SOLUTION")
    return "\n".join(out)


def strip_markdown_solution(source: str) -> str:
    """Replace every ``<!-- BEGIN/END SOLUTION -->`` region of a markdown cell by a stub."""
    out: list[str] = []
    inside = False
    for number, line in enumerate(source.split("\n"), start=1):
        if MD_BEGIN.match(line):
            if inside:
                raise MarkerError(f"line {number}: BEGIN SOLUTION inside another solution region")
            inside = True
        elif MD_END.match(line):
            if not inside:
                raise MarkerError(f"line {number}: END SOLUTION without BEGIN SOLUTION")
            out.append(MD_STUB)
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise MarkerError("<!-- BEGIN SOLUTION --> without <!-- END SOLUTION -->")
    return "\n".join(out)


def is_hidden(cell: nbformat.NotebookNode) -> bool:
    """True for a cell that exists only in the solution (``### HIDE``, ``<!-- HIDE -->``, tag)."""
    if HIDE_TAG in cell.get("metadata", {}).get("tags", []):
        return True
    first = cell.source.lstrip("\n").split("\n", 1)[0].strip()
    if cell.cell_type == "code":
        return first.startswith("### HIDE")
    return cell.cell_type == "markdown" and re.fullmatch(r"<!--\s*HIDE\s*-->", first) is not None


def lab_cell(cell: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The lab version of one (visible) solution cell: solutions stubbed, outputs stripped."""
    new = nbformat.from_dict(dict(cell))
    new.metadata = nbformat.from_dict(
        {k: v for k, v in cell.get("metadata", {}).items() if k != "execution"})
    if cell.cell_type == "code":
        new.source = strip_code_solution(cell.source)
        new.outputs = []
        new.execution_count = None
    elif cell.cell_type == "markdown":
        new.source = strip_markdown_solution(cell.source)
    return new


def has_solution(cell: nbformat.NotebookNode) -> bool:
    """True for a code cell with a ``### BEGIN SOLUTION`` region: an exercise."""
    return cell.cell_type == "code" and any(CODE_BEGIN.match(line) for line in cell.source.split("\n"))


def defined_names(source: str) -> list[str]:
    """Names a cell defines at its top level (``def``, ``class``, ``name =``), in order, once each."""
    names = [next(g for g in found.groups() if g) for found in DEFINED.finditer(source)]
    return list(dict.fromkeys(names))


def code_names(source: str) -> set[str]:
    """The names a cell's code uses, not counting comments and strings (IPython magics are skipped)."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n"))
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return set(re.findall(r"\b[A-Za-z_]\w*\b", re.sub(r"#.*", "", code)))
    return {tok.string for prev, tok in zip([None, *tokens], tokens)
            if tok.type == tokenize.NAME and not (prev and prev.string == ".")}


def _mentions(source: str, names: set[str]) -> bool:
    """True when the cell's code uses one of ``names``."""
    return bool(code_names(source) & names)


def grading_plan(cells: list[nbformat.NotebookNode]) -> dict[int, dict[str, Any]]:
    """``{cell index: {"exercise": id, "role": "exercise" | "check"[, "check": n]}}`` (module doc)."""
    plan: dict[int, dict[str, Any]] = {}
    exercises: list[tuple[str, set[str]]] = []
    checks: dict[str, int] = {}
    for index, cell in enumerate(cells):
        if cell.cell_type != "code" or is_hidden(cell):
            continue
        if has_solution(cell):
            names = defined_names(cell.source)
            exercise = names[0] if names else f"exercise_{len(exercises) + 1}"
            while exercise in checks:
                exercise += "_"
            exercises.append((exercise, set(names)))
            checks[exercise] = 0
            plan[index] = {"exercise": exercise, "role": "exercise"}
        elif CHECK_CALL.search(cell.source):
            owner = next((ex for ex, names in reversed(exercises) if _mentions(cell.source, names)), None)
            if owner is not None:
                checks[owner] += 1
                plan[index] = {"exercise": owner, "role": "check", "check": checks[owner]}
    return plan


def nbgrader_metadata(entry: dict[str, Any]) -> dict[str, Any]:
    """nbgrader's cell metadata (schema 3) for one :func:`grading_plan` entry."""
    if entry["role"] == "exercise":
        return {"grade": False, "grade_id": entry["exercise"], "locked": False,
                "schema_version": NBGRADER_SCHEMA, "solution": True, "task": False}
    return {"grade": True, "grade_id": f"{entry['exercise']}-check-{entry['check']}", "locked": True,
            "points": POINTS_PER_CHECK, "schema_version": NBGRADER_SCHEMA, "solution": False, "task": False}


def make_lab(solution: nbformat.NotebookNode, origin: str = "") -> nbformat.NotebookNode:
    """The lab notebook made from a solved one (the input is not modified)."""
    lab = nbformat.from_dict(dict(solution))
    plan = grading_plan(solution.cells)
    cells = []
    for index, cell in enumerate(solution.cells):
        if is_hidden(cell):
            continue
        try:
            cells.append(lab_cell(cell))
        except MarkerError as exc:
            raise MarkerError(f"{origin or 'notebook'}, cell {index}: {exc}") from None
        if index in plan:
            cells[-1].metadata["nbgrader"] = nbgrader_metadata(plan[index])
            cells[-1].metadata["workbook"] = dict(plan[index])
    lab.cells = cells
    lab.metadata = nbformat.from_dict(dict(solution.metadata))
    if origin:
        lab.metadata["workbook"] = {
            "generated_from": origin,
            "generator": "python -m tools.make_labs (edit the solution, not this file)",
        }
    return lab


def nbgrader_source(solution: nbformat.NotebookNode, origin: str = "") -> nbformat.NotebookNode:
    """The lab with its exercise cells solved again: an nbgrader course's ``source/`` notebook.

    ``nbgrader generate_assignment`` turns it back into the lab (it clears the same ``### BEGIN
    SOLUTION`` regions); written answers stay stubbed, hidden cells stay out.
    """
    source = make_lab(solution, origin)
    visible = [cell for cell in solution.cells if not is_hidden(cell)]
    for cell, solved in zip(source.cells, visible):
        if cell.metadata.get("workbook", {}).get("role") == "exercise":
            cell.source = solved.source
    return source


def write_nbgrader_course(course: Path, solutions_dir: Path = SOLUTIONS_DIR) -> list[Path]:
    """Write ``course/source/<lab>/<lab>.ipynb`` for every solved lab; the paths written."""
    written = []
    for path in sorted(Path(solutions_dir).glob("*.ipynb")):
        target = Path(course) / "source" / path.stem / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nbgrader_source(nbformat.read(path, as_version=4), f"solutions/{path.name}"), target)
        written.append(target)
    return written


def render_lab(solution_path: Path, origin: str | None = None) -> str:
    """The exact text of the lab for ``solution_path`` (as ``nbformat.write`` writes it)."""
    solution = nbformat.read(solution_path, as_version=4)
    text = nbformat.writes(make_lab(solution, origin or f"solutions/{solution_path.name}"))
    return text if text.endswith("\n") else text + "\n"


def expected_labs(solutions_dir: Path = SOLUTIONS_DIR, labs_dir: Path = LABS_DIR) -> dict[Path, str]:
    """Every lab path the solutions call for, with the text it must have."""
    return {labs_dir / path.name: render_lab(path)
            for path in sorted(Path(solutions_dir).glob("*.ipynb"))}


def write_labs(solutions_dir: Path = SOLUTIONS_DIR, labs_dir: Path = LABS_DIR) -> list[Path]:
    """Write every lab whose text changed; return the paths written."""
    written = []
    for path, text in expected_labs(solutions_dir, labs_dir).items():
        if not path.exists() or path.read_text(encoding="utf8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf8")
            written.append(path)
    return written


def _short_diff(path: Path, old: str, new: str, max_lines: int = 40) -> str:
    """A unified diff of an out-of-date lab, cut to ``max_lines`` lines."""
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), f"{path} (on disk)",
                                      f"{path} (from solutions)", lineterm="", n=1))
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more diff lines)"]
    return "\n".join(lines)


def check_labs(solutions_dir: Path = SOLUTIONS_DIR, labs_dir: Path = LABS_DIR) -> list[str]:
    """What differs between ``labs_dir`` and what the solutions generate (empty: in sync)."""
    expected = expected_labs(solutions_dir, labs_dir)
    problems = []
    for path, text in expected.items():
        if not path.exists():
            problems.append(f"missing: {path}")
        elif (old := path.read_text(encoding="utf8")) != text:
            problems.append(f"out of date: {path}\n{_short_diff(path, old, text)}")
    for path in sorted(Path(labs_dir).glob("*.ipynb")):
        if path not in expected:
            problems.append(f"no solution for: {path} (delete it, or add solutions/{path.name})")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if labs/ differs from what solutions/ generates")
    parser.add_argument("--solutions", type=Path, default=SOLUTIONS_DIR)
    parser.add_argument("--labs", type=Path, default=LABS_DIR)
    parser.add_argument("--nbgrader", type=Path, metavar="COURSE",
                        help="write COURSE/source/<lab>/<lab>.ipynb for nbgrader generate_assignment")
    args = parser.parse_args(argv)
    if args.nbgrader:
        for path in write_nbgrader_course(args.nbgrader, args.solutions):
            print(f"wrote {path}")
        return 0
    if args.check:
        problems = check_labs(args.solutions, args.labs)
        for problem in problems:
            print(problem)
        print(f"labs/ is {'OUT OF SYNC' if problems else 'in sync'} with solutions/"
              + (": run `python -m tools.make_labs`" if problems else "."))
        return 1 if problems else 0
    written = write_labs(args.solutions, args.labs)
    for path in written:
        print(f"wrote {path}")
    total = len(list(Path(args.solutions).glob("*.ipynb")))
    print(f"{len(written)} lab(s) written, {total - len(written)} unchanged.")
    for problem in check_labs(args.solutions, args.labs):
        print(f"warning: {problem}")  # only orphans can remain after writing
    return 0


if __name__ == "__main__":
    sys.exit(main())

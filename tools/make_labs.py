"""Generate the exercise notebooks in ``labs/`` from the solved ones in ``solutions/``.

Run from the repository root::

    python -m tools.make_labs           # (re)write labs/<name>.ipynb for every solutions/<name>.ipynb
    python -m tools.make_labs --check   # write nothing; exit 1 and list what differs if labs/ is stale

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
import re
import sys
from pathlib import Path

import nbformat

REPO_ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS_DIR = REPO_ROOT / "solutions"
LABS_DIR = REPO_ROOT / "labs"

CODE_BEGIN = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION\b(?P<what>.*)$")
CODE_END = re.compile(r"^[ \t]*### END SOLUTION\b")
MD_BEGIN = re.compile(r"^\s*<!--\s*BEGIN SOLUTION\s*-->")
MD_END = re.compile(r"^\s*<!--\s*END SOLUTION\s*-->")
DEF_LINE = re.compile(r"^(?P<indent>[ \t]*)(?:async\s+)?def\s+(?P<name>\w+)\s*\(")
HIDE_TAG = "hide-in-lab"
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


def make_lab(solution: nbformat.NotebookNode, origin: str = "") -> nbformat.NotebookNode:
    """The lab notebook made from a solved one (the input is not modified)."""
    lab = nbformat.from_dict(dict(solution))
    cells = []
    for index, cell in enumerate(solution.cells):
        if is_hidden(cell):
            continue
        try:
            cells.append(lab_cell(cell))
        except MarkerError as exc:
            raise MarkerError(f"{origin or 'notebook'}, cell {index}: {exc}") from None
    lab.cells = cells
    lab.metadata = nbformat.from_dict(dict(solution.metadata))
    if origin:
        lab.metadata["workbook"] = {
            "generated_from": origin,
            "generator": "python -m tools.make_labs (edit the solution, not this file)",
        }
    return lab


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
    args = parser.parse_args(argv)
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

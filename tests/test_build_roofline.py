"""solutions/roofline.ipynb is what tools/build_roofline.py writes (edit the builder, not the notebook)."""

from __future__ import annotations

from pathlib import Path

import nbformat

from tools import build_roofline

ROOT = Path(__file__).resolve().parent.parent


def test_the_solved_roofline_lab_is_the_builders_output():
    committed = nbformat.read(ROOT / "solutions" / "roofline.ipynb", as_version=4)
    built = build_roofline.build()
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells], \
        "solutions/roofline.ipynb differs from tools/build_roofline.py: run python -m tools.build_roofline"

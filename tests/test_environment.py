"""environment.yml mirrors the pins in pyproject.toml (one source of truth)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_environment_yml_mirrors_pyproject_pins():
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = re.findall(r"^\s+-\s+(\S+==\S+)\s*$", (ROOT / "environment.yml").read_text(), re.M)
    assert sorted(env) == sorted(pins)
    assert all("==" in p for p in pins), "every dependency is pinned exactly"

"""environment.yml mirrors the pins in pyproject.toml (one source of truth); inductor's cache lives in the environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_environment_yml_mirrors_pyproject_pins():
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = re.findall(r"^\s+-\s+(\S+==\S+)\s*$", (ROOT / "environment.yml").read_text(), re.M)
    assert sorted(env) == sorted(pins)
    assert all("==" in p for p in pins), "every dependency is pinned exactly"


def _inductor_cache_dir(**env: str) -> str:
    """TORCHINDUCTOR_CACHE_DIR as a fresh interpreter of this environment sees it after ``import utils``."""
    environ = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | env
    code = "import os, utils; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR', ''))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_inductor_keeps_its_cache_inside_this_environment_unless_told_otherwise(tmp_path):
    assert sys.prefix != sys.base_prefix, "the tests run in the workbook's virtual environment"
    assert _inductor_cache_dir() == os.path.join(sys.prefix, "torchinductor-cache")
    assert _inductor_cache_dir(TORCHINDUCTOR_CACHE_DIR=str(tmp_path)) == str(tmp_path)

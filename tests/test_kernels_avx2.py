"""The workbook's CPU kernels as built for a laptop with AVX2 only pass the same tests as this CPU's build.

The kernels (``utils/csrc/``) have a branch per instruction set: AVX-512 (and AMX) on the machines CI runs on,
AVX2 + FMA + F16C on most laptops. The other unit tests run this CPU's build; here the kernel tests run again
in a fresh interpreter with PyTorch imitating an AVX2 laptop (``ATEN_CPU_CAPABILITY=avx2``), so that the kernels
are compiled with ``-mavx2 -mfma -mf16c`` and their AVX2 branches are the ones checked. ``make test`` runs this
in lane b, after the test model's notebooks have built that library (else it is built here, ~35 s on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ("tests/test_cpu_linear.py", "tests/test_cpu_quant.py", "tests/test_cpu_attention.py",
                "tests/test_cpu_pick.py")
IMITATED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="this CPU cannot run AVX2 code")
def test_the_kernels_built_for_avx2_pass_the_kernel_tests():
    code = "from utils import cpu_extension; print(cpu_extension.compile_command(cpu_extension.library_path()))"
    command = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **IMITATED},
                             capture_output=True, text=True, check=True).stdout
    assert "-mavx2" in command and "-march=native" not in command  # the AVX2 branches are the ones compiled
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS], cwd=ROOT,
                         env={**os.environ, **IMITATED}, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1]

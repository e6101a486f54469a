"""The workbook's own CPU kernels (``csrc/*.cpp``): built once per machine into one library, loaded on first use.

Three concepts use them: decode attention over a KV cache (:mod:`utils.cpu_attention`,
``torch.ops.workbook.decode_attention``), matrix products for decode's few rows (:mod:`utils.cpu_linear` and
:mod:`utils.cpu_quant`, ``float_linear``, ``int8_linear``, ``int4_linear``) and a decode step's greedy pick
(:func:`utils.fast.greedy_pick`, ``greedy_argmax``). Each source registers its operators with PyTorch, so eager code and a compiled step (``torch.compile`` or an
AOTInductor package) call the same functions and make the same tokens.

:func:`load` compiles the sources once per machine with the C++ compiler inductor uses (20–40 s on 2 cores), keeps
the library in ``~/.cache/prefill-decode-workbook/extensions`` under a name made of the sources, torch's version
and the CPU's instruction sets, loads it and registers each operator's shape rule for tracing. Where that fails
(no compiler) it warns once and returns False, and each caller keeps PyTorch's own kernel.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sysconfig
import warnings
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("decode_attention.cpp", "decode_linear.cpp", "decode_pick.cpp"))


def extension_dir() -> Path:
    """Where the library is kept: ``$WORKBOOK_EXTENSIONS``, else ``~/.cache/prefill-decode-workbook/extensions``."""
    chosen = os.environ.get("WORKBOOK_EXTENSIONS")
    return Path(chosen) if chosen else Path.home() / ".cache" / "prefill-decode-workbook" / "extensions"


def _cpu_flags() -> str:
    """This CPU's instruction sets (``-march=native`` compiles for them)."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((line for line in lines if line.startswith("flags")), "")


def target_flags() -> list[str]:
    """The instruction sets the kernels are compiled for: this CPU's (``-march=native``), or those of the plainer CPU
    that ``$ATEN_CPU_CAPABILITY`` imitates (``avx2``: a laptop without AVX-512; ``default``: plain x86-64)."""
    imitated = os.environ.get("ATEN_CPU_CAPABILITY", "")
    return {"avx2": ["-mavx2", "-mfma", "-mf16c"], "default": []}.get(imitated, ["-march=native"])


def compile_command(out: Path) -> list[str]:
    """The compiler call that builds every source into ``out`` (a shared library that registers the operators)."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    return [os.environ.get("CXX", "g++"), "-O3", *target_flags(), "-fopenmp", "-shared", "-fPIC", "-std=c++20",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *map(str, SOURCES), "-o", str(out), *libs,
            "-lc10", "-ltorch_cpu", "-ltorch"]


def library_path() -> Path:
    """The library's path: named by the sources, torch's version, this CPU's flags and the target's."""
    sources = "|".join(s.read_text() for s in SOURCES)
    key = hashlib.sha256(f"{sources}|{torch.__version__}|{_cpu_flags()}|{target_flags()}".encode())
    return extension_dir() / f"workbook_kernels-{key.hexdigest()[:16]}.so"


def build(path: Path) -> bool:
    """Compile the kernels into ``path`` (written whole, then renamed: another process may be building it too).
    False, with a warning saying why, when this machine cannot (no C++ compiler, a failed build)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.so")
    try:
        subprocess.run(compile_command(partial), check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"the workbook's CPU kernels could not be built, PyTorch's own kernels are used instead: "
                      f"{detail.strip()[-400:]}", stacklevel=3)
        return False
    partial.replace(path)
    return True


def _like_x_rows(x: Tensor, weight: Tensor, *_: object) -> Tensor:
    """The shape of ``x [M, K] @ W.T`` for a weight of ``N`` rows (``[N, K]``, or ``[P, N / P, K]`` laid out by
    thread), in x's dtype (the ``*_linear`` operators')."""
    return x.new_empty(x.shape[0], weight.shape[:-1].numel())


def _like_tiles_rows(x: Tensor, tiles: Tensor, n: int) -> Tensor:
    """bf16_tiles_linear's output: ``[M, n]`` in x's dtype (its weight is in tiles, n output rows)."""
    return x.new_empty(x.shape[0], n)


def _like_rows(logits: Tensor) -> Tensor:
    """greedy_argmax's output: one int64 index per row of ``logits [B, V]``."""
    return logits.new_empty(logits.shape[0], dtype=torch.long)


def _like_q(q: Tensor, *_: object) -> Tensor:
    """decode_attention's output: shaped and typed like its query."""
    return torch.empty_like(q, memory_format=torch.contiguous_format)


SHAPE_RULES = {"workbook::decode_attention": _like_q, "workbook::int8_linear": _like_x_rows,
               "workbook::int4_linear": _like_x_rows, "workbook::float_linear": _like_x_rows,
               "workbook::bf16_tiles_linear": _like_tiles_rows, "workbook::greedy_argmax": _like_rows}
"""Each operator's output for tracing (``torch.library.register_fake``): what a compiled step plans around."""


@cache
def load() -> bool:
    """Compile the kernels once per machine (kept on disk), load them into this process and register their shape
    rules. True when the ``torch.ops.workbook`` operators can be called, False when this machine cannot build
    them (see :func:`build`)."""
    path = library_path()
    if not path.exists() and not build(path):
        return False
    torch.ops.load_library(str(path))
    for name, rule in SHAPE_RULES.items():
        torch.library.register_fake(name)(rule)
    return True

"""A decode-attention kernel for CPUs: one query per sequence over its KV cache (``csrc/decode_attention.cpp``).

Decode asks attention a small question: one new query against every cached key. PyTorch's CPU attention
kernel is built for prefill's many queries; on one query it spends ~170 ns per cached slot per layer
(SmolLM2's 9 heads of 64, 2 threads), about ten times the arithmetic, and more in bf16. At 1,024 tokens of
context that was half of a compiled decode step. The kernel here reads each cached key and value row once
for all the query heads that share it (grouped-query attention), computes in float32 whatever the cache's
dtype, and splits the slots into chunks that two threads share. :func:`utils.fast.attention_seconds` times
it against PyTorch's kernel on the machine at hand.

The kernel is a PyTorch operator, ``torch.ops.workbook.decode_attention``: eager code and a compiled step
(``torch.compile`` or an AOTInductor package) call the same function, so they make the same tokens.
:func:`utils.llama.attention` uses it for bf16 and fp16 caches; a float32 cache keeps PyTorch's kernel, which
reads it without a copy and is not slower there by the cache's bytes (see that function).
:func:`load` compiles it once per machine with the C++ compiler inductor uses (15–25 s on 2 cores) and keeps
it in ``~/.cache/prefill-decode-workbook/extensions``; where that fails, :func:`available` is False and
:func:`utils.llama.attention` keeps PyTorch's kernel.
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

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"


def extension_dir() -> Path:
    """Where the compiled kernel is kept: ``$WORKBOOK_EXTENSIONS``, else ``~/.cache/prefill-decode-workbook/extensions``."""
    chosen = os.environ.get("WORKBOOK_EXTENSIONS")
    return Path(chosen) if chosen else Path.home() / ".cache" / "prefill-decode-workbook" / "extensions"


def _cpu_flags() -> str:
    """This CPU's instruction sets (``-march=native`` compiles for them)."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((line for line in lines if line.startswith("flags")), "")


def target_flags() -> list[str]:
    """The instruction sets the kernel is compiled for: this CPU's (``-march=native``), or those of the plainer CPU
    that ``$ATEN_CPU_CAPABILITY`` imitates (``avx2``: a laptop without AVX-512; ``default``: plain x86-64)."""
    imitated = os.environ.get("ATEN_CPU_CAPABILITY", "")
    return {"avx2": ["-mavx2", "-mfma", "-mf16c"], "default": []}.get(imitated, ["-march=native"])


def compile_command(out: Path) -> list[str]:
    """The compiler call that builds the kernel into ``out`` (a shared library that registers the operator)."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    return [os.environ.get("CXX", "g++"), "-O3", *target_flags(), "-fopenmp", "-shared", "-fPIC", "-std=c++20",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(SOURCE), "-o", str(out), *libs,
            "-lc10", "-ltorch_cpu", "-ltorch"]


def library_path() -> Path:
    """The compiled kernel's path: named by the source, torch's version, this CPU's flags and the target's."""
    key = hashlib.sha256(f"{SOURCE.read_text()}|{torch.__version__}|{_cpu_flags()}|{target_flags()}".encode())
    key = key.hexdigest()[:16]
    return extension_dir() / f"decode_attention-{key}.so"


def build(path: Path) -> bool:
    """Compile the kernel into ``path`` (written whole, then renamed: another process may be building it too).
    False, with a warning saying why, when this machine cannot (no C++ compiler, a failed build)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.so")
    try:
        subprocess.run(compile_command(partial), check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"the CPU decode-attention kernel could not be built, PyTorch's attention is used instead: "
                      f"{detail.strip()[-400:]}", stacklevel=3)
        return False
    partial.replace(path)
    return True


@cache
def _load_once() -> bool:
    path = library_path()
    if not path.exists() and not build(path):
        return False
    torch.ops.load_library(str(path))
    torch.library.register_fake("workbook::decode_attention")(_shape_of_output)
    return True


def load() -> bool:
    """Compile the kernel once per machine (kept on disk), load it into this process and register its shape
    rule for tracing. True when ``torch.ops.workbook.decode_attention`` can be called; False when it cannot be
    built here (see :func:`build`) or ``$WORKBOOK_CPU_ATTENTION`` is ``0`` (PyTorch's attention, to compare)."""
    return os.environ.get("WORKBOOK_CPU_ATTENTION") != "0" and _load_once()


def _shape_of_output(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """What the operator returns, for tracing: a tensor shaped and typed like ``q``."""
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.compiler.assume_constant_result  # a compiled step asks once, while tracing, and keeps the answer
def available() -> bool:
    """True when the kernel is built and loaded (see :func:`load`)."""
    return load()


MAX_GROUP, MAX_HEAD_DIM = 16, 256
"""The largest query heads per KV head and head size the kernel handles (``kMaxGroup``, ``kMaxDim`` in its source)."""


def handles(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> bool:
    """True when the kernel can answer this decode query: one query per sequence, a bool mask, one dtype, at most
    :data:`MAX_GROUP` query heads per KV head and :data:`MAX_HEAD_DIM` per head, rows of k and v contiguous."""
    return (q.dim() == 4 and q.shape[2] == 1 and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[2] == 1
            and q.dtype == k.dtype == v.dtype and q.shape[1] % k.shape[1] == 0 and q.shape[1] // k.shape[1] <= MAX_GROUP
            and q.shape[-1] <= MAX_HEAD_DIM and k.stride(-1) == 1 and v.stride(-1) == 1)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """softmax(q kᵀ / √D + mask) v for one query per sequence, on a CPU.

    q: [B, H, 1, D]; k, v: [B, Hkv, S, D] with a contiguous last dim (a slice of a bigger cache is fine);
    mask: [B, 1, 1, S] bool, True = may attend. Returns [B, H, 1, D] in q's dtype, computed in float32.
    A row that may attend to no slot gets zeros. Call :func:`available` first.
    """
    return torch.ops.workbook.decode_attention(q, k, v, mask)

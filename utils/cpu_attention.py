"""A decode-attention kernel for CPUs: one query per sequence over its KV cache (``csrc/decode_attention.cpp``).

Decode asks attention a small question: one new query against every cached key. PyTorch's CPU attention
kernel is built for prefill's many queries; on one query it spends ~170 ns per cached slot per layer
(SmolLM2's 9 heads of 64, 2 threads), about ten times the arithmetic, and more in bf16. At 1,024 tokens of
context that was half of a compiled decode step. The kernel here reads each cached key and value row once
for all the query heads that share it (grouped-query attention), computes in float32 whatever the cache's
dtype, and cuts each KV head's allowed slots into runs, as many as give every thread the same number of rows.
:func:`utils.fast.attention_seconds` times it against PyTorch's kernel on the machine at hand.

The kernel is a PyTorch operator, ``torch.ops.workbook.decode_attention``: eager code and a compiled step
(``torch.compile`` or an AOTInductor package) call the same function, so they make the same tokens.
:func:`utils.llama.attention` uses it for every decode step on a CPU whose shape it handles, in float32, bf16 or
fp16 (a float64 cache, kept as a precision reference, stays on PyTorch's float64 kernel).
:func:`load` compiles it once per machine with the workbook's other CPU kernels (:mod:`utils.cpu_extension`);
where that fails, :func:`available` is False and :func:`utils.llama.attention` keeps PyTorch's kernel.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from . import cpu_extension


def load() -> bool:
    """Build and load the workbook's CPU kernels (:func:`utils.cpu_extension.load`). True when
    ``torch.ops.workbook.decode_attention`` can be called; False when they cannot be built here or
    ``$WORKBOOK_CPU_ATTENTION`` is ``0`` (PyTorch's attention, to compare)."""
    return os.environ.get("WORKBOOK_CPU_ATTENTION") != "0" and cpu_extension.load()


@torch.compiler.assume_constant_result  # a compiled step asks once, while tracing, and keeps the answer
def available() -> bool:
    """True when the kernel is built and loaded (see :func:`load`)."""
    return load()


MAX_GROUP, MAX_HEAD_DIM = 32, 256
"""The largest query heads per KV head and head size the kernel handles (``kMaxGroup``, ``kMaxDim`` in its source)."""


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes the kernel reads. It computes in float32, so a float64 cache (a precision reference) keeps PyTorch's."""


def handles(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> bool:
    """True when the kernel can answer this decode query: one query per sequence, a bool mask, one dtype of
    :data:`KERNEL_DTYPES`, at most :data:`MAX_GROUP` query heads per KV head and :data:`MAX_HEAD_DIM` per head, rows
    of k and v contiguous."""
    return (q.dim() == 4 and q.shape[2] == 1 and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[2] == 1
            and q.dtype == k.dtype == v.dtype and q.dtype in KERNEL_DTYPES and q.shape[1] % k.shape[1] == 0
            and q.shape[1] // k.shape[1] <= MAX_GROUP and q.shape[-1] <= MAX_HEAD_DIM
            and k.stride(-1) == 1 and v.stride(-1) == 1)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """softmax(q kᵀ / √D + mask) v for one query per sequence, on a CPU.

    q: [B, H, 1, D]; k, v: [B, Hkv, S, D] with a contiguous last dim (a slice of a bigger cache is fine);
    mask: [B, 1, 1, S] bool, True = may attend. Returns [B, H, 1, D] in q's dtype, computed in float32.
    A row that may attend to no slot gets zeros. Call :func:`available` first.
    """
    return torch.ops.workbook.decode_attention(q, k, v, mask)

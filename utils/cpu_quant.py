"""Weight-only int8 and int4 matrix products for decode on a CPU: the workbook's C++ kernels (``csrc/decode_linear.cpp``).

A decode step multiplies one row per sequence by every weight matrix, so its time is the weights' bytes over the
memory bandwidth, if the kernel keeps up with the memory. PyTorch's weight-only CPU kernels
(``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``) are built for many rows; on one row they
read their weights well below the bandwidth (2-core AMD EPYC, AVX2: int8 at 8.5 GB/s, int4 at 6.8, against a
probe's 20). The kernels here stream each weight row once for up to four rows of x, with independent
accumulators, output rows split across threads: :func:`utils.fast.projections_seconds` times a model's
projections either way on the machine at hand, and the bench prints both.

Layouts (built once, by :mod:`utils.quant`'s modules):

- int8: ``q`` int8 ``[N, K]`` and a float32 scale per row: ``W = q * scale``.
- int4: ``packed`` uint8 ``[N, K / 2]``, each block of 32 weights in 16 bytes, byte ``j`` holding weight ``j`` in
  its low nibble and weight ``j + 16`` in its high one (GGUF's Q4_1 order: one AND and one shift split a block
  into its halves); ``dm`` float16 ``[N, K / g, 2]``: ``W = q * d + m`` in each group of ``g`` (a multiple of 32).
  From :mod:`utils.quant`'s ``W = (q - zero) * scale``: ``d = scale``, ``m = -zero * scale``.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from . import cpu_extension

INT4_BLOCK = 32
"""Weights per 16-byte int4 block: a group size must be a multiple of it."""


@torch.compiler.assume_constant_result  # a compiled step asks once, while tracing, and keeps the answer
def available() -> bool:
    """True when the kernels are built and loaded (:func:`utils.cpu_extension.load`) and ``$WORKBOOK_CPU_QUANT`` is
    not ``0`` (PyTorch's kernels, to compare)."""
    return os.environ.get("WORKBOOK_CPU_QUANT") != "0" and cpu_extension.load()


def int8_linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """``x @ (q * scale).T`` for ``x [..., K]`` (float32, bf16 or fp16), ``q`` int8 ``[N, K]`` (or ``[P, N / P, K]``
    laid out by thread, :func:`utils.cpu_linear.pack_by_thread`), ``scale`` float32 ``[N]``; returns ``[..., N]`` in
    x's dtype, computed in float32."""
    y = torch.ops.workbook.int8_linear(x.reshape(-1, x.shape[-1]), q, scale)
    return y.reshape(*x.shape[:-1], scale.shape[0])


def int4_pack(q: Tensor) -> Tensor:
    """Unpacked int4 values ``q [N, K]`` in [0, 15] (K a multiple of 32) -> uint8 ``[N, K / 2]`` in blocks of 32."""
    n, k = q.shape
    if k % INT4_BLOCK:
        raise ValueError(f"the int4 kernel reads blocks of {INT4_BLOCK} weights: K={k} is not a multiple")
    blocks = q.to(torch.uint8).reshape(n, k // INT4_BLOCK, INT4_BLOCK)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(n, k // 2).contiguous()


def int4_unpack(packed: Tensor) -> Tensor:
    """Inverse of :func:`int4_pack`: uint8 ``[N, K / 2]`` -> ``[N, K]`` in [0, 15]."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // 16, 16)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, 2 * half)


def int4_dm(scales: Tensor, zeros: Tensor) -> Tensor:
    """The kernel's ``[N, K / g, 2]`` float16 table from per-group ``scales`` and ``zeros`` ``[N, K / g]``:
    ``d = scale``, ``m = -zero * scale``, so that ``q * d + m = (q - zero) * scale``."""
    scales = scales.float()
    return torch.stack([scales, -zeros.float() * scales], dim=-1).to(torch.float16).contiguous()


def int4_linear(x: Tensor, packed: Tensor, dm: Tensor, group_size: int) -> Tensor:
    """``x @ W.T`` with ``W = q * d + m`` (:func:`int4_pack`, :func:`int4_dm`) for ``x [..., K]``; ``[..., N]`` in
    x's dtype, computed with x rounded to 16 bits per 32-value block (relative error ~1e-5) and float32 sums.
    ``packed`` and ``dm`` may be laid out by thread instead (``[P, N / P, K / 2]`` and ``[P, N / P, K / g, 2]``,
    :func:`utils.cpu_linear.pack_by_thread`): the same sums."""
    y = torch.ops.workbook.int4_linear(x.reshape(-1, x.shape[-1]), packed, dm, group_size)
    return y.reshape(*x.shape[:-1], packed.shape[:-1].numel())

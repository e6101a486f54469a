"""Float32 and bf16 projections for decode on a CPU, on the workbook's own kernel (``csrc/decode_linear.cpp``).

PyTorch's float matmuls read float weights near the memory's speed only pre-packed: a compiled step gets that by
*freezing*, which packs every weight while the step is compiled, so the whole step must be compiled at once (half a
minute to a minute per step on 2 cores, a package of the model's size). The workbook's kernel streams the weights
as they are stored, each thread a range of output rows, for up to :data:`MAX_ROWS` rows of x at a time. A model
whose projections all call it has nothing to pack, and its step is built by layer groups
(:class:`utils.fast.LayeredStep`) in seconds. :func:`utils.fast.projections_seconds` times a model's projections
either way on the machine at hand; ``make bench`` prints both.

A bf16 weight becomes float32 by a shift (exact) and every product is summed in float32, so the result differs
from ``x @ W.T`` in float32 only by summation order; in x's dtype it is rounded once, at the end. On a CPU with AMX
(:func:`tiles_here`) a bf16 projection keeps a second copy of its weight in the tile unit's order
(:func:`bf16_tiles`), made once when the module is built, and its bf16 rows go through the tile unit
(:func:`bf16_tiles_linear`): products exact, summed in float32 by the tile unit. Elsewhere the weights are read
from a second copy laid out by thread (:func:`pack_by_thread`), so that each thread streams one region per step;
so are the int8 and int4 layers' (:mod:`utils.quant`) in :func:`on_workbook_kernels`.
"""

from __future__ import annotations

import copy
import itertools
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_quant, quant
from .errors import WorkbookError
from .llama import Llama, iter_linears, replace_linear

MAX_ROWS = 4
"""Rows of x (tokens times sequences) up to which a :class:`FloatLinear` calls the kernel: decode's. Beyond, a
prefill's many rows go to PyTorch's GEMM, which is compute-bound there and far faster than re-reading the weights
once per four rows."""


def float_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` for ``x [..., K]`` (float32, bf16 or fp16) and a contiguous float32 or bf16 ``weight [N, K]``
    (or the same weight laid out by thread, ``[P, N / P, K]``: :func:`pack_by_thread`); ``[..., N]`` in x's dtype,
    summed in float32."""
    y = torch.ops.workbook.float_linear(x.reshape(-1, x.shape[-1]), weight)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def tiles_here() -> bool:
    """True where bf16 projections can use the AMX tile unit: the workbook's kernels run (:func:`utils.cpu_quant.available`),
    the CPU has AMX and the OS lets this process use it, and no plainer CPU is imitated (``$ATEN_CPU_CAPABILITY``)."""
    return (cpu_quant.available() and not os.environ.get("ATEN_CPU_CAPABILITY")
            and torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def bf16_tiles(weight: Tensor) -> Tensor:
    """A bf16 ``weight [N, K]`` (N a multiple of 16, K of 32) in the tile unit's order, ``[N / 16, K / 2, 16, 2]``:
    for each block of 16 output rows and each pair of K values, the 16 rows' pairs side by side."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def bf16_tiles_linear(x: Tensor, tiles: Tensor, out_features: int) -> Tensor:
    """``x @ W.T`` for bf16 ``x [..., K]`` (at most 16 rows) and ``W`` as :func:`bf16_tiles` laid it out;
    ``[..., out_features]`` in bf16, summed in float32 by the tile unit."""
    y = torch.ops.workbook.bf16_tiles_linear(x.reshape(-1, x.shape[-1]), tiles, out_features)
    return y.reshape(*x.shape[:-1], out_features)


class FloatLinear(nn.Module):
    """An ``nn.Linear`` (same weight and bias tensors, not copied) whose decode rows call the workbook's kernel:
    :func:`bf16_tiles_linear` for a bf16 weight whose shape fits the tiles where :func:`tiles_here` (``tiles``,
    a second copy of the weight, not counted as weight bytes: decode reads one or the other), else
    :func:`float_linear`. ``path`` says which."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not linear.weight.is_contiguous():
            raise ValueError("FloatLinear needs a contiguous weight [out_features, in_features]")
        if not cpu_quant.available():
            raise WorkbookError("FloatLinear calls the workbook's CPU kernels, which are not in use here "
                                "(not built, or $WORKBOOK_CPU_QUANT=0): keep the nn.Linear (on_workbook_kernels does)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.kernel, self.use_kernel = "workbook", True  # what utils.fast.has_weights_to_pack looks for
        fits = self.weight.dtype == torch.bfloat16 and self.out_features % 16 == 0 and self.in_features % 32 == 0
        self.path = "tiles" if fits and tiles_here() else "rows"
        if self.path == "tiles":
            self.register_buffer("tiles", bf16_tiles(self.weight.detach()), persistent=False)
        self.register_buffer("parts", None, persistent=False)  # the weight laid out by thread (pack_by_thread)

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        if x.numel() > MAX_ROWS * x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        if self.path == "tiles" and x.dtype == torch.bfloat16:
            y = bf16_tiles_linear(x, self.tiles, self.out_features)
        else:
            y = float_linear(x, self.weight if self.parts is None else self.parts)
        return y if self.bias is None else y + self.bias


HUGE_PAGE = 2 << 20


def huge_page_buffer(numel: int, dtype: torch.dtype) -> Tensor:
    """An empty 1-D tensor whose memory the OS is asked to back with 2 MiB pages (``MADV_HUGEPAGE``; Linux maps
    ordinary allocations with 4 KiB pages unless a program asks): one page-table entry per 2 MiB instead of 512, so a
    stream through the weights misses the TLB 512 times less often. A plain ``torch.empty`` where that cannot be
    asked (not Linux)."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return torch.empty(numel, dtype=dtype)
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: not shared memory
    memory.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(memory, dtype=torch.uint8)  # keeps `memory` alive
    start = -raw.data_ptr() % HUGE_PAGE  # the first 2 MiB boundary
    return raw[start:start + nbytes].view(dtype)


def laid_out_by_thread(tensors: list[Tensor], threads: int) -> list[Tensor]:
    """Copies of ``tensors`` (one dtype, each ``[N, ...]`` with N a multiple of ``threads``) in one buffer on 2 MiB
    pages (:func:`huge_page_buffer`), ``[threads, per_thread]``: each copy a ``[threads, N / threads, ...]`` view
    whose part t, rows ``t * N / threads ..``, follows part t of the copy before it."""
    per_thread = sum(t.numel() // threads for t in tensors)
    buffer = huge_page_buffer(threads * per_thread, tensors[0].dtype)
    at, copies = buffer.storage_offset(), []  # as_strided counts from the start of the memory
    for t in tensors:
        shape = (threads, t.shape[0] // threads, *t.shape[1:])
        rows = torch.empty(shape[1:], device="meta").stride()  # one part's own strides: contiguous
        copies.append(buffer.as_strided(shape, (per_thread, *rows), at).copy_(t.detach().reshape(shape)))
        setattr(copies[-1], LAID_OUT, True)
        at += t.numel() // threads
    return copies


LAID_OUT = "_workbook_laid_out_by_thread"
"""The attribute :func:`laid_out_by_thread` sets on each copy it makes (see :func:`is_laid_out`)."""


def is_laid_out(t: Tensor) -> bool:
    """Whether ``t`` is a copy :func:`laid_out_by_thread` made: a view into its thread buffer, read by decode and
    never written."""
    return getattr(t, LAID_OUT, False)


def decode_tensors(module: nn.Module) -> dict[str, Tensor]:
    """The tensors a decode row of ``module`` streams through the workbook's kernels, by the name of the buffer that
    holds their copy laid out by thread (:func:`pack_by_thread`): a "rows" :class:`FloatLinear`'s weight, an int8
    layer's ``q``, an int4 layer's ``packed`` and ``dm`` (:mod:`utils.quant`); none for any other module."""
    if isinstance(module, FloatLinear):
        return {"parts": module.weight} if module.path == "rows" else {}
    if getattr(module, "kernel", "") != "workbook" or not getattr(module, "use_kernel", False):
        return {}
    if isinstance(module, quant.Int8Linear):
        return {"q_parts": module.q}
    return {"packed_parts": module.packed, "dm_parts": module.dm} if isinstance(module, quant.Int4Linear) else {}


def pack_by_thread(model: Llama, threads: int | None = None) -> int:
    """Give each projection of ``model`` that decodes on the workbook's kernels a second copy of what it streams
    (:func:`decode_tensors`; not weight bytes: decode reads one or the other), laid out by thread: per dtype one
    buffer ``[threads, per_thread]``, in which thread t's share of every projection's rows (rows ``t * N /
    threads ..``, the share the kernel gives it) follows its share of the projection before, in the order a step
    calls them. Each thread then streams one region per dtype through a step, as the bandwidth probe does, instead
    of ~120 short ones. ``threads``: the decode threads (default torch's); a projection whose rows do not split
    evenly is read from its own tensors. Returns how many were laid out."""
    threads = threads or torch.get_num_threads()
    chosen: dict[torch.dtype, list[tuple[nn.Module, str, Tensor]]] = {}
    done = 0
    for _, m in iter_linears(model):
        tensors, splits = decode_tensors(m), m.out_features % threads == 0
        for name, t in tensors.items():
            setattr(m, name, None)  # laid out again below, or read from its own tensors
            if splits:
                chosen.setdefault(t.dtype, []).append((m, name, t))
        done += bool(tensors) and splits
    for group in chosen.values():
        for (m, name, _), copy_ in zip(group, laid_out_by_thread([t for *_, t in group], threads)):
            setattr(m, name, copy_)
    return done


STREAM_AHEAD = 8192
"""Bytes ahead at which the kernels ask for a weight laid out by thread, one row at a time, with a use-once hint
(``PREFETCHNTA``): the stream runs further ahead than the CPU's own prefetcher takes it, and keeps less of the
caches from what is read again (the KV cache). The measurements are in ``csrc/decode_linear.cpp``
(``stream_ahead``); ``make bench`` times every compiled step with and without it, in turns."""


@contextmanager
def stream_ahead(nbytes: int) -> Iterator[None]:
    """Within the block, the kernels ask for a weight laid out by thread ``nbytes`` ahead (0: they do not ask; the
    default is :data:`STREAM_AHEAD`): to time a step both ways. Results are the same either way: a prefetch only
    says which bytes will be read next."""
    if nbytes < 0 or nbytes % 64:
        raise WorkbookError(f"stream_ahead: nbytes must be a multiple of 64 (a cache line) and >= 0, got {nbytes}")
    before = torch.ops.workbook.set_stream_ahead(nbytes)
    try:
        yield
    finally:
        torch.ops.workbook.set_stream_ahead(before)


def _laid_out(module: nn.Module, threads: int) -> bool:
    """Whether :func:`pack_by_thread` on ``threads`` threads has nothing to add for ``module``."""
    split = getattr(module, "out_features", 1) % threads == 0
    return not split or all(getattr(module, name) is not None for name in decode_tensors(module))


def on_workbook_kernels(model: Llama) -> Llama:
    """``model`` with every float32 or bf16 ``nn.Linear`` projection a :class:`FloatLinear` and what each projection
    decodes from laid out by thread (:func:`pack_by_thread`: a second copy, the weights' size again in memory): a
    new module tree that shares ``model``'s tensors (its weights are not replaced; a tied LM head stays tied).
    ``model`` itself where there is nothing to replace or lay out, or where the kernels do not run (not a CPU, not
    built, ``$WORKBOOK_CPU_QUANT=0``)."""
    plain = [name for name, m in iter_linears(model) if type(m) is nn.Linear
             and m.weight.dtype in (torch.float32, torch.bfloat16)]
    if model.device.type != "cpu" or not cpu_quant.available():
        return model
    if not plain and all(_laid_out(m, torch.get_num_threads()) for _, m in iter_linears(model)):
        return model
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    new = copy.deepcopy(model, memo=shared)
    linears = dict(iter_linears(new))
    for name in plain:
        replace_linear(new, name, FloatLinear(linears[name]))
    pack_by_thread(new)
    return new

"""The machine: measured bandwidth and FLOP/s, its memory, and a table of accelerators.

The two numbers that set the ceilings of :mod:`utils.roofline`:

- **memory bandwidth** (bytes/s): how fast the device streams data from its main
  memory. Decode reads every weight once per token, so ``tok/s <= bandwidth / bytes``.
  Measured here by summing (or copying) a tensor far larger than the caches.
- **matmul FLOP/s**: how fast it multiplies matrices, the work of prefill.
  Measured with one large square ``n x n`` matmul: ``2 x n**3`` FLOP.

Both follow the workbook's protocol: warm-up first, several timed repeats, median,
and a synchronize on CUDA/MPS before every timer read (:mod:`utils.timing`).
What torch reaches is what a model running in torch can reach; vendor peaks
(:data:`ACCELERATORS`) are upper bounds that measured kernels approach, never pass.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import roofline
from .device import device_memory_bytes, pick_device, resolve_dtype
from .errors import WorkbookError, check_count, check_number
from .roofline import GB
from .timing import measure


# ---------------------------------------------------------------- measurement


def _calls_per_repeat(fn: Callable[[], Any], device: torch.device, min_seconds: float) -> int:
    """Warm ``fn`` up, then count how many calls make one repeat last ``min_seconds``.

    A GPU finishes one 1 GB read in well under a millisecond; timing a single call
    would mostly measure the launch and the synchronize.
    """
    one = measure(fn, warmup=1, repeats=1, device=device, progress=False).median
    return max(1, min(1000, int(min_seconds / max(one, 1e-9)) + 1))


def _median_seconds_per_call(fn: Callable[[], Any], device: torch.device, repeats: int,
                             min_seconds: float = 0.02) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` timed repeats, after warm-up."""
    check_count(repeats, "repeats")
    calls = _calls_per_repeat(fn, device, min_seconds)  # also the warm-up

    def repeat() -> None:
        for _ in range(calls):
            fn()

    return measure(repeat, warmup=0, repeats=repeats, device=device, progress=False).median / calls


def measure_bandwidth(device: str | torch.device | None = None, size_mb: float | None = None,
                      repeats: int = 5, method: str = "sum") -> float:
    """Measured memory bandwidth of ``device`` in bytes per second (B/s).

    ``method="sum"`` reads a float32 tensor of ``size_mb`` MiB once per call: bytes =
    size (read only, like decode reading weights). ``method="copy"`` copies it into
    another tensor: bytes = 2 x size (read + write, the STREAM convention; a CPU's
    write-allocate traffic is not counted). The tensor must dwarf the caches:
    default 256 MiB on CPU, 1 GiB on a GPU. Takes about a second on a laptop CPU.
    """
    dev = pick_device(device)
    fn, bytes_per_call = bandwidth_reader(dev, size_mb, method)
    return bytes_per_call / _median_seconds_per_call(fn, dev, repeats)


def bandwidth_reader(device: str | torch.device | None = None, size_mb: float | None = None,
                     method: str = "sum") -> tuple[Callable[[], Any], int]:
    """What :func:`measure_bandwidth` times, to time it yourself (e.g. in turns with a decode step,
    :func:`utils.timing.interleaved`): a call that reads (``"sum"``) or copies (``"copy"``) a fresh tensor of
    ``size_mb`` MiB, and the bytes one call moves."""
    dev = pick_device(device)
    if method not in ("sum", "copy"):
        raise WorkbookError(f"method must be 'sum' or 'copy', got {method!r}.")
    mib = check_number(size_mb if size_mb is not None else
                       (256 if dev.type == "cpu" else 1024), "size_mb", "MiB")
    n = max(1, int(mib * 2**20) // 4)
    src = torch.ones(n, dtype=torch.float32, device=dev)  # ones: every page touched
    if method == "sum":
        return (lambda: src.sum()), n * 4
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * n * 4


@dataclass(frozen=True)
class BandwidthProbe:
    """Several bandwidth readings (B/s) of one device, and which one the ceilings use.

    Within one probe a reading under-reads when something interrupts it (another process, a
    cold page, a frequency dip), so the ceiling uses the **best** reading; the spread between
    readings says how far a share of that ceiling can be trusted. Between notebooks the best
    reading itself can move (a virtual machine's memory, the clock): each notebook publishes
    the one it used (:func:`utils.results.record_bandwidth`) and a report gives the range.
    """

    readings: tuple[float, ...]

    @property
    def best(self) -> float:
        return max(self.readings)

    @property
    def worst(self) -> float:
        return min(self.readings)

    @property
    def relative_spread(self) -> float:
        """(best - worst) / best: 0.05 is steady; above 0.2, shares of the ceiling are rough."""
        return (self.best - self.worst) / self.best

    def __str__(self) -> str:
        vals = ", ".join(f"{r / GB:.1f}" for r in self.readings)
        return (f"{self.best / GB:.1f} GB/s (best of {len(self.readings)} probes: {vals} GB/s; "
                f"spread {self.relative_spread:.0%})")


def probe_bandwidth(device: str | torch.device | None = None, probes: int = 3, **kwargs: Any) -> BandwidthProbe:
    """:func:`measure_bandwidth` ``probes`` times: the readings, their best and their spread."""
    dev = pick_device(device)
    return BandwidthProbe(tuple(measure_bandwidth(dev, **kwargs) for _ in range(check_count(probes, "probes"))))


def share_of_ceiling(measured_tok_s: float, bytes_per_token: float, probe: BandwidthProbe) -> tuple[float, float]:
    """``measured ÷ (bandwidth ÷ bytes)`` against the best and the worst probe: (low, high) shares."""
    check_number(measured_tok_s, "measured_tok_s", "tokens per second")
    low = measured_tok_s / roofline.decode_ceiling_tok_s(probe.best, bytes_per_token)
    high = measured_tok_s / roofline.decode_ceiling_tok_s(probe.worst, bytes_per_token)
    return low, high


def measure_matmul_flops(device: str | torch.device | None = None,
                         dtype: str | torch.dtype = torch.float32, n: int | None = None,
                         repeats: int = 5) -> float:
    """Measured matmul throughput of ``device`` in FLOP per second (FLOP/s).

    Times ``C = A @ W.T`` with ``n x n`` matrices in ``dtype`` -- the layout of
    ``nn.Linear``, whose weight is stored ``[out, in]``, so the kernel a model's
    prefill runs: ``2 x n**3`` FLOP per call (n**3 multiply-adds). Default ``n``:
    1024 on CPU (about a second in fp32), 8192 on a GPU (enough to fill it).
    A CPU without native bf16 (no AVX-512-BF16/AMX) runs bf16 far slower than fp32.
    """
    dev = pick_device(device)
    dt = resolve_dtype(dtype, dev)
    size = check_count(n if n is not None else (1024 if dev.type == "cpu" else 8192), "n")
    a = torch.randn(size, size, device=dev).to(dt)
    w = torch.randn(size, size, device=dev).to(dt)
    c = torch.empty(size, size, device=dev, dtype=dt)
    seconds = _median_seconds_per_call(lambda: torch.mm(a, w.t(), out=c), dev, repeats)
    return 2.0 * size**3 / seconds


# ------------------------------------------------------------ the accelerator table


@dataclass(frozen=True)
class Accelerator:
    """Vendor figures for one accelerator (peak numbers: measured ones come lower)."""

    name: str
    memory_bytes: float
    """Memory as the vendor states it, in decimal bytes (80 GB = 80e9 B)."""
    bandwidth_bytes_s: float
    """Peak memory bandwidth (B/s)."""
    bf16_dense_flops: float
    """Peak bf16 matmul rate without 2:4 sparsity (FLOP/s)."""
    source: str
    """Where the numbers come from (URL and what was read there)."""

    @property
    def ridge_point(self) -> float:
        """``bf16_dense_flops / bandwidth_bytes_s`` (FLOP/B), see :func:`roofline.ridge_point`."""
        return roofline.ridge_point(self.bf16_dense_flops, self.bandwidth_bytes_s)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ACCELERATORS: list[Accelerator] = [
    Accelerator(
        "NVIDIA H100 SXM", 80e9, 3.35e12, 989.4e12,
        "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 80 GB HBM3, 3.35 TB/s, "
        "BF16 Tensor Core 1,979 TFLOPS with sparsity, i.e. 989.4 dense; NVIDIA Hopper "
        "architecture whitepaper)"),
    Accelerator(
        "NVIDIA H200 SXM", 141e9, 4.8e12, 989.4e12,
        "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 141 GB HBM3e, 4.8 TB/s, "
        "BF16 Tensor Core 1,979 TFLOPS with sparsity, i.e. 989.4 dense: same GH100 compute "
        "as H100)"),
    Accelerator(
        "NVIDIA A100 80GB SXM", 80e9, 2.039e12, 312e12,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
        "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (A100 80GB SXM: 80 GB HBM2e, "
        "2,039 GB/s, BF16 Tensor Core 312 TFLOPS dense, 624 with sparsity)"),
    Accelerator(
        "NVIDIA L4", 24e9, 300e9, 121e12,
        "https://www.nvidia.com/en-us/data-center/l4/ (L4 datasheet: 24 GB GDDR6, 300 GB/s, "
        "BF16 Tensor Core 242 TFLOPS with sparsity, i.e. 121 dense)"),
    Accelerator(
        "NVIDIA GeForce RTX 4090", 24e9, 1.008e12, 165.2e12,
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf "
        "(Ada whitepaper, appendix: RTX 4090 24 GB GDDR6X, 1,008 GB/s, peak BF16 Tensor "
        "TFLOPS with FP32 accumulate 165.2 dense, 330.4 with sparsity)"),
    Accelerator(
        "Apple M2 Max (38-core GPU)", 96e9, 400e9, 13.6e12,
        "https://www.apple.com/newsroom/2023/01/apple-unveils-m2-pro-and-m2-max/ (up to 96 GB "
        "unified memory, 400 GB/s); GPU 13.6 TFLOPS = half the 27.2 TFLOPS Apple states for "
        "the 76-core M2 Ultra (two M2 Max dies, https://www.apple.com/mac-pro/). Apple "
        "publishes an FP32 figure only; the GPU runs fp16/bf16 at about the same rate."),
]
"""Vendor datasheet figures: memory, peak bandwidth, dense (not sparse) bf16 FLOP/s."""


def _normalise(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def accelerator(name: str) -> Accelerator:
    """The entry of :data:`ACCELERATORS` matching ``name`` (case, spaces and dashes ignored).

    A unique part of a name is enough: ``"h100"``, ``"4090"``, ``"m2 max"``.
    """
    key = _normalise(name) if isinstance(name, str) else ""
    exact = [a for a in ACCELERATORS if _normalise(a.name) == key]
    partial = [a for a in ACCELERATORS if key and key in _normalise(a.name)]
    if exact or len(partial) == 1:
        return (exact or partial)[0]
    known = ", ".join(repr(a.name) for a in ACCELERATORS)
    why = "matches several" if partial else "is not in the table"
    raise WorkbookError(f"Accelerator {name!r} {why}; known: {known}.")


# ----------------------------------------------------------------- the machine


def _cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "mps":
        return f"Apple GPU (MPS) on {platform.machine()}"
    return _cpu_model()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_machine(device: str | torch.device | None = None) -> dict[str, Any]:
    """What every measurement must be recorded with: device, threads, versions, OS.

    Plain str/int values only, so ``json.dumps`` takes it as is.
    """
    dev = pick_device(device)
    return {
        "device": str(dev),
        "device_type": dev.type,
        "device_name": _device_name(dev),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "transformers_version": _version("transformers"),
        "python_version": platform.python_version(),
        "os": platform.platform(),
        "memory_total_bytes": device_memory_bytes(dev).total_bytes,
    }

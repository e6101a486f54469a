"""Device and dtype policy, and whether something fits in the device's memory.

The bottom of the package (only :mod:`utils.errors` below it): every module that
needs a device, a dtype or a memory check asks here, and passes the *resolved*
``torch.device`` on, so it is decided once per call path.

- :func:`pick_device`: the argument, ``$WORKBOOK_DEVICE``, else cuda > mps > cpu.
- :func:`resolve_dtype`: the argument, ``$WORKBOOK_DTYPE``, else float32 on CPU and
  bfloat16 on GPUs; refuses a dtype the device cannot run.
- :func:`device_memory_bytes` and :func:`check_fits`: total and free memory, and a
  clear :class:`~utils.errors.OutOfMemoryError` before torch would fail.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import (OutOfMemoryError, UnsupportedDeviceError, UnsupportedDtypeError,
                     check_number)
from .roofline import GB

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """The device to run on: the argument, ``$WORKBOOK_DEVICE``, else cuda > mps > cpu."""
    if isinstance(device, torch.device):
        wanted: str | torch.device | None = device
    else:
        wanted = device if device is not None else os.environ.get("WORKBOOK_DEVICE") or None
    if wanted is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    try:
        dev = torch.device(wanted)
    except (RuntimeError, TypeError) as exc:
        raise UnsupportedDeviceError(f"Unknown device {wanted!r}; use cpu, cuda, cuda:N or mps.") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedDeviceError(f"Device {str(wanted)!r} was asked for, but this torch sees no CUDA GPU.")
    if dev.type == "mps" and not _mps_available():
        raise UnsupportedDeviceError(f"Device {str(wanted)!r} was asked for, but MPS is not available here.")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise UnsupportedDeviceError(f"Device {str(wanted)!r} is not supported; use cpu, cuda or mps.")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype to run in: the argument, ``$WORKBOOK_DTYPE``, else float32 (CPU) / bfloat16.

    Raises :class:`UnsupportedDtypeError` for an unknown name or one the device cannot run.
    """
    wanted = dtype if dtype is not None else os.environ.get("WORKBOOK_DTYPE") or None
    if wanted is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(wanted, str):
        if wanted.lower() not in DTYPES:
            raise UnsupportedDtypeError(
                f"Unknown dtype {wanted!r}; use one of: float32, bfloat16, float16.")
        wanted = DTYPES[wanted.lower()]
    if wanted not in DTYPES.values():
        raise UnsupportedDtypeError(
            f"dtype {wanted} is not supported; use torch.float32, torch.bfloat16 or torch.float16.")
    if device.type == "cuda" and wanted == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UnsupportedDtypeError(
            f"{torch.cuda.get_device_name(device)} cannot run bfloat16; use float16 or float32.")
    return wanted


def dtype_name(dtype: Any) -> str:
    """A dtype's plain name, for headers, tables and comparisons: ``torch.bfloat16`` -> ``"bfloat16"``;
    numpy dtypes and strings too (``np.float32``, ``"f4"`` -> ``"float32"``)."""
    text = str(dtype)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return text


# --------------------------------------------------------------------- memory


@dataclass(frozen=True)
class DeviceMemory:
    """Memory of a device in bytes: all of it, and what is free for new tensors now."""

    total_bytes: int
    available_bytes: int


def _meminfo_bytes() -> dict[str, int]:
    """/proc/meminfo as bytes (Linux); empty elsewhere."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _cgroup_limit_bytes() -> int | None:
    """A container's memory limit (cgroup v2 or v1), if one is set."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" or a huge number: no limit
            return int(text)
    return None


def _cpu_memory() -> DeviceMemory:
    info = _meminfo_bytes()
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = info.get("MemAvailable")
    if available is None:
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):  # macOS has no SC_AVPHYS_PAGES
            available = total
    limit = _cgroup_limit_bytes()
    if limit is not None:
        total, available = min(total, limit), min(available, limit)
    return DeviceMemory(int(total), int(available))


def device_memory_bytes(device: torch.device) -> DeviceMemory:
    """Total and available memory of a resolved ``device`` (bytes).

    CUDA: ``torch.cuda.mem_get_info`` (free, total). MPS: the recommended working-set
    size, less what the driver holds. CPU: /proc/meminfo (MemTotal, MemAvailable),
    capped by a container's cgroup limit; ``os.sysconf`` where there is no /proc.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(int(total), int(free))
    if device.type == "mps":
        total = int(torch.mps.recommended_max_memory())
        return DeviceMemory(total, max(0, total - int(torch.mps.driver_allocated_memory())))
    return _cpu_memory()


def check_fits(bytes_needed: float, device: torch.device, what: str = "this", weights: bool = False) -> None:
    """Raise :class:`~utils.errors.OutOfMemoryError` unless ``bytes_needed`` fits on ``device`` now.

    Compares with the device's *available* memory (free now), not its total. ``weights``: the bytes
    are a model's weights, which no batch size or context length can shrink, and the error says so.
    """
    needed = check_number(bytes_needed, "bytes_needed", "bytes", allow_zero=True)
    mem = device_memory_bytes(device)
    if needed > mem.available_bytes:
        raise OutOfMemoryError(
            f"{what} needs {needed / GB:.2f} GB but {device} has {mem.available_bytes / GB:.2f} GB "
            f"available (of {mem.total_bytes / GB:.2f} GB). "
            + ("The weights alone do not fit: use a smaller dtype (bf16 halves fp32; int8/int4 shrink them "
               "further) or a smaller model." if weights else
               "Reduce the batch size or the context length (the KV cache grows with both), or use a smaller "
               "dtype (bf16 halves fp32; int8/int4 weights shrink them further)."))

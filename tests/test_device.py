"""Device and dtype policy, device memory, and the clear errors for each."""

from __future__ import annotations

import pytest
import torch

from utils import device
from utils.errors import (OutOfMemoryError, UnsupportedDeviceError, UnsupportedDtypeError,
                          WorkbookError)

CPU = torch.device("cpu")


@pytest.mark.parametrize("bad", ["int3", "float8", "fp64"])
def test_unknown_dtype_names_the_choices(bad):
    with pytest.raises(UnsupportedDtypeError, match="float32, bfloat16, float16"):
        device.resolve_dtype(bad, torch.device("cpu"))


def test_dtype_device_cannot_run(monkeypatch):
    with pytest.raises(UnsupportedDtypeError, match="not supported"):
        device.resolve_dtype(torch.int8, torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(UnsupportedDeviceError, match="no CUDA GPU"):
            device.pick_device("cuda")
    with pytest.raises(UnsupportedDeviceError, match="use cpu, cuda"):
        device.pick_device("gpu-please")


def test_device_choice_defaults_and_env(monkeypatch):
    monkeypatch.setenv("WORKBOOK_DEVICE", "cpu")
    assert device.pick_device() == torch.device("cpu")
    monkeypatch.delenv("WORKBOOK_DEVICE")
    expected = "cuda" if torch.cuda.is_available() else None
    if expected:
        assert device.pick_device().type == expected
    assert device.resolve_dtype(None, torch.device("cpu")) == torch.float32


def test_device_memory_is_plausible():
    mem = device.device_memory_bytes(CPU)
    assert 1e8 < mem.total_bytes < 1e14
    assert 0 < mem.available_bytes <= mem.total_bytes


def test_cpu_memory_respects_a_container_limit(monkeypatch):
    monkeypatch.setattr(device, "_cgroup_limit_bytes", lambda: 123_456_789)
    mem = device.device_memory_bytes(CPU)
    assert mem.total_bytes == 123_456_789 and mem.available_bytes <= 123_456_789


def test_check_fits_passes_for_a_tiny_size():
    assert device.check_fits(1024, CPU, what="a tiny tensor") is None


def test_check_fits_raises_for_an_absurd_size():
    with pytest.raises(OutOfMemoryError, match=r"the KV cache needs 1000000\.00 GB .*GB available"
                                               r".*batch size.*context length.*dtype"):
        device.check_fits(1e15, CPU, what="the KV cache")
    with pytest.raises(OutOfMemoryError, match=r"weights alone do not fit.*smaller model") as info:
        device.check_fits(1e15, CPU, what="an 8B model in float32", weights=True)
    assert "batch size" not in str(info.value)  # no batch or context shrinks the weights


def test_check_fits_rejects_a_negative_size():
    with pytest.raises(WorkbookError, match="bytes_needed"):
        device.check_fits(-1, CPU)

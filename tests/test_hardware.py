"""Tests of utils.hardware: measurements are plausible, the table is sourced, memory checks."""

from __future__ import annotations

import json

import pytest
import torch

from utils import hardware as hw
from utils.errors import WorkbookError


# ---------------------------------------------------------------- measurement

@pytest.mark.parametrize("method", ["sum", "copy"])
def test_measured_bandwidth_is_plausible(method):
    bw = hw.measure_bandwidth("cpu", size_mb=64, repeats=3, method=method)
    assert 1e8 < bw < 1e13  # 0.1 GB/s .. 10 TB/s


def test_the_bandwidth_reader_reads_what_it_says():
    read, nbytes = hw.bandwidth_reader("cpu", size_mb=4)
    assert nbytes == 4 * 2**20 and read().item() == nbytes / 4  # a sum of ones: every float32 read once
    copy, moved = hw.bandwidth_reader("cpu", size_mb=4, method="copy")
    assert moved == 2 * nbytes and copy().sum().item() == nbytes / 4


@pytest.mark.parametrize("dtype", [torch.float32, "bf16"])
def test_measured_matmul_flops_is_plausible(dtype):
    flops = hw.measure_matmul_flops("cpu", dtype=dtype, n=128, repeats=3)
    assert 1e7 < flops < 1e16


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="stream"), "method must be 'sum' or 'copy'"),
    (dict(size_mb=0), "size_mb must be a positive number"),
    (dict(size_mb=1, repeats=0), "repeats must be a positive whole number"),
])
def test_bad_bandwidth_arguments_raise(kwargs, message):
    with pytest.raises(WorkbookError, match=message):
        hw.measure_bandwidth("cpu", **kwargs)


def test_bad_matmul_size_raises():
    with pytest.raises(WorkbookError, match="n must be a positive whole number"):
        hw.measure_matmul_flops("cpu", n=0)


# ------------------------------------------------------------------- the table

REQUIRED = ["H100 SXM", "H200", "A100 80GB SXM", "L4", "RTX 4090", "Apple M"]


@pytest.mark.parametrize("name", REQUIRED)
def test_table_has_required_entry_with_source(name):
    [entry] = [a for a in hw.ACCELERATORS if name in a.name]
    assert entry.source.startswith("https://")
    assert 1e9 < entry.memory_bytes < 1e12
    assert 1e11 < entry.bandwidth_bytes_s < 1e13
    assert 1e12 < entry.bf16_dense_flops < 2e15


def test_table_has_datasheet_numbers():
    h100, h200 = hw.accelerator("H100"), hw.accelerator("H200")
    assert (h100.memory_bytes, h100.bandwidth_bytes_s) == (80e9, 3.35e12)
    assert (h200.memory_bytes, h200.bandwidth_bytes_s) == (141e9, 4.8e12)
    assert h100.bf16_dense_flops == h200.bf16_dense_flops == 989.4e12  # dense, not 1,979 sparse
    assert hw.accelerator("A100").bf16_dense_flops == 312e12
    assert hw.accelerator("L4").bandwidth_bytes_s == 300e9
    assert hw.accelerator("4090").bandwidth_bytes_s == 1.008e12
    assert h100.ridge_point == pytest.approx(295.3, abs=0.1)


def test_accelerator_lookup_is_forgiving():
    assert hw.accelerator("nvidia h100 sxm").name == "NVIDIA H100 SXM"
    assert hw.accelerator("RTX-4090").name == "NVIDIA GeForce RTX 4090"
    assert hw.accelerator("m2 max").name.startswith("Apple M2 Max")


def test_accelerator_unknown_or_ambiguous_lists_known_names():
    with pytest.raises(WorkbookError, match="not in the table; known: .*'NVIDIA L4'"):
        hw.accelerator("TPU v5e")
    with pytest.raises(WorkbookError, match="matches several"):
        hw.accelerator("NVIDIA")


# ------------------------------------------------------------------- the machine

def test_describe_machine_is_json_serialisable():
    info = hw.describe_machine("cpu")
    again = json.loads(json.dumps(info))
    assert again["torch_version"] == torch.__version__
    assert again["device_type"] == "cpu"
    assert again["torch_threads"] == torch.get_num_threads() >= 1
    assert again["device_name"] and again["python_version"] and again["os"]

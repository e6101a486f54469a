"""utils.checks: each check passes on right answers and explains wrong ones."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import utils.checks as C
from utils.checks import (CheckFailed, check_between, check_close, check_dtype, check_equal,
                          check_shape, check_true)


def test_check_failed_is_an_assertion_error() -> None:
    assert issubclass(CheckFailed, AssertionError)


def test_check_close_passes_and_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert check_close("logits", torch.tensor([1.0, 2.0 + 1e-6], dtype=torch.float64), np.array([1.0, 2.0])) is None
    check_close("bf16 tensor vs list", torch.ones(2, 2, dtype=torch.bfloat16), [[1, 1], [1, 1]])
    check_close("number", 0.1 + 0.2, 0.3)
    check_close("nan matches nan", [math.nan, 1.0], [math.nan, 1.0])
    out = capsys.readouterr().out
    assert "✓ logits  (max abs error 1e-06)" in out and "✓ number" in out


def test_check_close_reports_worst_index_and_error() -> None:
    got = torch.zeros(2, 3)
    got[1, 2] = 0.5
    got[0, 1] = 0.1
    with pytest.raises(CheckFailed) as info:
        check_close("layer output", got, torch.zeros(2, 3), atol=1e-3)
    msg = str(info.value)
    assert "layer output" in msg and "2 of 6" in msg and "[1, 2]" in msg
    assert "got 0.5" in msg and "expected 0" in msg and "Max abs error 0.5" in msg


def test_check_close_tolerances_and_shape() -> None:
    check_close("within rtol", 101.0, 100.0, rtol=0.02)
    with pytest.raises(CheckFailed, match="rtol=0.001"):
        check_close("outside rtol", 101.0, 100.0, rtol=1e-3)
    with pytest.raises(CheckFailed, match=r"shape \(3,\) was expected to be \(2,\)"):
        check_close("shape", [1, 2, 3], [1, 2])
    with pytest.raises(CheckFailed, match="got nan"):
        check_close("nan", [math.nan], [1.0])


def test_check_equal() -> None:
    check_equal("ids", torch.tensor([1, 2, 3]), np.array([1, 2, 3]))
    check_equal("count", 64, 64)
    check_equal("text", "abc", "abc")
    with pytest.raises(CheckFailed, match=r"1 of 3 values differ; first at index \[2\]: got 3, expected 4"):
        check_equal("ids", torch.tensor([1, 2, 3]), [1, 2, 4])
    with pytest.raises(CheckFailed, match="got 63, expected 64"):
        check_equal("count", 63, 64)
    with pytest.raises(CheckFailed, match="shape"):
        check_equal("ids", torch.zeros(2), torch.zeros(3))


def test_check_shape() -> None:
    check_shape("q", torch.zeros(4, 8, dtype=torch.int8), (4, 8))
    check_shape("scale", np.zeros(4), [4])
    check_shape("a shape", torch.Size([2, 3]), (2, 3))
    with pytest.raises(CheckFailed, match=r"shape \(8, 4\) was expected to be \(4, 8\)"):
        check_shape("q", torch.zeros(8, 4), (4, 8))


def test_check_dtype() -> None:
    check_dtype("q", torch.zeros(2, dtype=torch.int8), torch.int8)
    check_dtype("numpy vs torch", np.zeros(2, dtype=np.float32), torch.float32)
    check_dtype("a dtype", torch.uint8, "uint8")
    check_dtype("numpy class", np.zeros(1, dtype=np.int8), np.int8)
    with pytest.raises(CheckFailed, match="dtype float32 was expected to be int8"):
        check_dtype("q", torch.zeros(2), torch.int8)


def test_check_between() -> None:
    assert check_between("speed-up", torch.tensor(1.5), 1.2, 10) is None
    check_between("no upper bound", 1e9, low=0)
    with pytest.raises(CheckFailed, match="1.1 is below the lowest allowed; expected between 1.2 and 10"):
        check_between("speed-up", 1.1, 1.2, 10)
    with pytest.raises(CheckFailed, match="above the highest"):
        check_between("error", 0.5, high=0.1)
    with pytest.raises(CheckFailed, match="NaN"):
        check_between("error", math.nan, 0, 1)
    with pytest.raises(CheckFailed, match="single number"):
        check_between("error", [1.0, 2.0], 0, 3)


def test_check_true() -> None:
    check_true("faster", 2 > 1)
    with pytest.raises(CheckFailed, match="int8 was not faster"):
        check_true("faster", False, "int8 was not faster")


# ---------------------------------------------------------------- the quantization lab's check cells

import nbformat  # noqa: E402
from pathlib import Path  # noqa: E402

QUANT_LAB = Path(__file__).resolve().parent.parent / "solutions" / "quantization.ipynb"
LAST_LAYER_CHECK = "int4 layer output error"  # the last check that needs only W, X, Y


def _layer_cells() -> list[tuple[bool, str]]:
    """(is_exercise, source) of the code cells of sections 1-2 (one layer: no model needed)."""
    cells = [c.source for c in nbformat.read(QUANT_LAB, as_version=4).cells if c.cell_type == "code"]
    first = next(i for i, s in enumerate(cells) if "### BEGIN SOLUTION" in s)
    last = next(i for i, s in enumerate(cells) if LAST_LAYER_CHECK in s)
    return [("### BEGIN SOLUTION" in s, s) for s in cells[first:last + 1]]


def _namespace(in_features: int = 256) -> dict:
    """What those cells expect from the notebook's setup, with a synthetic layer instead of the model."""
    import math

    import torch.nn.functional as F
    from torch import Tensor

    from utils import checks, quant

    gen = torch.Generator().manual_seed(0)
    W = torch.randn(96, in_features, generator=gen) * 0.05
    X = torch.randn(8, in_features, generator=gen)
    ns = dict(torch=torch, math=math, F=F, Tensor=Tensor, quant=quant, NAME="synthetic layer", W=W, X=X, Y=X @ W.T,
              OUT_F=96, IN_F=in_features)
    ns.update({name: getattr(checks, name) for name in dir(checks) if name.startswith("check_")})
    return ns


WRONG_ANSWERS = {
    "int8_scales": "def int8_scales(w):\n    return w.abs().amax(dim=1) / 128",
    "quantize_int8_by_hand": ("def quantize_int8_by_hand(w):\n    s = int8_scales(w)\n"
                              "    return torch.floor(w / s[:, None]).to(torch.int8), s"),
    "dequantize_int8_by_hand": "def dequantize_int8_by_hand(q, scale):\n    return q.float()",
    "int8_linear": "def int8_linear(x, q, scale, bias=None):\n    return x @ q.T.float()",
    "relative_error": "def relative_error(got, want):\n    return (got - want).norm().item()",
    "int4_scales_zeros": ("def int4_scales_zeros(w, g):\n    grp = w.reshape(w.shape[0], -1, g)\n"
                          "    lo, hi = grp.amin(-1), grp.amax(-1)\n    s = (hi - lo) / 16\n    return s, -lo / s"),
    "pack_int4_by_hand": "def pack_int4_by_hand(q):\n    q = q.to(torch.uint8)\n    return (q[..., 0::2] << 4) | q[..., 1::2]",
    "dequantize_int4_by_hand": ("def dequantize_int4_by_hand(p, s, z, g):\n    q = unpack_int4_by_hand(p).float()\n"
                                "    grp = q.reshape(q.shape[0], -1, g)\n"
                                "    return ((grp + z[..., None]) * s[..., None]).reshape(q.shape)"),
}


@pytest.mark.parametrize("in_features", [256, 344, 131])  # whole groups; the test model's MLP; a prime
def test_quantization_lab_checks_pass_on_the_solution(capsys: pytest.CaptureFixture[str], in_features: int) -> None:
    ns = _namespace(in_features)
    for _, source in _layer_cells():
        exec(source, ns)
    assert "✗" not in capsys.readouterr().out


@pytest.mark.parametrize("function", sorted(WRONG_ANSWERS))
def test_quantization_lab_checks_fail_on_a_wrong_answer(function: str) -> None:
    cells = _layer_cells()
    ns = _namespace()
    where = next(i for i, (exercise, s) in enumerate(cells) if exercise and f"def {function}(" in s)
    for _, source in cells[:where + 1]:
        exec(source, ns)
    exec(WRONG_ANSWERS[function], ns)  # the learner's mistake replaces the solution
    with pytest.raises(CheckFailed):
        for _, source in cells[where + 1:]:
            exec(source, ns)


# ----------------------------------------------------------------------------- the roofline lab's checks


def _hot_loop(step, token, start, n, *, new_slot_each_step=False, off_by_one=False):
    out = token.new_empty(token.shape[0], n)
    slot = torch.tensor([start + (1 if off_by_one else 0)])
    token = token.view(-1, 1)
    for i in range(n):
        nxt = step(token, torch.tensor([start + i]) if new_slot_each_step else slot)
        out[:, i] = nxt
        token = nxt.view(-1, 1)
        slot += 1
    return out


def test_hot_loop_check_passes_the_solution_and_names_each_mistake(capsys):
    C.check_hot_loop("hot", _hot_loop)
    assert "✓ hot" in capsys.readouterr().out
    with pytest.raises(C.CheckFailed, match="new slot tensor"):
        C.check_hot_loop("hot", lambda *a: _hot_loop(*a, new_slot_each_step=True))
    with pytest.raises(C.CheckFailed, match="slots 10 .. 15"):
        C.check_hot_loop("hot", lambda *a: _hot_loop(*a, off_by_one=True))
    with pytest.raises(C.CheckFailed, match="feed each new token back"):
        C.check_hot_loop("hot", lambda step, token, start, n: _hot_loop(step, token.clone().zero_(), start, n))


def test_compiles_once_check_passes_a_tensor_slot_and_fails_a_python_int():
    from torch import nn

    from utils import fast

    C.check_compiles_once("step", fast.DecodeStep)

    class PythonCounter(nn.Module):  # the position counted in a Python attribute: a new graph per value
        def __init__(self, model, cache):
            super().__init__()
            self.model, self.cache, self.steps = model, cache, 0

        def forward(self, token, slot):
            pos = self.cache.length + self.steps
            self.steps += 1
            return self.model(token, torch.tensor([pos]), self.cache, self.cache.max_len)[:, -1].argmax(-1)

    with pytest.raises(C.CheckFailed, match="compiled [0-9]+ times|failed"):
        C.check_compiles_once("step", PythonCounter)

    class WrongToken(fast.DecodeStep):
        def forward(self, token, slot):
            return super().forward(token, slot) * 0

    with pytest.raises(C.CheckFailed, match="greedy tokens"):
        C.check_compiles_once("step", WrongToken)

    class Stub(fast.DecodeStep):  # the lab's exercise untouched: not attempted (the grader's verdict), not failed
        def forward(self, token, slot):
            raise NotImplementedError("Exercise: complete forward()")

    with pytest.raises(NotImplementedError, match="still raises NotImplementedError"):
        C.check_compiles_once("step", Stub)

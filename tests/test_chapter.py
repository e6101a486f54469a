"""The first cell of every chapter: what it prints, and the random-weights warning."""

from __future__ import annotations

from utils import chapter, models
from utils.hardware import describe_machine


def test_setup_lines_name_device_dtype_model_and_settings(lm, monkeypatch):
    monkeypatch.setenv("WORKBOOK_QUICK", "1")
    lines = chapter.describe_setup(lm, describe_machine(lm.device))
    text = "\n".join(lines)
    assert "float32" in text and "torch threads" in text and lm.name in text
    assert f"context {lm.spec.max_context:,} tokens" in text and "quick (CI)" in text
    assert "random weights" not in text


def test_openmp_wait_says_how_idle_threads_wait(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert "default" in chapter.openmp_wait() and "GOMP_SPINCOUNT" in chapter.openmp_wait()
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    assert chapter.openmp_wait() == "OpenMP spin 10000"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert chapter.openmp_wait() == "OpenMP wait passive"


def test_random_weights_are_announced():
    test_lm = models.load_model(str(models.prepare_test_model(verbose=False)), device="cpu")
    lines = chapter.describe_setup(test_lm, describe_machine(test_lm.device))
    assert lines[-1].startswith("NOTE") and "text is meaningless" in lines[-1]


def test_fit_to_context_drops_and_says_why(capsys):
    assert chapter.fit_to_context([16, 64, 256], 8192) == [16, 64, 256]
    assert capsys.readouterr().out == ""
    assert chapter.fit_to_context([32, 512, 1024], 512, new_tokens=8, what="contexts", add_longest=True) == [32, 504]
    out = capsys.readouterr().out
    assert "dropped contexts [512, 1024]: with 8 new tokens after them" in out and "added 504" in out
    assert chapter.fit_to_context([0, 512, 4096], 512, new_tokens=1) == [0]

"""Shared fixtures: the embedded model, loaded once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network


@pytest.fixture(scope="session")
def lm():
    """The embedded default model in float32 on CPU."""
    from utils.models import load_model

    return load_model(device="cpu", dtype="float32")

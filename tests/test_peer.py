"""llama.cpp, the optional peer engine: measured when installed, a clear reason when not."""

from __future__ import annotations

import pytest

from utils import peer


def test_a_failed_build_is_a_reason_not_an_exception(monkeypatch, tmp_path):
    monkeypatch.setattr(peer, "installed", lambda: False)
    monkeypatch.setattr(peer, "wheel_dir", lambda: tmp_path)
    monkeypatch.setattr(peer, "_pip", lambda args, env, log, timeout_s: False)
    why = peer.ensure_installed(log=tmp_path / "build.log")
    assert why.startswith("llama-cpp-python did not build") and "build.log" in why


def test_the_build_turns_amx_off():
    assert "-mno-amx-tile" in peer.BUILD_CMAKE_ARGS and "GGML_NATIVE=ON" in peer.BUILD_CMAKE_ARGS


@pytest.mark.skipif(not peer.installed(), reason="llama-cpp-python is not installed (make bench builds it)")
def test_llama_cpp_decodes_the_embedded_file_like_our_model(lm):
    from utils.engine import generate
    from utils.tokens import filler_ids

    ids = filler_ids(lm.tokenizer, 128)
    r = peer.llama_cpp_speed(ids[0].tolist(), 6, repeats=1)
    assert r.weights == "Q4_1" and r.prefill_tok_s > 0 and r.decode_tok_s > 0 and len(r.tokens) == 6
    ours = generate(lm.model, ids, 6)[0].tolist()
    assert r.tokens[:2] == ours[:2]  # the same weights: the first greedy tokens agree (4-bit activations aside)

"""llama.cpp's server: started, stopped and failing clearly (with stand-in programs), and for real when built.

The stand-ins are shell scripts in a temporary folder named by ``$WORKBOOK_LLAMA_SERVER``: one that exits at
once, one that never answers. The real server (built once per machine by ``make llama-server``, which
``make test`` runs in its benchmark step) serves the embedded file on 127.0.0.1; its tests skip when it is
not built, saying so.
"""

from __future__ import annotations

import socket
import stat
import time
from pathlib import Path

import pytest

from utils import llama_server, peer
from utils.errors import WorkbookError
from utils.llama_server import LlamaServer, ServerNotAvailable
from utils.load_generator import run_concurrent
from utils.openai_client import Client, measure_speed
from utils.requests import Request


def stand_in(tmp_path: Path, body: str) -> Path:
    """An executable shell script standing in for llama-server."""
    path = tmp_path / "llama-server"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_a_missing_program_is_named_with_what_to_run(tmp_path, monkeypatch, gguf):
    monkeypatch.setenv("WORKBOOK_LLAMA_SERVER", str(tmp_path / "nowhere"))
    assert "not an executable file" in llama_server.status()
    assert llama_server.ensure_built() == llama_server.status()  # never builds over a program you named
    with pytest.raises(ServerNotAvailable, match="nowhere"):
        LlamaServer(gguf)
    monkeypatch.delenv("WORKBOOK_LLAMA_SERVER")
    monkeypatch.setattr(llama_server.Path, "home", lambda: tmp_path)  # a machine where it was never built
    assert "make llama-server" in llama_server.status()


def test_the_command_sets_slots_context_threads_and_flash_attention_off(tmp_path, monkeypatch, gguf):
    monkeypatch.setenv("WORKBOOK_LLAMA_SERVER", str(stand_in(tmp_path, "exit 0")))
    server = LlamaServer(gguf, parallel=3, context_per_slot=100, threads=1)
    cmd = " ".join(server.command())
    for flag in ("--parallel 3", "--ctx-size 300", "--threads 1", "--threads-batch 1", "--flash-attn off",
                 "--host 127.0.0.1", f"--model {gguf}"):
        assert flag in cmd, cmd
    with pytest.raises(WorkbookError):
        LlamaServer(gguf, parallel=0)
    with pytest.raises(WorkbookError, match="does not exist"):
        LlamaServer(tmp_path / "missing.gguf")


def test_a_server_that_exits_while_starting_says_so_with_its_last_lines(tmp_path, monkeypatch, gguf):
    monkeypatch.setenv("WORKBOOK_LLAMA_SERVER", str(stand_in(tmp_path, "echo 'error: unknown model format'; exit 3")))
    server, start = LlamaServer(gguf, start_timeout_s=10), time.perf_counter()
    with pytest.raises(ServerNotAvailable) as info:
        with server:
            pass
    assert "code 3" in str(info.value) and "unknown model format" in str(info.value)
    assert time.perf_counter() - start < 5
    assert server.log.is_file()  # kept, for whoever reads the error
    server.log.unlink()


def test_a_server_that_never_answers_is_stopped_after_its_timeout(tmp_path, monkeypatch, gguf):
    monkeypatch.setenv("WORKBOOK_LLAMA_SERVER", str(stand_in(tmp_path, "exec sleep 60")))
    server = LlamaServer(gguf, start_timeout_s=0.5)
    start = time.perf_counter()
    with pytest.raises(ServerNotAvailable, match="did not answer /health"):
        server.__enter__()
    assert time.perf_counter() - start < 12
    assert server._proc is None  # stopped, not left running
    server.log.unlink()


# ----------------------------------------------------------------------------- the real server

needs_server = pytest.mark.skipif(bool(llama_server.status()), reason=llama_server.status() or "built")


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@needs_server
def test_the_real_server_streams_exactly_its_tokens_and_stops():
    prompt = list(range(100, 140))  # 40 token ids
    with LlamaServer(parallel=2, context_per_slot=64, threads=1) as server:
        client = Client(server.url)
        speed = measure_speed(client, prompt, 8, repeats=2, **LlamaServer.EXACT)
        for r in speed.results:
            assert (r.counted_by, r.prompt_tokens, r.output_tokens, r.finish_reason) == ("usage", 40, 8, "length")
        assert speed.server_decode_tok_s > 0  # llama.cpp's own timer came with the stream
        if peer.installed():  # the same file, greedy, one request at a time: the same text as in process
            assert speed.text == peer.llama_cpp_speed(prompt, 8, repeats=1, threads=1).text
            served, local = llama_server.alone_in_turns(client, prompt, 8, repeats=2, threads=1)  # rounds in turns
            assert len(served.results) == len(local.decode_samples_s) == 2 and local.prompt_tokens == 40
            assert served.text == local.text == speed.text and len(local.tokens) == 8
        trace = [Request(i, 0.0, prompt[i:], 6) for i in range(4)]
        run = run_concurrent(trace, 2, client, **LlamaServer.EXACT)
        assert run.summary.ok == 4 and all(o.result.output_tokens == 6 for o in run.outcomes)
        port = server.port
    assert refused(port)

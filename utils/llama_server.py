"""llama.cpp's own server, ``llama-server``, on the embedded GGUF file: a real serving engine on this machine.

Chapter 07 builds a continuous-batching server in Python; the engines people deploy (vLLM, SGLang, TGI,
llama.cpp's server) are measured from the outside, through their OpenAI-compatible HTTP API
(:mod:`utils.openai_client`, :mod:`utils.load_generator`). ``llama-server`` is the one that runs here:

- **slots**: ``--parallel N`` gives it ``N`` sequences at once, each with its own part of one KV cache;
  every iteration it decodes one token for every busy slot in one batched pass (continuous batching:
  a request joins or leaves between iterations), and a new request's prompt joins that same batch
  (chunked by ``--ubatch-size``), as chapter 07's mixed steps do.
- **the same weights** as the benchmark's in-process llama.cpp row (:mod:`utils.peer`): the embedded
  Q4_1 file, the same llama.cpp sources (those vendored in ``llama-cpp-python``'s source package,
  :data:`utils.peer.LLAMA_CPP_PYTHON`), built for this CPU with the same flags.

It is not on PyPI as a program, so :func:`ensure_built` builds it once per machine from that source
package (CMake; 4-9 minutes on 2 cores, log in ``.cache/llama-server-build.log``) into
``~/.cache/prefill-decode-workbook/llama-server/<key>/`` (the key names the sources, the flags and the
CPU). ``$WORKBOOK_LLAMA_SERVER`` points at a ``llama-server`` of your own instead. :func:`status`
says whether it is there, and why not; notebooks and tests skip what needs it when it is missing.

    with LlamaServer(parallel=4) as server:       # starts on 127.0.0.1 at a free port, stops on exit
        client = Client(server.url)
        print(meter_line(client.complete(prompt_ids, 32, **LlamaServer.EXACT)))
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from .errors import WorkbookError, check_count, check_number
from .models import REPO_ROOT, embedded_gguf
from .openai_client import Client, StreamSpeed
from .peer import BUILD_CMAKE_ARGS, LLAMA_CPP_PYTHON, LlamaCppRequest, PeerResult, cpu_model, peer_result, timed_run

SERVER_CMAKE_ARGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
                     "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                     "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                     "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON",
                     "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                     "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"]
"""CMake flags: the server alone, statically linked, no web UI (nothing downloaded), for this CPU as
:data:`utils.peer.BUILD_CMAKE_ARGS` builds the in-process row (AMX off there too)."""


HTTP_BAND = (0.8, 1.3)
"""Decode tok/s of llama.cpp's server over HTTP, one request at a time / llama.cpp in process (:mod:`utils.peer`),
same file, same threads: the same kernels, so 1.0 predicted. The band: each token costs the server a sampler
call and a streamed chunk (JSON, a socket write, the client's parse: the server's own timer and the client's
agree within a few %), and costs the in-process loop a Python call through ctypes and a read of the logits
(about 1 ms a token on 2 cores, so the server is often the faster); 0.8 and 1.3 leave room for both and for noise."""


class ServerNotAvailable(WorkbookError):
    """``llama-server`` is not built (or did not start): the message says why and what to run."""


# ----------------------------------------------------------------------------- the build, once per machine


def binary() -> Path:
    """Where ``llama-server`` is: ``$WORKBOOK_LLAMA_SERVER``, else this machine's build of it."""
    if os.environ.get("WORKBOOK_LLAMA_SERVER"):
        return Path(os.environ["WORKBOOK_LLAMA_SERVER"])
    key = hashlib.sha256(f"{LLAMA_CPP_PYTHON} {BUILD_CMAKE_ARGS} {SERVER_CMAKE_ARGS} {cpu_model()}".encode())
    return Path.home() / ".cache" / "prefill-decode-workbook" / "llama-server" / key.hexdigest()[:12] / "llama-server"


def status() -> str:
    """"" when ``llama-server`` can run here, else one line saying why not and what to run."""
    path = binary()
    if path.is_file() and os.access(path, os.X_OK):
        return ""
    if os.environ.get("WORKBOOK_LLAMA_SERVER"):
        return f"$WORKBOOK_LLAMA_SERVER is {path}, which is not an executable file"
    return "llama-server is not built on this machine: `make llama-server` builds it once (4-9 min on 2 cores)"


def ensure_built(log: Path | None = None, timeout_s: float = 3600) -> str:
    """Build ``llama-server`` if it is missing (minutes, once per machine); "" when it is there afterwards,
    else one line saying why not (the build's output is in ``log``). Never raises."""
    if not status():
        return ""
    if os.environ.get("WORKBOOK_LLAMA_SERVER"):
        return status()
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        return "llama-server needs CMake and a C++ compiler to build (e.g. apt-get install cmake g++)"
    log = log or REPO_ROOT / ".cache" / "llama-server-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"Building llama-server from {LLAMA_CPP_PYTHON}'s llama.cpp sources once "
          f"(4-9 minutes on 2 cores; log: {log}) ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        ok = _build(Path(tmp), log, time.monotonic() + timeout_s)
    return status() if ok else f"llama-server did not build (see {log})"


def _build(tmp: Path, log: Path, stop: float) -> bool:
    """Download the source package, unpack its llama.cpp, configure, build the one target, keep the program."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--no-deps",
           "--no-binary", ":all:", "-d", str(tmp), LLAMA_CPP_PYTHON]
    if not _run(pip, log, stop):
        return False
    sdists = sorted(tmp.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        return False
    src = _unpack_llama_cpp(sdists[0], tmp / "src")
    build, jobs = tmp / "build", str(os.cpu_count() or 2)
    if not (_run(["cmake", "-S", str(src), "-B", str(build), *SERVER_CMAKE_ARGS], log, stop)
            and _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], log, stop)):
        return False
    built = build / "bin" / "llama-server"
    if not built.is_file():
        return False
    binary().parent.mkdir(parents=True, exist_ok=True)
    partial = binary().with_suffix(".partial")
    shutil.copy2(built, partial)
    os.replace(partial, binary())  # whole or not at all: a half-copied program never looks built
    return True


def _unpack_llama_cpp(sdist: Path, dest: Path) -> Path:
    """Extract only ``vendor/llama.cpp`` of the source package; its root."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(dest, members=members, filter="data")
    return next(dest.glob("*/vendor/llama.cpp"))


def _run(cmd: list[str], log: Path, stop: float) -> bool:
    try:
        with open(log, "a") as out:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                  timeout=max(stop - time.monotonic(), 1.0))
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ----------------------------------------------------------------------------- one server, started and stopped


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """``llama-server`` on 127.0.0.1 at a free port, serving a GGUF file with ``parallel`` slots.

    ``context_per_slot``: tokens of KV cache per slot (prompt + output of the longest request); the
    server gets ``parallel x`` that. ``threads``: CPU threads for decode and prefill (default:
    ``$OMP_NUM_THREADS``, else every core, as the in-process row). A context manager: it waits until the
    server answers ``/health`` (``start_timeout_s``) and stops it on exit, whatever happened inside.
    """

    EXACT: dict[str, Any] = {"ignore_eos": True, "cache_prompt": False}
    """Request options that make a run comparable: exactly ``max_tokens`` tokens each, and every prompt
    prefilled (no reuse of a slot's cached prefix, which the workbook's loop does not have)."""

    def __init__(self, gguf: Path | None = None, parallel: int = 4, context_per_slot: int = 512,
                 threads: int | None = None, start_timeout_s: float = 120.0) -> None:
        problem = status()
        if problem:
            raise ServerNotAvailable(problem)
        self.gguf = Path(gguf) if gguf else embedded_gguf()
        if not self.gguf.is_file():
            raise WorkbookError(f"llama-server serves a GGUF file; {self.gguf} does not exist.")
        self.parallel = check_count(parallel, "parallel")
        self.context_per_slot = check_count(context_per_slot, "context_per_slot")
        self.threads = threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or (os.cpu_count() or 1)
        self.start_timeout_s = check_number(start_timeout_s, "start_timeout_s", "s")
        self.port = 0
        self._proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        """The server's output: one file per port, as several servers may run at once."""
        return REPO_ROOT / ".cache" / f"llama-server.{self.port}.log"

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL, for :class:`utils.openai_client.Client`."""
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        """The command line it runs (printed by the chapter: the same flags work by hand). Flash attention off,
        as llama.cpp in process runs by default (:mod:`utils.peer`): with it on, the server's attention rounds
        differently and greedy text can part at a near-tie (seen at 128 tokens of prompt)."""
        t = str(self.threads)
        return [str(binary()), "--model", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "--parallel", str(self.parallel), "--ctx-size", str(self.parallel * self.context_per_slot),
                "--threads", t, "--threads-batch", t, "--cont-batching", "--flash-attn", "off", "--no-webui"]

    def __enter__(self) -> "LlamaServer":
        self.port = free_port()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as out:
            self._proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)  # a server that failed to start raised with its last lines, and kept its log

    def _wait_ready(self) -> None:
        """Until ``GET /health`` answers 200 (503 while the model loads); a clear error if it exits or times out."""
        stop = time.monotonic() + self.start_timeout_s
        while time.monotonic() < stop:
            if self._proc is not None and self._proc.poll() is not None:
                raise ServerNotAvailable(f"llama-server exited with code {self._proc.returncode} while starting; "
                                         f"its last lines:\n{self.last_lines()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise ServerNotAvailable(f"llama-server did not answer /health on port {self.port} within "
                                 f"{self.start_timeout_s:.0f} s; its last lines:\n{self.last_lines()}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s); a no-op when it is not running."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def last_lines(self, n: int = 15) -> str:
        """The end of the server's log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def alone_in_turns(client: Client, prompt_ids: Sequence[int], new_tokens: int, *, repeats: int = 3,
                   threads: int | None = None) -> tuple[StreamSpeed, PeerResult]:
    """One request at a time to the server over HTTP, and the same prompt to llama.cpp in process, in turns.

    Each is warmed up once, then ``repeats`` rounds of one request each way (:data:`LlamaServer.EXACT`), so a slow
    spell of the machine weighs on both alike and their decode tok/s round by round compare the engines, not two
    moments (:data:`HTTP_BAND`). ``threads``: the in-process run's, as the server's by default.
    """
    check_count(repeats, "repeats")
    local, served, runs = LlamaCppRequest(prompt_ids, new_tokens, threads), [], []
    try:
        client.complete(list(prompt_ids), new_tokens, **LlamaServer.EXACT)
        timed_run(local)
        for _ in range(repeats):
            served.append(client.complete(list(prompt_ids), new_tokens, **LlamaServer.EXACT))
            runs.append(timed_run(local))
        return StreamSpeed(tuple(served)), peer_result(local, runs)
    finally:
        local.close()


def _main() -> None:
    """``python -m utils.llama_server --build``: build it now if missing (what ``make llama-server`` runs)."""
    if "--build" in sys.argv[1:]:
        why = ensure_built()
        print(f"llama-server: {why or binary()}")
        sys.exit(0)
    print(f"llama-server: {status() or binary()}")


if __name__ == "__main__":
    _main()

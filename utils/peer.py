"""llama.cpp, the peer engine local users run, on the embedded GGUF file itself.

Optional: it needs ``llama-cpp-python``, which has no wheel on PyPI and builds from
source (about 4-6 minutes on 2 cores). :func:`ensure_installed` installs it on first use
(``make bench`` calls it); the learner's setup does not need it. The wheel it builds is
kept once per machine (:func:`wheel_dir`) so a second install, in any clone, takes seconds. When it is missing or fails
to build, :func:`peer_status` says why and the benchmark prints that in llama.cpp's row.

The build turns off AMX: inside some sandboxes the kernel refuses the AMX tile state, and
ggml's AMX matmul then dies with a segmentation fault (seen on a 2-core Xeon VM). AVX-512
and its bf16/VNNI extensions stay on when the CPU has them (``GGML_NATIVE``).

:func:`llama_cpp_speed` times llama.cpp the way :func:`utils.engine.decode_speed` times
ours: the same prompt token ids, an untimed warm-up, then prefill tok/s and greedy decode
tok/s (tokens after the first ÷ their time), with the tokens it made, so agreement with our
loops can be stated. llama.cpp runs the Q4_1 weights as stored (4-bit, activations in 8
bits); our models run them de-quantized, so the tokens can differ: the agreement is a
figure, not a check.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .models import REPO_ROOT, cache_dir, embedded_gguf

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
BUILD_CMAKE_ARGS = ("-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON "
                    "-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
                    "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'")


def installed() -> bool:
    """True when ``llama_cpp`` can be imported in this environment."""
    return importlib.util.find_spec("llama_cpp") is not None


def wheel_dir() -> Path:
    """Where the built wheel is kept: one per machine, not per checkout, so a fresh clone reuses it.

    ``$WORKBOOK_WHEEL_DIR``, else ``~/.cache/prefill-decode-workbook/wheels/<key>``, the key naming
    the CMake flags and this CPU (``GGML_NATIVE`` builds for the CPU it runs on).
    """
    if os.environ.get("WORKBOOK_WHEEL_DIR"):
        return Path(os.environ["WORKBOOK_WHEEL_DIR"])
    key = hashlib.sha256(f"{LLAMA_CPP_PYTHON} {BUILD_CMAKE_ARGS} {cpu_model()}".encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "prefill-decode-workbook" / "wheels" / key


def cpu_model() -> str:
    """The CPU's model name and flags as Linux reports them ("" elsewhere): what a native build targets."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    pick = lambda key: next((line for line in info.splitlines() if line.startswith(key)), "")  # noqa: E731
    return pick("model name") + pick("flags")


def ensure_installed(log: Path | None = None, timeout_s: float = 1800) -> str:
    """Install llama-cpp-python if it is missing: from the cached wheel, else build it (minutes; never
    from pip's own wheel cache, which could hold a build made without these CMake flags).

    Returns "" when it is importable afterwards, else one line saying why not (the build's
    last lines are in ``log``). Never raises: a missing peer must not stop the benchmark.
    """
    if installed():
        return ""
    wheel_dir().mkdir(parents=True, exist_ok=True)
    log = log or cache_dir() / "llama-cpp-build.log"
    cached = sorted(glob.glob(str(wheel_dir() / "llama_cpp_python-0.3.36-*.whl")))
    if not cached:
        print(f"Building {LLAMA_CPP_PYTHON} from source once (4-6 minutes on 2 cores; log: {log}) ...", flush=True)
        env = {**os.environ, "CMAKE_ARGS": BUILD_CMAKE_ARGS,
               "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
        if not _pip(["wheel", "--no-deps", "--no-cache-dir", "-w", str(wheel_dir()), LLAMA_CPP_PYTHON], env, log, timeout_s):
            return f"llama-cpp-python did not build (see {log})"
        cached = sorted(glob.glob(str(wheel_dir() / "llama_cpp_python-0.3.36-*.whl")))
    if not cached or not _pip(["install", cached[-1]], dict(os.environ), log, timeout_s):
        return f"llama-cpp-python did not install (see {log})"
    importlib.invalidate_caches()
    return "" if installed() else "llama-cpp-python installed but does not import"


def _pip(args: list[str], env: dict[str, str], log: Path, timeout_s: float) -> bool:
    try:
        with open(log, "a") as out:
            done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                                  env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  cwd=REPO_ROOT)
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class PeerResult:
    """llama.cpp on one prompt: speeds (medians of the repeats) and the greedy tokens it made."""

    engine: str
    weights: str
    prompt_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    threads: int
    tokens: list[int] = field(default_factory=list)
    decode_samples_s: list[float] = field(default_factory=list)
    text: str = ""  # the tokens as llama.cpp detokenizes them (what its server would stream)


class LlamaCppRequest:
    """llama.cpp loaded on a GGUF file (default: the embedded one) for one prompt: :meth:`prefill` evaluates the
    prompt on a reset context and returns the first greedy token, :meth:`decode` makes the ``new_tokens - 1``
    after it, one evaluation each; the pair is what :func:`llama_cpp_speed` times (and
    :func:`utils.timing.interleaved` can time in turns with another engine). :meth:`close` frees it."""

    def __init__(self, prompt_ids: Sequence[int], new_tokens: int, threads: int | None = None,
                 gguf: Path | None = None) -> None:
        from llama_cpp import Llama as LlamaCpp  # optional dependency: imported only when used

        self.path, self.prompt, self.new_tokens = gguf or embedded_gguf(), list(prompt_ids), new_tokens
        self.threads = threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or (os.cpu_count() or 1)
        self.llm = LlamaCpp(model_path=str(self.path), n_ctx=len(self.prompt) + new_tokens + 8, n_batch=512,
                            n_threads=self.threads, n_threads_batch=self.threads, verbose=False, seed=0)

    def prefill(self) -> int:
        self.llm.reset()
        self.llm.eval(self.prompt)
        return _greedy(self.llm)

    def decode(self, first: int) -> list[int]:
        tokens = [first]
        for _ in range(self.new_tokens - 1):
            self.llm.eval([tokens[-1]])
            tokens.append(_greedy(self.llm))
        return tokens

    def close(self) -> None:
        self.llm.close()


def llama_cpp_speed(prompt_ids: Sequence[int], new_tokens: int, *, repeats: int = 3, threads: int | None = None,
                    gguf: Path | None = None) -> PeerResult:
    """Prefill ``prompt_ids`` then decode ``new_tokens`` greedy tokens with llama.cpp, timed.

    One untimed warm-up, then ``repeats`` timed runs on a reset context; the medians.
    """
    request = LlamaCppRequest(prompt_ids, new_tokens, threads, gguf)
    try:
        timed_run(request)  # the first run warms up
        return peer_result(request, [timed_run(request) for _ in range(repeats)])
    finally:
        request.close()


def timed_run(request: LlamaCppRequest) -> tuple[float, float, list[int]]:
    """One prefill and decode of ``request`` on a reset context: (prefill seconds, decode seconds, tokens)."""
    t0 = time.perf_counter()
    first = request.prefill()
    t1 = time.perf_counter()
    tokens = request.decode(first)
    return t1 - t0, time.perf_counter() - t1, tokens


def peer_result(request: LlamaCppRequest, runs: Sequence[tuple[float, float, list[int]]]) -> PeerResult:
    """The medians of ``request``'s timed runs (:func:`timed_run`), its last run's tokens and their text."""
    prefills, decodes, tokens = [r[0] for r in runs], [r[1] for r in runs], runs[-1][2]
    text = request.llm.detokenize(tokens).decode("utf-8", errors="replace")
    return PeerResult("llama.cpp " + _version(), request.path.name.split(".")[-2], len(request.prompt),
                      len(request.prompt) / statistics.median(prefills),
                      (request.new_tokens - 1) / statistics.median(decodes), request.threads, tokens, decodes, text)


def _greedy(llm: "object") -> int:
    """The argmax of the logits of the last token llama.cpp evaluated (read in place, no copy)."""
    import numpy as np

    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))  # type: ignore[attr-defined]
    return int(logits.argmax())


def _version() -> str:
    try:
        import llama_cpp

        return str(llama_cpp.__version__)
    except ImportError:
        return "?"

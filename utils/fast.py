"""The fast path: decode near the bandwidth ceiling with stock PyTorch.

Why eager decode misses its ceiling on a small model: one decode step reads every
weight once, but in eager mode it also pays, for each of a few hundred small ops,
Python, the dispatcher, an allocation and (on a CPU) the start of a parallel region.
For a 135 M model those fixed costs are as large as the reading itself. The cure is
to do less per step, in this order (each is a row of the roofline lab's table):

1. **A static KV cache and a hot loop.** The cache is allocated once, sized to the
   request (prompt + new tokens, rounded up to :data:`BUCKET` slots), and every step
   attends over all its slots (the unfilled ones masked), so a step's shapes never
   change. The loop keeps the position as a device tensor advanced in place, picks
   the greedy token inside the step, and writes it into a preallocated output: no
   allocation, no host sync and no Python work per step beyond the call.
2. **A smaller dtype** (bf16; fp16 on GPUs): half the bytes to read.
3. **Compile the one-token step** (:func:`compile_step`): the whole step becomes a few fused
   kernels. On a CPU inductor's *freezing* treats the weights as constants (pre-packed
   once; not for a model whose projections all call the workbook's own kernels) and the step is compiled ahead of time into a package (:class:`PackagedStep`,
   AOTInductor): built once per machine, model and cache shape, kept on disk and loaded in
   about a second by every later process; its C++ wrapper calls the kernels without Python
   in between. Where every projection calls the workbook's own kernels (nothing to pre-pack), one group
   of a few blocks is compiled instead of the whole step and called once per group, bound to that group's
   weights and cache (:class:`LayeredStep`): seconds to build instead of half a minute.
   On a GPU, ``torch.compile`` with CUDA graphs replays the whole step with one
   launch. Either way it compiles **once per cache shape**: everything the step reads is a
   tensor or a constant of that shape (:class:`DecodeStep`), so nothing in it changes from
   step to step and nothing recompiles (:func:`compile_count` counts, :func:`explain_recompiles`
   shows dynamo's reasons).
4. **Weight-only int8 / int4 kernels** (:mod:`utils.quant`): fewer bytes again; on a CPU the workbook's own
   (:mod:`utils.cpu_quant`), which read them faster than PyTorch's for decode's one row. Float32 and bf16 weights
   have one too (:mod:`utils.cpu_linear`: on a CPU with AMX, bf16 through its tile unit): a model on it has nothing
   to pre-pack, so its step is built by layer groups as well.

:meth:`FastDecoder.generate` runs a request (prefill eager, decode through the possibly
compiled step) and returns the same greedy tokens as :func:`utils.engine.generate` in the same dtype; :func:`fast_decode_speed` times its
decode loop the way :func:`utils.engine.decode_speed` times the eager one. Each of them measured is a row of
the roofline table (:mod:`utils.decode_table`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import re
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_attention, cpu_extension, cpu_linear, cpu_quant, llama, llama_phases, quant
from .engine import PhaseResult
from .errors import WorkbookError, check_prompt_length, check_token_count
from .llama import KVCache, Llama, iter_linears
from .timing import measure, profile_self_time, synchronize

BUCKET = 256
"""Static caches are rounded up to a multiple of this many slots, so requests of similar
length share one compiled step (a 128-token prompt + 64 new tokens -> 256 slots)."""


DECODERS_PER_PROCESS = 64
"""Compiled decoders one process may hold (dynamo's per-code limit is raised to this; the default is 8)."""


def static_length(prompt_tokens: int, new_tokens: int, bucket: int = BUCKET) -> int:
    """Slots of the static cache for a request: ``prompt + new`` rounded up to ``bucket``."""
    need = prompt_tokens + new_tokens
    return -(-need // bucket) * bucket


# ----------------------------------------------------------------------------- the step


@torch.compiler.assume_constant_result  # a compiled step asks once, while tracing, and keeps the answer
def cpu_pick_available() -> bool:
    """True when :func:`greedy_pick` can use the workbook's kernel on a CPU (``csrc/decode_pick.cpp``): the kernels
    are built (:func:`utils.cpu_extension.load`) and ``$WORKBOOK_CPU_PICK`` is not ``0`` (PyTorch's argmax, to
    compare)."""
    return os.environ.get("WORKBOOK_CPU_PICK") != "0" and cpu_extension.load()


def greedy_pick(logits: Tensor) -> Tensor:
    """The next token of each sequence, greedy: ``logits [B, T, V]`` -> the argmax of the last position, ``[B]``.

    On a CPU the workbook's kernel answers (``torch.ops.workbook.greedy_argmax``, the same index as ``argmax``):
    PyTorch's argmax, eager or compiled, compares one logit at a time, 137 µs of a ~12 ms bf16 step over SmolLM2's
    49,152 logits on a 2-core Xeon; the kernel, vectorized, ~9 µs. GPUs keep ``argmax``.
    """
    last = logits[:, -1]  # [B, V]
    if (last.device.type == "cpu" and last.dtype in cpu_attention.KERNEL_DTYPES and last.stride(-1) == 1
            and cpu_pick_available()):
        return torch.ops.workbook.greedy_argmax(last)
    return last.argmax(dim=-1)


class DecodeStep(nn.Module):
    """One greedy decode step of ``model`` over one static ``cache``.

    ``forward(token [B, 1], slot [1]) -> next token [B]``. It writes the token's K/V at
    ``slot``, attends over all ``cache.max_len`` slots (a mask hides the unfilled ones)
    and takes the argmax inside the step, so only a [B] tensor leaves it. Every input
    is a tensor of a fixed shape and ``kv_len`` is a constant: a compiled copy of this
    module compiles once and is replayed for every token of every request that fits.
    """

    def __init__(self, model: Llama, cache: KVCache) -> None:
        super().__init__()
        self.model, self.cache, self.kv_len = model, cache, cache.max_len

    def forward(self, token: Tensor, slot: Tensor) -> Tensor:
        return greedy_pick(self.model(token, slot, self.cache, self.kv_len))  # [B, 1, V] -> [B]


def compile_options(device: torch.device, mode: str | None = None) -> dict[str, Any]:
    """The ``torch.compile`` arguments for a decode step on ``device``.

    GPU: ``reduce-overhead`` (CUDA graphs: the whole step is one launch). CPU:
    ``max-autotune-no-cudagraphs``: inductor times its own C++ GEMM templates against oneDNN's
    pre-packed linear for each projection and keeps the faster (on a 2-core Xeon: bf16 54.9
    tok/s against 38.9 with ``default``, int4 95.2 against 57.1, in about the same compile
    time, tokens identical). ``$WORKBOOK_COMPILE_MODE`` or ``mode`` overrides, e.g. ``default``.

    Under ``ATEN_CPU_CAPABILITY`` (a plainer CPU imitated, e.g. ``avx2``) a CPU gets ``default``: inductor's
    vector code then follows the imitated ISA while its GEMM templates still pick the real CPU's, and the
    two do not compile together (torch 2.13: ``cvtbf16_fp32(__m512i&, ...)`` in an AVX2 kernel).
    """
    imitated = device.type == "cpu" and bool(os.environ.get("ATEN_CPU_CAPABILITY"))
    chosen = mode or os.environ.get("WORKBOOK_COMPILE_MODE") or (
        "reduce-overhead" if device.type == "cuda" else "default" if imitated else "max-autotune-no-cudagraphs")
    return {"mode": chosen, "fullgraph": True, "dynamic": False}


def cpu_gemm_backends(model: Llama) -> str | None:
    """The GEMM kernels max-autotune may pick from for ``model``'s step on this CPU: ``"CPP"`` (inductor's own C++
    templates only) for float weights on a 512-bit CPU; None (inductor's default) otherwise.

    By default inductor times its templates against ATen's oneDNN linear for each projection and keeps the faster.
    A decode row is a matrix-vector product of a few microseconds, and on a 2-core machine that timing is noisy;
    the pick is cached on disk and reused by every later compile, so one noisy pick sticks. Measured on a 2-core
    Xeon (AVX-512, AMX), compiled bf16 at 128 tokens, greedy tokens equal in all: 65 tok/s with the picks cached
    by earlier runs, 74-78 with a fresh cache, 74-78 with the templates only, 52 with oneDNN only; in one process
    beside transformers: 2.70x transformers bf16 with the templates only, 2.30x with the default. int8 weights did
    not gain (4.0x against 4.3x), and a 256-bit CPU was not measured: both keep the default.
    """
    from torch._inductor import cpu_vec_isa

    float_weights = all(type(m) is nn.Linear and m.weight.is_floating_point() for _, m in iter_linears(model))
    wide = cpu_vec_isa.pick_vec_isa().bit_width() >= 512 and not os.environ.get("ATEN_CPU_CAPABILITY")
    chosen = os.environ.get("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS")
    return None if chosen or not (wide and float_weights) else "CPP"


def _first_call_with(fn: Callable[..., Tensor], **config: Any) -> Callable[..., Tensor]:
    """``fn`` whose first call (the one that compiles) runs under inductor ``config``."""
    import torch._inductor.config as inductor_config

    state = {"compiled": False}

    def run(*args: Any) -> Tensor:
        if state["compiled"]:
            return fn(*args)
        with inductor_config.patch(**config):
            out = fn(*args)
        state["compiled"] = True
        return out

    return run


def has_weights_to_pack(model: Llama) -> bool:
    """False when every projection of ``model`` calls the workbook's own kernels (:mod:`utils.cpu_quant`): then
    freezing has nothing to pre-pack, and a step compiles without it. Measured on a 2-core AVX-512 EPYC, int4 g32 +
    int8 head at 128 tokens, alternating runs: 37-39 s to build with freezing, 31-33 s without, at the same speed
    (136-155 against 147-163 tok/s)."""
    return not all(getattr(m, "kernel", "") == "workbook" and getattr(m, "use_kernel", False)
                   for _, m in iter_linears(model))


def compiles_by_layer(model: Llama, by_layer: bool | None = None) -> bool:
    """Whether a CPU step of ``model`` is a :class:`LayeredStep` (one group of blocks compiled, called per group): where
    nothing has to be pre-packed (:func:`has_weights_to_pack`) and every block has the same shapes, unless
    ``by_layer=False`` asks for the whole step (:class:`PackagedStep`), e.g. to compare the two."""
    return by_layer is not False and not has_weights_to_pack(model) and layers_alike(model)


def inductor_settings(step: DecodeStep, mode: str | None = None) -> dict[str, Any]:
    """The inductor settings a decode step compiles under on its device (see :func:`compile_step`)."""
    cpu = step.cache.device.type == "cpu"
    chosen = compile_options(step.cache.device, mode)["mode"]
    gemms = cpu_gemm_backends(step.model) if cpu and chosen.startswith("max-autotune") else None
    freezing = cpu and has_weights_to_pack(step.model)
    settings: dict[str, Any] = {"emulate_precision_casts": True, "freezing": freezing, "autotune_num_choices_displayed": 0,
                                "max_autotune_report_choices_stats": False}
    if cpu:  # a packaged step (PackagedStep) takes the mode as settings; torch.compile takes it as ``mode``
        settings["max_autotune"] = chosen.startswith("max-autotune")
    if gemms:
        settings["max_autotune_gemm_backends"] = gemms
    return settings


def compile_step(step: DecodeStep, mode: str | None = None, backend: str = "inductor",
                 by_layer: bool | None = None) -> Callable[..., Tensor]:
    """The compiled :class:`DecodeStep` (whole graph, static shapes): a :class:`PackagedStep` on a CPU, else
    ``torch.compile``.

    Inductor on a CPU turns on *freezing* (weights become constants: pre-packed once) where there is something to
    pack (:func:`has_weights_to_pack`). Everywhere it
    rounds every intermediate to the dtype as eager does (``emulate_precision_casts``): a fused bf16 kernel
    that kept float32 in between would change greedy tokens after a few dozen, and the fast path must make
    the eager loop's tokens. ``backend="eager"`` traces with dynamo without generating code: what a unit
    test of the compile count needs, in a second instead of a minute. ``$WORKBOOK_STEP_PACKAGES=0`` makes a
    CPU use ``torch.compile`` too. On a CPU the step is built by layer groups (:class:`LayeredStep`) where
    :func:`compiles_by_layer` says so; ``by_layer=False`` builds the whole step instead (to compare).
    """
    settings = inductor_settings(step, mode) if backend == "inductor" else {}
    if backend == "inductor" and step.cache.device.type == "cpu" and os.environ.get("WORKBOOK_STEP_PACKAGES") != "0":
        return (LayeredStep if compiles_by_layer(step.model, by_layer) else PackagedStep)(step, settings)
    # Every decoder is its own graph of the same code (DecodeStep.forward): a lab or benchmark that
    # builds one per model, dtype and context must not run into dynamo's limit of 8 per code.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, DECODERS_PER_PROCESS)
    options = compile_options(step.cache.device, mode)
    if backend != "inductor":
        options.pop("mode")
    import torch._inductor.config as inductor_config

    gemms = settings.pop("max_autotune_gemm_backends", None)
    settings.pop("max_autotune", None)
    for name, value in settings.items():
        setattr(inductor_config, name, value)
    compiled = torch.compile(step, backend=backend, **options)
    return _first_call_with(compiled, max_autotune_gemm_backends=gemms) if gemms else compiled


# ----------------------------------------------------------------------------- packaged steps (CPU)


STEP_CACHE_GB = 4.0
"""Disk the packaged steps may fill (the least recently used go first); ``$WORKBOOK_STEP_CACHE_GB`` overrides."""

_STEPS_PACKAGED = 0  # packaged steps built or loaded in this process (compile_count counts them)

PACKAGE_SETTINGS: dict[str, Any] = {"aot_inductor.compile_wrapper_opt_level": "O0"}
"""Inductor settings a packaged step adds to :func:`inductor_settings`. Its C++ wrapper (a ~5,000-line list of
kernel calls) compiles at -O0 instead of -O1: 3.4 s instead of 6.1 s on a 2-core Xeon, at the same speed
(bf16 110 against 111 tok/s, int4 211 against 212; the kernels themselves keep -O3)."""


PART_SETTINGS: dict[str, Any] = {"aot_inductor.compile_wrapper_opt_level": "O1",
                                 "aot_inductor.package_constants_in_so": False, "compile_threads": 1}
"""Inductor settings the layer groups and the head of a :class:`LayeredStep` add.

A group is called several times per step, and its wrapper compiled at -O0 spent much of a call in unoptimized C++
helpers (2-core AVX-512 EPYC, int4 at 128 tokens, groups of 5, alternating runs: 138 tok/s at -O0 against 146 for
the whole step; in a later run 149.5 at -O1 against 152.4). A small wrapper compiles in ~5 s at either level
(headers dominate), so the head compiles at -O1 too: inductor's precompiled header is built with optimization
and a -O0 compile cannot use it. No pool of compile workers (``compile_threads``): AOTInductor compiles a part's
kernels as one file, and on 2 cores the pool's start (processes importing torch) ran beside the first build's
compiles. Measured on a 2-core EPYC, float32 @1,024, a cold build in a new process: 32.8 s as before, 20.7 s
with both (the wrappers' compiles 7.3 + 11.0 s -> 4.8 + 5.5 s)."""


def step_cache_dir() -> Path:
    """Where packaged steps are kept: ``$WORKBOOK_STEP_CACHE``, else ``~/.cache/prefill-decode-workbook/steps``."""
    chosen = os.environ.get("WORKBOOK_STEP_CACHE")
    return Path(chosen) if chosen else Path.home() / ".cache" / "prefill-decode-workbook" / "steps"


def _this_cpu() -> str:
    """This CPU's instruction sets (a package's kernels use them), the ISA torch dispatches to and the threads
    (max-autotune's picks were timed with them)."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "") \
        if Path("/proc/cpuinfo").exists() else ""
    return (f"{torch.backends.cpu.get_cpu_capability()} {os.environ.get('ONEDNN_MAX_CPU_ISA', '')} "
            f"{torch.get_num_threads()} {flags}")


def _code_key(module: nn.Module, settings: dict[str, Any]) -> "hashlib._Hash":
    """A hash of what any package depends on besides its tensors: torch, this CPU, the code of the model and of
    ``module``'s class, the settings (with inductor's own ``TORCHINDUCTOR_*`` variables, e.g. the GEMM backends a
    user picked, but not where its cache lives: inductor writes that variable itself when its cache module is first
    imported, so a key taken before that differed from one taken after) and which kernels it calls (the workbook's
    CPU kernels, named by their sources, or PyTorch's)."""
    h = hashlib.blake2b(digest_size=16)
    inductor_env = sorted((k, v) for k, v in os.environ.items()
                          if k.startswith("TORCHINDUCTOR_") and k != "TORCHINDUCTOR_CACHE_DIR")  # where, not what
    kernel = (f"{cpu_extension.library_path().name} attention={cpu_attention.available()} quant={cpu_quant.available()}"
              f" pick={cpu_pick_available()}" if cpu_extension.load() else "pytorch kernels")
    for part in (torch.__version__, _this_cpu(), kernel, inspect.getsource(llama), inspect.getsource(quant),
                 inspect.getsource(type(module)), repr(sorted(settings.items())), repr(inductor_env)):
        h.update(part.encode())
    return h


def step_key(step: DecodeStep, settings: dict[str, Any]) -> str:
    """What a packaged step depends on (:func:`_code_key`), the cache's shapes and every weight's bytes (the
    package holds the weights, pre-packed). Not the cache's contents."""
    h = _code_key(step, settings)
    for name, t in [*step.named_parameters(), *step.named_buffers()]:
        h.update(f"{name} {tuple(t.shape)} {t.dtype}".encode())
        if not name.startswith("cache."):
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def package_step(step: nn.Module, example: tuple[Tensor, ...], settings: dict[str, Any], path: Path) -> None:
    """Export ``step`` (a :class:`DecodeStep` or a part of a :class:`LayeredStep`) and compile it ahead of time (AOTInductor)
    into the package ``path``."""
    package_steps([(step, example, path)], settings)


def package_steps(jobs: list[tuple[nn.Module, tuple[Tensor, ...], Path]], settings: dict[str, Any]) -> None:
    """:func:`package_step` for each ``(step, example, path)`` of ``jobs``: exported in turn, then compiled side by
    side, one thread each (one job: in this thread).

    Why: most of a package's build is its C++ compile (g++ runs while Python waits), and a :class:`LayeredStep`
    builds two, its group's and its head's: side by side, the head's C++ compiles on the second core while the
    group's code is generated and compiled. Only the compilers run at the same time: the Python of a build (export,
    code generation) keeps module-level state of torch's, so the builds take turns there (:func:`compilers_side_by_side`).
    Inductor keeps its settings per thread (each build applies ``settings`` in its own)."""
    partials = [path.parent / "building" / f"{path.stem}.{os.getpid()}.pt2" for _, _, path in jobs]
    for partial in partials:
        partial.parent.mkdir(parents=True, exist_ok=True)
    with (torch.inference_mode(False), torch.no_grad(), templates_parsed_once(), laid_out_not_copied(),
          torch_notice_hidden()):
        programs = [torch.export.export(step, example, strict=False) for step, example, _ in jobs]

        def compile_one(program: Any, partial: Path) -> None:
            with python_turn(), torch.no_grad():  # grad mode is per thread
                # a copy: inductor adds its own entries to the dict it is handed, and ``settings`` keys later packages
                torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=dict(settings))

        if len(jobs) == 1:  # in this thread, as a whole step always was
            compile_one(programs[0], partials[0])
        else:
            with compilers_side_by_side(), ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                for done in [pool.submit(compile_one, program, partial) for program, partial in zip(programs, partials)]:
                    done.result()  # raises what the compile raised
    for partial, (_, _, path) in zip(partials, jobs):
        partial.replace(path)  # whole or not at all: another process may be reading the same key
    keep_recent_packages(jobs[0][2].parent, float(os.environ.get("WORKBOOK_STEP_CACHE_GB", STEP_CACHE_GB)) * 1e9)
    keep_recent_headers()


_PYTHON_TURN = threading.Lock()  # held by the build whose Python runs (package_steps)
_HOLDS_TURN = threading.local()


@contextmanager
def python_turn() -> Iterator[None]:
    """Within this block this thread's Python runs only while no other build's does (:func:`package_steps`);
    :func:`compilers_side_by_side` hands the turn on while this thread waits for a compiler."""
    with _PYTHON_TURN:
        _HOLDS_TURN.held = True
        try:
            yield
        finally:
            _HOLDS_TURN.held = False


@contextmanager
def compilers_side_by_side() -> Iterator[None]:
    """Within this block a build that holds :func:`python_turn` hands it on while the C++ compiler makes its package's
    wrapper or kernels (``*.wrapper.o``, ``*.kernel.o``: most of its build), and takes it back after: another build's
    Python runs meanwhile. Other compiles keep the turn: inductor builds a precompiled header, or checks what the CPU
    can do, holding a file lock that the other build may wait for, and one waiting with the turn would never get it
    back. A torch without inductor's ``_run_compile_cmd`` is left as it is (the builds then take turns whole)."""
    from torch._inductor import cpp_builder

    original = getattr(cpp_builder, "_run_compile_cmd", None)
    if original is None:
        yield
        return

    def run(cmd_line: str, cwd: str) -> None:
        if not getattr(_HOLDS_TURN, "held", False) or not re.search(r"-o\s+\S+\.(wrapper|kernel)\.o(\s|$)", cmd_line):
            return original(cmd_line, cwd)
        _HOLDS_TURN.held = False
        _PYTHON_TURN.release()
        try:
            return original(cmd_line, cwd)
        finally:
            _PYTHON_TURN.acquire()
            _HOLDS_TURN.held = True

    cpp_builder._run_compile_cmd = run
    try:
        yield
    finally:
        cpp_builder._run_compile_cmd = original


@contextmanager
def torch_notice_hidden() -> Iterator[None]:
    """Within this block torch's own deprecation notice about its pytree specs (``isinstance(treespec, LeafSpec)``,
    raised by torch's code when it exports, copies or loads a step: one per package in a lab's output, and nothing a
    learner can change) is not shown. Every other warning is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)
        yield


def load_package(path: Path) -> Any:
    """The AOTInductor package at ``path``, loaded (``torch._inductor.aoti_load_package``).

    The loader unpacks the package into a folder of the temp dir (``aotinductor_XXXXXX``) and removes it only
    when the loader is destroyed, which a kernel killed at exit never does: every lab run left one (~130 of
    them on a machine after a week). The folder is needed only while loading (the library is mapped by then),
    so it is made inside a folder of our own that goes as soon as the package is loaded."""
    tempfile.gettempdir()  # Python's own temp dir settled first, so that it never becomes the folder below
    with tempfile.TemporaryDirectory(prefix="workbook-package-") as unpack, torch_notice_hidden():
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = unpack  # where the loader's C++ (std::filesystem::temp_directory_path) unpacks
        try:
            return torch._inductor.aoti_load_package(str(path))
        finally:
            if before is None:
                del os.environ["TMPDIR"]
            else:
                os.environ["TMPDIR"] = before


@contextmanager
def laid_out_not_copied() -> Iterator[None]:
    """Within this block inductor does not copy a weight laid out by thread (:func:`utils.cpu_linear.is_laid_out`)
    when it compiles a graph ahead of time.

    Inductor copies every buffer of such a graph first (``clone_preserve_strides``: a buffer the graph writes, such
    as a KV cache, keeps its first values), with its strides: a projection's copy laid out by thread spans its whole
    thread buffer (a float32 one ~270 MB), and a float32 group of five blocks copied ~5 GB (2.2 s of its build on a
    2-core EPYC). No step writes those, so they are handed on as they are. A torch without that function is left
    as it is."""
    from torch._inductor import compile_fx

    original = getattr(compile_fx, "clone_preserve_strides", None)
    if original is None:
        yield
        return
    compile_fx.clone_preserve_strides = lambda t: t if cpu_linear.is_laid_out(t) else original(t)
    try:
        yield
    finally:
        compile_fx.clone_preserve_strides = original


@contextmanager
def templates_parsed_once() -> Iterator[None]:
    """Within this block inductor parses each distinct kernel template once.

    Inductor renders its C++ GEMM template (and the micro-kernel templates inside it) twice for each of the
    ~120 projections of a 30-layer step, and parses the template's jinja2 source again every time
    (``KernelTemplate._template_from_string``: ``from_string`` keeps no cache): on a 2-core Xeon ~9 s of a
    45 s build (bf16 44.5 -> 35.1 s, tokens and speed unchanged). A parsed template renders the same however
    often it is reused. A torch without that method is left as it is.
    """
    from torch._inductor.codegen.common import KernelTemplate

    parse = KernelTemplate.__dict__.get("_template_from_string")
    if not isinstance(parse, staticmethod):
        yield
        return
    KernelTemplate._template_from_string = staticmethod(functools.lru_cache(maxsize=None)(parse.__func__))
    try:
        yield
    finally:
        KernelTemplate._template_from_string = parse


def keep_recent_packages(folder: Path, max_bytes: float) -> None:
    """Remove the least recently used packages in ``folder`` until they fit in ``max_bytes`` (the newest stays)."""
    packages = sorted(folder.glob("*.pt2"), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in packages)
    for old in packages[:-1]:
        if total <= max_bytes:
            break
        total -= old.stat().st_size
        old.unlink(missing_ok=True)


HEADERS_KEPT = 4
"""Inductor's precompiled headers kept (~140-155 MB each): one per set of compile flags and include paths, so four
serve one environment on this CPU and on an imitated AVX2 one (the C++ prefix of its kernels, the AOT wrapper's)."""


def keep_recent_headers(folder: Path | None = None, keep: int = HEADERS_KEPT) -> list[Path]:
    """Remove all but the ``keep`` most recently used of inductor's precompiled headers (``*.gch`` in ``folder``,
    default inductor's own); returns those removed.

    Inductor keeps them in one folder under the temp dir whatever ``TORCHINDUCTOR_CACHE_DIR`` says, builds one per
    set of flags and include paths (each new environment, e.g. a fresh clone's ``.venv``, and each imitated CPU makes
    new ones) and never removes any: on a 2-core Xeon, 11 of them (1.5 GB) after a few days of runs. The rest of
    inductor's cache is left where inductor puts it (the temp dir: a reboot may clear it; a fresh clone on the same
    machine reuses it). Called after each package a step builds. A removed header is rebuilt the next time its
    flags are used; the small ``.h`` beside it stays, so a compile running meanwhile reads the header's text."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    def last_used(p: Path) -> float:
        try:
            st = p.stat()
        except OSError:  # removed meanwhile by another process
            return 0.0
        return max(st.st_atime, st.st_mtime)

    folder = folder or Path(default_cache_dir()) / "precompiled_headers"
    old = sorted(folder.glob("*.gch"), key=last_used, reverse=True)[keep:]
    for header in old:
        header.unlink(missing_ok=True)
    return old


class _OneKernel(nn.Module):
    """One element-wise kernel: the graph :func:`build_headers` packages."""

    def forward(self, x: Tensor) -> Tensor:
        return x * 2 + 1


def build_headers() -> float:
    """Build inductor's precompiled headers for this environment (its compiler flags, include paths and CPU), and run
    its checks of what the CPU can do, by packaging a one-kernel graph with a layered step's settings; returns the
    seconds taken.

    Inductor builds them once per environment, at its first package, and keeps them (:func:`keep_recent_headers`):
    ~9 s on a 2-core EPYC that the first step built would otherwise count as its own (a fresh clone's first step
    took 19.9 s, the next 11 s). The benchmark builds them before its steps and prints their time apart. Where they
    exist already, this costs the small package's own compile (~5 s)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="workbook-headers-") as folder:
        package_steps([(_OneKernel(), (torch.ones(4, 16),), Path(folder) / "headers.pt2")], dict(PART_SETTINGS))
    return time.perf_counter() - start


class PackagedStep:
    """A :class:`DecodeStep` compiled ahead of time with AOTInductor, kept on disk, loaded in a second.

    ``torch.compile`` compiles a step again in every process: its on-disk cache cannot hold the oneDNN
    weights that freezing pre-packs (torch 2.13: "mkldnn tensors unpickleable"), so a learner waits ~40 s per
    variant each time. A package is built once per machine, model, weights and cache shape
    (:func:`step_key`) and loaded by every later process. Its C++ wrapper also calls the kernels without
    Python in between: on a 2-core Xeon the same bf16 step decodes ~1.3x faster than ``torch.compile``'s.
    The package holds the weights; the cache's buffers are bound to this step's own (prefill writes them,
    the step reads and writes them in place). ``source`` says whether the first call "built" or "loaded" it.
    """

    def __init__(self, step: DecodeStep, settings: dict[str, Any]) -> None:
        self.step, self.settings = step, {**settings, **PACKAGE_SETTINGS}
        self.runner: Any = None
        self.source = ""

    def __call__(self, token: Tensor, slot: Tensor) -> Tensor:
        if self.runner is None:
            self.load(token, slot)
        return self.runner(token, slot)

    def load(self, token: Tensor, slot: Tensor) -> None:
        global _STEPS_PACKAGED
        path = step_cache_dir() / f"{step_key(self.step, self.settings)}.pt2"
        self.source = "loaded" if path.exists() else "built"
        if not path.exists():
            with torch.inference_mode(False):
                example = (torch.zeros(token.shape, dtype=token.dtype), slot.clone())
            package_step(self.step, example, self.settings, path)
        path.touch()  # recently used
        self.runner = load_package(path)
        own = dict(self.step.cache.named_buffers(prefix="cache"))
        self.runner.load_constants({n: own[n] for n in self.runner.get_constant_fqns() if n in own},
                                   check_full_update=False, user_managed=True)
        _STEPS_PACKAGED += 1


# ----------------------------------------------------------------------------- layered steps (CPU, own kernels)


class LayerCache(nn.Module):
    """Layers ``first .. first + n - 1`` of a static cache as a cache of their own (the same memory, with the
    cache's ``valid`` and ``n_pad``), indexed from 0: what a :class:`LayerGroup` hands its blocks. Writes, reads,
    masks and positions as :class:`KVCache` does."""

    update, mask, positions = KVCache.update, KVCache.mask, KVCache.positions

    def __init__(self, cache: KVCache, first: int, n: int) -> None:
        super().__init__()
        for i in range(n):
            k, v = cache.layer(first + i)
            self.register_buffer(f"k_{i}", k, persistent=False)
            self.register_buffer(f"v_{i}", v, persistent=False)
        self.register_buffer("valid", cache.valid, persistent=False)
        self.register_buffer("n_pad", cache.n_pad, persistent=False)
        self.kv_len = cache.max_len

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return getattr(self, f"k_{i}"), getattr(self, f"v_{i}")


class LayerGroup(nn.Module):
    """Blocks ``first .. first + n - 1`` of a decode step and their cache: ``forward(x [B, 1, dim], slot [1]) -> x``.

    Each group works out RoPE's cos and sin and the mask from the slot itself, as :meth:`Llama.forward` does
    once per step: a few hundred numbers, cheaper to recompute inside compiled code than to pass in.
    """

    def __init__(self, model: Llama, cache: KVCache, first: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.layers[first:first + n])
        self.cache, self.rope = LayerCache(cache, first, n), model.rope
        self.window = model.layers[first].attn.window

    def forward(self, x: Tensor, slot: Tensor) -> Tensor:
        rope = self.rope(self.cache.positions(slot), x.dtype)  # cos, sin: [B, 1, head_dim]
        mask = self.cache.mask(slot, self.cache.kv_len, self.window)  # [B, 1, 1, kv_len]
        for i, block in enumerate(self.blocks):
            x = block(x, rope, mask, self.cache, i, slot)
        return x


class HeadCall(nn.Module):
    """The end of a decode step: final norm, LM head and greedy pick, ``forward(x [B, 1, dim]) -> token [B]``."""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.norm, self.lm_head = model.norm, model.lm_head

    def forward(self, x: Tensor) -> Tensor:
        return greedy_pick(self.lm_head(self.norm(x)))


def block_signature(module: nn.Module) -> str:
    """Everything about ``module`` that its compiled copy bakes in: each tensor's name, shape, stride and dtype,
    and each submodule's plain settings (norm eps, head counts, attention window, kernel, group size). Equal for
    two modules: one compiled copy serves both, each with its own tensors."""
    tensors = [(n, tuple(t.shape), t.stride(), t.dtype)
               for n, t in [*module.named_parameters(), *module.named_buffers()]]
    plain = [(n, sorted((k, v) for k, v in vars(m).items()
                        if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))))
             for n, m in module.named_modules()]
    return repr((tensors, plain))


LAYER_GROUP = 5
"""Blocks one compiled group of a :class:`LayeredStep` holds (or the largest divisor of the layer count below it).
Measured on a 2-core AVX-512 EPYC, int4 g32 + int8 head at 128 tokens, 15 alternating runs of 64 tokens against the
whole step: groups of 5 decoded at 162.6 tok/s against 162.3 (groups of 3: 157.8), building in 11.6 s (plus 6.1 s
for the head) against 34 s for the whole step."""


def group_size(n_layers: int, most: int | None = None) -> int:
    """The largest divisor of ``n_layers`` that is at most ``most`` (default :data:`LAYER_GROUP`): groups of
    equal size share one package."""
    return max(g for g in range(1, (most or LAYER_GROUP) + 1) if n_layers % g == 0)


def layers_alike(model: Llama) -> bool:
    """True when every block of ``model`` has the same :func:`block_signature` (one compiled group serves all)."""
    return len({block_signature(b) for b in model.layers}) == 1


class LayeredStep:
    """A decode step compiled ahead of time (AOTInductor) as two small packages: a group of
    :func:`group_size` blocks (:class:`LayerGroup`), loaded once per group of the model with that group's
    weights and cache bound to it as constants, and the head (:class:`HeadCall`). Only the embedding runs
    eagerly, before them.

    Why: a whole 30-layer step takes 31-56 s to build on 2 cores (tracing and code generation grow with the
    graph); a group of five blocks ~11 s and the head ~5 s, most of both the C++ compile of a package's
    wrapper, and the two build side by side (:func:`package_steps`): on a 2-core EPYC a cold bf16 step at 128
    tokens in 10.9 s instead of 16.9 (inductor's precompiled headers, built once per environment, add ~9 s to the
    first). What it costs: one call into a package per group (see :data:`LAYER_GROUP` for the speed
    measured against the whole step). It serves only where the weights have nothing to pre-pack (every
    projection calls the workbook's kernels, :func:`has_weights_to_pack`): inductor's pre-packed GEMMs are
    made from the weights' values at compile time, so projections on ``nn.Linear`` keep :class:`PackagedStep`
    (float weights get here through :func:`utils.cpu_linear.on_workbook_kernels`). The
    packages hold no weights (each group binds its own, as :class:`PackagedStep` binds the cache) and are
    keyed by shapes (:func:`part_key`): models of the same shapes share them. Same interface as
    :class:`PackagedStep`.
    """

    def __init__(self, step: DecodeStep, settings: dict[str, Any], group: int | None = None) -> None:
        self.step, self.settings = step, {**settings, **PART_SETTINGS}
        model, cache = step.model, step.cache
        n = model.args.n_layers
        size = group or group_size(n)
        self.groups = [LayerGroup(model, cache, first, size) for first in range(0, n, size)]
        self.head = HeadCall(model)
        self.runs: list[Callable[[list[Tensor]], list[Tensor]]] = []
        self.run_head: Callable[[list[Tensor]], list[Tensor]] | None = None
        self.source = ""

    def __call__(self, token: Tensor, slot: Tensor) -> Tensor:
        if self.run_head is None:
            self.load(token, slot)
        x = self.step.model.embed(token)  # [B, 1, dim]
        for run in self.runs:
            x = run([x, slot])[0]
        return self.run_head([x])[0]  # [B]

    def load(self, token: Tensor, slot: Tensor) -> None:
        global _STEPS_PACKAGED
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: what export traces
            x, slot = self.step.model.embed(token.clone()), slot.clone()
        parts = [(part, example, step_cache_dir() / f"part-{part_key(part, example, self.settings)}.pt2")
                 for part, example in ((self.groups[0], (x, slot)), (self.head, (x,)))]
        missing = [job for job in parts if not job[2].exists()]
        if missing:  # the group's and the head's compiles side by side
            package_steps(missing, self.settings)
        paths = [path for _, _, path in parts]
        for path in paths:
            path.touch()  # recently used
        self.runs = [bound_package(paths[0], group) for group in self.groups]
        self.run_head = bound_package(paths[1], self.head)
        self.source = "built" if missing else "loaded"
        _STEPS_PACKAGED += 1


def bound_package(path: Path, module: nn.Module) -> Callable[[list[Tensor]], list[Tensor]]:
    """The package at ``path`` loaded with ``module``'s own tensors as its constants (not copied: the package
    reads and writes them in place); returns its list-in, list-out call."""
    runner = load_package(path)
    own = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}
    names = runner.get_constant_fqns()
    if missing := [n for n in names if n not in own]:
        raise WorkbookError(f"the package {path.name} expects tensors this model does not have: {missing[:3]}")
    runner.load_constants({n: own[n] for n in names}, check_full_update=True, user_managed=True)
    return runner.loader.boxed_run


def part_key(part: nn.Module, example: tuple[Tensor, ...], settings: dict[str, Any]) -> str:
    """What the package of a part of a :class:`LayeredStep` depends on (:func:`_code_key`), its
    :func:`block_signature` and its inputs' shapes, strides and dtypes. Not the weights' values: each group binds
    its own."""
    h = _code_key(part, settings)
    for piece in (block_signature(part), inspect.getsource(LayerCache), inspect.getsource(LayerGroup)):
        h.update(piece.encode())
    for t in example:
        h.update(f"{tuple(t.shape)} {tuple(t.stride())} {t.dtype}".encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- the loop


@dataclass
class FastDecoder:
    """A model, a static cache sized for ``max_len`` slots and its (compiled) step.

    Build it once with :meth:`build`; :meth:`generate` then serves any request whose
    prompt + new tokens fit in ``max_len``. ``compile_s`` is the first call's extra
    time (tracing and code generation), reported apart from the decode speed.
    """

    model: Llama
    cache: KVCache
    step: Callable[..., Tensor]
    compiled: bool
    compile_s: float = 0.0
    label: str = ""
    mode: str | None = None  # compile_step's mode, kept so that a second decoder of the same form compiles alike
    calls: int = field(default=0, repr=False)

    @classmethod
    def build(cls, model: Llama, max_len: int, batch: int = 1, compiled: bool = True,
              mode: str | None = None, backend: str = "inductor", label: str = "",
              by_layer: bool | None = None) -> "FastDecoder":
        cache = llama_phases.new_cache(model, batch, max_len, static=True)
        step = DecodeStep(model, cache)
        fn = compile_step(step, mode, backend, by_layer) if compiled else step
        return cls(model, cache, fn, compiled, label=label, mode=mode)

    @torch.inference_mode()
    def prefill(self, ids: Tensor) -> Tensor:
        """Eager prefill of ``ids`` [B, T] into the static cache; the first greedy token [B]."""
        check_prompt_length(ids.shape[-1], self.cache.max_len)
        return llama_phases.prefill(self.model, self.cache, ids).argmax(dim=-1)

    @torch.inference_mode()
    def decode(self, token: Tensor, n: int) -> Tensor:
        """``n`` greedy steps after ``token`` [B]: the new tokens [B, n].

        The hot loop: the slot is a device tensor advanced in place, each token is
        written into a preallocated output, nothing waits for the device.
        """
        start = self.cache.length
        if start + n > self.cache.max_len:
            raise WorkbookError(f"{n} more tokens after {start} do not fit the static cache of "
                                f"{self.cache.max_len} slots: build the decoder with a larger max_len.")
        out = token.new_empty(token.shape[0], n)
        slot = torch.tensor([start], device=token.device)
        token = token.view(-1, 1).clone()
        # CUDA graphs (reduce-overhead) replay into the same output buffer: each step is announced as a new one, and
        # its token is copied out (into ``out`` and ``token``) before the next replay overwrites it.
        graphs = self.compiled and token.device.type == "cuda"
        for i in range(n):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            nxt = self.step(token, slot)  # [B]
            out[:, i] = nxt
            token.copy_(nxt.view(-1, 1))
            slot += 1
        self.cache.length = start + n
        self.calls += n
        return out

    def warm_up(self, ids: Tensor, n: int = 2) -> float:
        """Run one short request (compiling, if the step is compiled); returns the seconds of its ``n`` decode
        steps, the first of which compiles or loads the step (``compile_s``). The eager prefill before them is not
        counted: it is no compile, and at 1,024 tokens in bf16 on an AVX2 CPU (imitated on a 2-core Xeon) it
        alone took ~8 of the 10 s a loaded step's "compile" then showed."""
        first = self.prefill(ids)
        synchronize(self.cache.device)
        t0 = time.perf_counter()
        self.decode(first, n)
        synchronize(self.cache.device)
        seconds = time.perf_counter() - t0
        if self.compiled and not self.compile_s:
            self.compile_s = seconds
        return seconds

    def generate(self, ids: Tensor, max_new_tokens: int) -> Tensor:
        """Greedy: the new tokens [B, max_new_tokens] (the first from prefill, the rest decoded)."""
        check_token_count(max_new_tokens)
        first = self.prefill(ids)
        rest = self.decode(first, max_new_tokens - 1)
        return torch.cat([first[:, None], rest], dim=1)


def fast_decode_speed(decoder: FastDecoder, ids: Tensor, n_tokens: int, *, repeats: int = 3,
                      warmup: int = 1) -> PhaseResult:
    """Time ``n_tokens`` decode steps of ``decoder`` after an untimed prefill of ``ids`` [B, T]: the same
    shape as :func:`utils.engine.decode_speed` (tokens = ``n_tokens x B``)."""
    timing = measure(lambda first: decoder.decode(first, n_tokens), setup=lambda: decoder.prefill(ids),
                     warmup=warmup, repeats=repeats, device=decoder.cache.device,
                     desc=f"decode {n_tokens} ({decoder.label or 'fast'})")
    return PhaseResult("decode", n_tokens * (ids.shape[0] if ids.dim() == 2 else 1), timing)


# ----------------------------------------------------------------------------- compiles, counted


def compile_count() -> int:
    """Steps compiled in this process so far: frames dynamo compiled (a recompile adds one) and packaged steps
    built or loaded (:class:`PackagedStep`)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]) + _STEPS_PACKAGED


def explain_recompiles(fn: Callable[[], Any]) -> list[str]:
    """Run ``fn`` and return dynamo's reason for every recompile it caused (empty: none)."""
    import logging

    reasons: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reasons.append(record.getMessage())

    log = logging.getLogger("torch._dynamo.guards.__recompiles")  # what TORCH_LOGS=recompiles prints
    handler, old = Catch(), log.level
    torch._logging.set_logs(recompiles=True)
    log.addHandler(handler)
    try:
        fn()
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs(recompiles=False)
        log.setLevel(old)
    return reasons


def projections_once(model: Llama) -> Callable[[], None]:
    """A call that applies every layer of :func:`~utils.llama.iter_linears` once to one row, nothing else: what
    :func:`projections_seconds` times (and :func:`utils.timing.interleaved` can time beside another model's)."""
    layers = [m for _, m in iter_linears(model)]
    rows = {m.in_features: torch.randn(1, m.in_features, dtype=model.dtype, device=model.device)
            for m in layers}

    @torch.inference_mode()
    def once() -> None:
        for m in layers:
            m(rows[m.in_features])

    return once


def projections_seconds(model: Llama, repeats: int = 5) -> float:
    """Seconds one decode step spends in its projections alone (:func:`projections_once`, median of ``repeats``).

    ``bytes_read_per_token(model) / projections_seconds(model)`` is the speed at which this
    device's matmul kernels read these weights: the ceiling that the *kernels* allow, which can
    sit far below the one the memory allows (a bf16 matrix-vector product that converts each
    weight to float32 on the way can be compute-bound on a CPU).
    """
    return measure(projections_once(model), warmup=1, repeats=repeats, device=model.device, progress=False).median


ATTENTION_KERNELS = ("pytorch", "pytorch in float32", "workbook")
"""The decode attentions :func:`attention_seconds` compares on a CPU: PyTorch's kernel on the cache as it is,
PyTorch's kernel on a float32 copy of it, and the workbook's own kernel (:mod:`utils.cpu_attention`)."""


@torch.inference_mode()
def attention_seconds(model: Llama, context: int, kernel: str = "workbook", calls: int = 50, repeats: int = 5) -> float:
    """Seconds one decode query with ``model``'s heads takes to attend over ``context`` cached slots of its dtype,
    with one of :data:`ATTENTION_KERNELS`. Median of ``repeats`` timings of ``calls`` calls, per call.

    One layer's share of a step: a decode step attends this way once per layer.
    """
    if kernel not in ATTENTION_KERNELS:
        raise WorkbookError(f"unknown attention kernel {kernel!r}: choose one of {', '.join(ATTENTION_KERNELS)}")
    if kernel == "workbook" and not cpu_attention.available():
        raise WorkbookError("the workbook's attention kernel is not built on this machine (see utils.cpu_attention)")
    a, dev = model.args, model.device
    q = torch.randn(1, a.n_heads, 1, a.head_dim, dtype=model.dtype, device=dev)
    k, v = (torch.randn(1, a.n_kv_heads, context, a.head_dim, dtype=model.dtype, device=dev) for _ in range(2))
    mask = torch.ones(1, 1, 1, context, dtype=torch.bool, device=dev)
    up = (lambda t: t.float()) if kernel == "pytorch in float32" else (lambda t: t)

    def some_calls() -> None:
        for _ in range(calls):
            if kernel == "workbook":
                cpu_attention.decode_attention(q, k, v, mask)
            else:
                F.scaled_dot_product_attention(up(q), up(k), up(v), attn_mask=mask, enable_gqa=True).to(model.dtype)

    return measure(some_calls, warmup=1, repeats=repeats, device=dev, progress=False).median / calls


def profile_step(decoder: FastDecoder, ids: Tensor, n_tokens: int = 8, step_s: float | None = None) -> dict[str, float]:
    """Seconds per decode step of ``decoder`` by kind of operator (matmul, attention, everything
    else: :func:`utils.timing.op_kind`), from ``torch.profiler`` self times after a prefill.

    A compiled step's fused element-wise kernels count under "everything else". A packaged step's kernels
    are profiler events only in a package built to record them (``cpp.enable_kernel_profile``, which costs
    about a third of the speed on a 2-core Xeon): that twin, built once and kept like any package, is profiled,
    and its split is scaled to ``decoder``'s own time per step, so that the kinds add up to it: ``step_s`` when
    the caller measured it (a table's row), else timed here over ``n_tokens`` steps.
    """
    if isinstance(decoder.step, (PackagedStep, LayeredStep)):
        own_s = step_s or fast_decode_speed(decoder, ids, n_tokens).timing.median / n_tokens
        twin = type(decoder.step)(decoder.step.step, {**decoder.step.settings, "cpp.enable_kernel_profile": True})
        twin_decoder = replace(decoder, step=twin, compile_s=0.0)
        twin_decoder.warm_up(ids)
        split = _profile_kinds(twin_decoder, ids, n_tokens)
        return {kind: s * own_s / sum(split.values()) for kind, s in split.items()}
    return _profile_kinds(decoder, ids, n_tokens)


def _profile_kinds(decoder: FastDecoder, ids: Tensor, n_tokens: int) -> dict[str, float]:
    """Profiler self seconds per decode step of ``decoder``, by kind of operator."""
    first = decoder.prefill(ids)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if decoder.cache.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        decoder.decode(first, n_tokens)
    return {kind: us * 1e-6 / n_tokens for kind, us in profile_self_time(prof, decoder.cache.device).items()}

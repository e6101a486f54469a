"""Reference benchmark: prefill and decode of the configured model on this machine.

    python -m utils.bench [--prompt-tokens 128 512] [--new-tokens 64] [--repeats 3]
                          [--fast-path] [--contexts 128 1024] [--quick] [--no-llama-cpp] [--server URL]

Measures, with the workbook's protocol (warm-up, repeats, median): memory bandwidth
and matmul FLOP/s of the device, prefill tok/s at each prompt length, decode tok/s
through transformers and through the hand-written loop (:func:`utils.engine.decode_speed`
for both); then the decode ceiling ``bandwidth / bytes per token`` and the share of it
reached. Prints a readable table, then one JSON line last (machine-readable, for
collecting results from many machines: ``make bench | tail -1``).

``--fast-path`` adds the roofline lab's table (:mod:`utils.fast`, :mod:`utils.decode_table`), in the same process and
run, on the same prompt and output length, at each ``--contexts`` length: transformers
(as loaded and in bf16), the hand-written eager loop, the static cache + hot loop, the
compiled step in bf16 (and float32), the compiled int8 and int4 (+ int8 head) copies, and
llama.cpp on the embedded GGUF file (``llama-cpp-python``, installed on first use by
``make bench``; when it is missing its row says why). Each row: tok/s, MB read per token,
share of the measured-bandwidth ceiling, speed-up over transformers bf16, greedy-token
agreement, compile seconds. On a CPU every compiled row's projections call the workbook's own kernels
(:mod:`utils.cpu_linear` for float32 and bf16, :mod:`utils.cpu_quant` for int8 and int4), so each step is built by
layer groups in seconds; the full run also builds the int4, bf16 and float32 steps whole (float: inductor's
pre-packed GEMMs) and times both ways in turns (:func:`layered_comparison`), and times each compiled step at the
shortest and the longest context in turns, for its fall against its bytes (:func:`fall_in_turns`), and the compiled
bf16 step in turns with the bandwidth probe and with transformers bf16, and the best quantized step in turns with
llama.cpp, for the targets (:func:`targets_in_turns`; :func:`speedup_asks` says what share of the ceiling the speed-up
target asked of the bf16 step in that run). A pair timed in turns that is noisy (a timing's spread over
:data:`utils.timing.NOISE_THRESHOLD`) is timed once more and the steadier round kept; one still noisy is printed
"NOISY" and its target not judged. ``--quick`` (CI):
bf16 eager rows and the compiled int4 row only.
``--server URL`` adds a row for any OpenAI-compatible server, timed from outside one request at a time
(:mod:`utils.openai_client`); ``--server llama.cpp`` starts llama.cpp's own server here on the embedded
file (:mod:`utils.llama_server`, built once on first use), and its row says how its text and its speed
compare with llama.cpp in process (:data:`utils.llama_server.HTTP_BAND`).

Model, device and dtype follow ``WORKBOOK_MODEL`` / ``WORKBOOK_DEVICE`` /
``WORKBOOK_DTYPE`` or the flags; ``shape:<name>`` models are accepted (speeds only).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import time
from typing import Any, Callable, Iterator

import torch

from . import cpu_linear, cpu_quant, decode_table, fast, llama, llama_server, peer, quant
from .decide import MIN_SPREAD, ratio_spread
from .engine import decode_request, decode_speed, generate, measure_prefill
from .hardware import bandwidth_reader, describe_machine, measure_matmul_flops, probe_bandwidth
from .llama import Llama
from .models import EMBEDDED, LoadedModel, load_model
from .openai_client import Client, ServerError, measure_speed
from .roofline import decode_bytes_per_token, decode_ceiling_tok_s
from .timing import Timing, interleaved
from .tokens import filler_ids
from .variants import bytes_read_per_token


def decode_both_backends(lm: LoadedModel, prompt_tokens: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    """Decode tok/s through transformers and the hand-written loop on the same prompt, and whether
    their greedy tokens agree (a speed is only comparable between loops that make the same tokens)."""
    ids = filler_ids(lm.tokenizer, prompt_tokens, lm.device)
    hand = Llama.from_hf(lm.model)
    ours, theirs = generate(hand, ids, new_tokens)[0].tolist(), generate(lm.model, ids, new_tokens)[0].tolist()
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    return {
        "decode_tok_s_transformers": round(decode_speed(lm.model, ids, new_tokens, repeats=repeats).tok_s, 2),
        "decode_tok_s_hand_written": round(decode_speed(hand, ids, new_tokens, repeats=repeats).tok_s, 2),
        "decode_tokens_agree": f"{same}/{len(ours)}",
    }


def run(lm: LoadedModel, prompt_lengths: list[int], new_tokens: int, repeats: int) -> dict[str, Any]:
    """All the figures as one JSON-serialisable dict."""
    probe = probe_bandwidth(lm.device, probes=3)  # a probe can only under-read: the ceiling uses the best
    bandwidth = probe.best
    flops = measure_matmul_flops(lm.device, lm.dtype)
    prefill = {n: measure_prefill(lm, n, repeats=repeats).tok_s for n in prompt_lengths}
    context = prompt_lengths[0]
    decode = decode_both_backends(lm, context, new_tokens, repeats)
    per_token = decode_bytes_per_token(lm.spec.weight_bytes_read_per_token, lm.spec.kv_bytes_per_token,
                                       context + new_tokens // 2)
    ceiling = decode_ceiling_tok_s(bandwidth, per_token)
    return {
        "machine": describe_machine(lm.device),
        "model": lm.spec.as_dict(),
        "bandwidth_GBps": round(bandwidth / 1e9, 2),
        "bandwidth_probes_GBps": [round(r / 1e9, 2) for r in probe.readings],
        "matmul_GFLOPs": round(flops / 1e9, 1),
        "prefill_tok_s": {str(n): round(v, 1) for n, v in prefill.items()},
        "decode_context_tokens": context,
        "decode_new_tokens": new_tokens,
        **decode,
        "decode_ceiling_tok_s": round(ceiling, 1),
        "decode_share_of_ceiling": round(decode["decode_tok_s_transformers"] / ceiling, 3),
    }


# ----------------------------------------------------------------------------- the fast path


QUICK_COMPILED = "int4 g32 + int8 head"
"""``--quick``'s one compiled row (a compile costs 10-40 s on 2 cores): the one that meets llama.cpp."""


def fast_models(lm: LoadedModel, quick: bool) -> dict[str, Llama]:
    """The hand-written model in each form the table measures, keyed by its weights' name."""
    base = Llama.from_hf(lm.model)
    fp32 = base if base.dtype == torch.float32 else copy.deepcopy(base).float()
    forms = {"bfloat16": copy.deepcopy(fp32).to(torch.bfloat16) if base.dtype != torch.bfloat16 else base,
             "int4 g32 + int8 head": quant.quantized_copy(fp32, 4, 8)}
    if not quick:
        forms["float32"] = fp32
        forms["int8"] = quant.quantized_copy(fp32, 8, 8)
    return forms


def kernel_pair(fp32: Llama, weights: str, model: Llama) -> tuple[Llama, Llama] | None:
    """``(on the workbook's CPU kernels, on PyTorch's)`` for one form of the table: a quantized form against the same
    quantization on aten's kernels, a float form on :mod:`utils.cpu_linear` against itself on ``nn.Linear``. None
    where the workbook's kernels are not in use (a GPU, no compiler, ``WORKBOOK_CPU_QUANT=0``)."""
    if any(getattr(m, "kernel", "") == "workbook" for _, m in llama.iter_linears(model)):
        bits, head_bits = (4, 8) if weights.startswith("int4") else (8, 8)  # laid out by thread, as the rows run
        return cpu_linear.on_workbook_kernels(model), quant.quantized_copy(fp32, bits, head_bits, kernel="aten")
    if weights.startswith("int"):
        return None
    own = cpu_linear.on_workbook_kernels(model)
    return None if own is model else (own, model)


def kernel_comparison(lm: LoadedModel, forms: dict[str, Llama], new_tokens: int) -> dict[str, dict[str, Any]]:
    """Each form whose projections can call the workbook's CPU kernels against the same weights on PyTorch's
    (:func:`kernel_pair`), in this run: both forms' projections alone (GB/s of their weights, as
    :func:`utils.fast.projections_once`, timed in turns) and their eager greedy tokens on a short prompt, compared.
    Empty where the workbook's kernels are not in use."""
    out: dict[str, dict[str, Any]] = {}
    ids = filler_ids(lm.tokenizer, 32, lm.device)
    fp32 = Llama.from_hf(lm.model).float()
    for weights, model in forms.items():
        if (pair := kernel_pair(fp32, weights, model)) is None:
            continue
        models = dict(zip(("workbook", "aten"), pair))  # timed in turns: a slow spell hits both alike
        times = interleaved({k: fast.projections_once(m) for k, m in models.items()}, repeats=7, progress=False)
        speed = {k: bytes_read_per_token(models[k]) / t.median / 1e9 for k, t in times.items()}
        a, b = (generate(m, ids, new_tokens)[0].tolist() for m in pair)
        split = decode_table.divergence(pair[1], ids, a, b)
        out[weights] = {"workbook_GBps": round(speed["workbook"], 2), "aten_GBps": round(speed["aten"], 2),
                        "speedup": round(speed["workbook"] / speed["aten"], 2),
                        "tokens": f"{decode_table.tokens_agreed(a, b)}/{len(a)} greedy tokens equal" + decode_table.split_note(split)}
    return out


LAYERED_COMPARED = (QUICK_COMPILED, "bfloat16", "float32")
"""The forms whose step the full bench builds both ways (:func:`layered_comparison`)."""


def layered_comparison(lm: LoadedModel, forms: dict[str, Llama], context: int, new_tokens: int,
                       weights: str = QUICK_COMPILED) -> dict[str, Any]:
    """``forms[weights]``'s step as its row builds it, by layer groups on the workbook's kernels
    (:class:`utils.fast.LayeredStep`, :func:`utils.cpu_linear.on_workbook_kernels` for a float form), against the
    whole step of ``forms[weights]`` itself (:class:`utils.fast.PackagedStep`: for a float form, inductor's own
    pre-packed GEMMs) at ``context``: each one's first call (built here or loaded), their decode speed timed in
    turns, their greedy tokens compared. Empty where the step is not built by layer groups (a GPU, PyTorch's
    kernels)."""
    model = forms.get(weights)
    layered = cpu_linear.on_workbook_kernels(model) if model is not None else None
    if layered is None or lm.device.type != "cpu" or not fast.compiles_by_layer(layered):
        return {}
    ids, length = filler_ids(lm.tokenizer, context, lm.device), fast.static_length(context, new_tokens)
    decoders = {how: fast.FastDecoder.build(m, length, compiled=True, label=how, by_layer=by_layer)
                for how, m, by_layer in (("layer groups", layered, True), ("whole step", model, False))}
    first = {how: (d.warm_up(ids), d.step.source)[::-1] for how, d in decoders.items()}
    tokens = {how: d.generate(ids, new_tokens)[0].tolist() for how, d in decoders.items()}
    times = interleaved({how: (lambda start, d=d: d.decode(start, new_tokens)) for how, d in decoders.items()},
                        setup={how: (lambda d=d: d.prefill(ids)) for how, d in decoders.items()}, repeats=7, progress=False)
    speed = {how: new_tokens / t.median for how, t in times.items()}
    a, b = tokens["layer groups"], tokens["whole step"]
    split = decode_table.divergence(model, ids, a, b)
    return {"weights": weights, "context": context,
            **{f"{how} first call": f"{src} in {s:.1f} s" for how, (src, s) in first.items()},
            "compile_s": round(first["layer groups"][1], 1), "compiled_how": first["layer groups"][0],
            **{f"{how} tok/s": round(v, 1) for how, v in speed.items()},
            "speed ratio": round(speed["layer groups"] / speed["whole step"], 3),
            "tokens": f"{decode_table.tokens_agreed(a, b)}/{len(a)} greedy tokens equal" + decode_table.split_note(split)}


def step_forms_of(forms: dict[str, Llama], compiled: list[str] | None = None) -> dict[str, Llama]:
    """The forms in ``compiled`` (default: every form) as their compiled rows run them: on the workbook's kernels
    (:func:`utils.cpu_linear.on_workbook_kernels`; bf16's AMX tiles are a copy of its weights, so this is done once
    per run, and only for the forms compiled)."""
    return {w: cpu_linear.on_workbook_kernels(forms[w]) for w in (list(forms) if compiled is None else compiled)}


def fast_rows_at(lm: LoadedModel, forms: dict[str, Llama], context: int, new_tokens: int,
                 repeats: int, compiled: list[str] | None = None, *,
                 step_forms: dict[str, Llama]) -> list[decode_table.Row]:
    """Every row of the table at one context length (see the module docstring); a compiled row
    for each form in ``compiled`` (default: every form), on ``step_forms[form]``: the form on the workbook's
    kernels (:func:`step_forms_of`, made once for every context)."""
    ids, n, length = filler_ids(lm.tokenizer, context, lm.device), new_tokens, fast.static_length(context, new_tokens)
    bf16 = forms["bfloat16"]
    hf_bf16 = lm.model if lm.dtype == torch.bfloat16 else copy.deepcopy(lm.model).to(torch.bfloat16)
    rows = [decode_table.eager_row("transformers", m, ids, n, weights=str(m.dtype).removeprefix("torch."),
                                   repeats=repeats,
                                   bytes_per_token=decode_table.step_bytes(bf16, context + n // 2) * m.dtype.itemsize / 2)
            for m in [lm.model] + ([hf_bf16] if hf_bf16 is not lm.model else [])]
    eager = decode_table.eager_row("hand-written eager loop", bf16, ids, n, weights="bfloat16", repeats=repeats,
                                   bytes_per_token=decode_table.step_bytes(bf16, context + n // 2))
    static = decode_table.decoder_row("static cache + hot loop", fast.FastDecoder.build(bf16, length, compiled=False),
                                      ids, n, weights="bfloat16", reference=torch.tensor(eager.tokens),
                                      what="eager bf16", repeats=repeats)
    rows += [eager, static]
    for weights in (list(forms) if compiled is None else compiled):  # each against its own model's eager step
        model = step_forms[weights]
        reference = (torch.tensor(static.tokens) if model is bf16
                     else fast.FastDecoder.build(model, length, compiled=False).generate(ids, n)[0])
        what = f"static eager {weights.split()[0]}"
        decoder = fast.FastDecoder.build(model, length, compiled=True, label=weights)
        rows.append(decode_table.decoder_row("compiled step", decoder, ids, n, weights=weights,
                                             reference=reference, what=what, repeats=repeats, reload=True))
    return rows


TARGETS = {"bf16 share of ceiling": 0.8, "bf16 over transformers bf16": 3.5, "quantized over llama.cpp": 1.2}
"""The issue's targets for the fast path, as ratios within one run."""

COLD_COMPILE_S = 20.0
"""The issue's target for one variant's first compile on 2 cores (a learner waits through each in the roofline lab)."""

WARM_COMPILE_S = 5.0
"""The issue's target for the same variant compiled a second time, in a new process (a packaged step is loaded)."""


def in_turns(runs: dict[str, Callable[..., Any]], setup: dict[str, Callable[[], Any]], repeats: int,
             device: torch.device) -> dict[str, Timing]:
    """``runs`` timed in turns (each ``run(setup())``, setup untimed), as every comparison timed in turns here is:
    a round in which any timing is noisy is timed once more and the steadier round kept (:func:`any_noisy` then
    says whether one still is: not to publish, not to judge)."""
    return interleaved(runs, setup=setup, repeats=repeats, device=device, progress=False, remeasure_noisy=True)


def any_noisy(times: dict[str, Timing]) -> bool:
    """True when a timing of a comparison is still noisy (spread over :data:`utils.timing.NOISE_THRESHOLD`)."""
    return any(t.noisy for t in times.values())


def fall_in_turns(lm: LoadedModel, model: Llama, contexts: tuple[int, int], new_tokens: int,
                  repeats: int = 7) -> dict[str, float]:
    """``model``'s compiled step (on the workbook's kernels, as its row runs) at the two ``contexts``, decoded in
    turns: ``{"measured": tok/s at the longer / at the shorter, "spread": that ratio's, "noisy"}`` (a noisy round is
    timed once more, the steadier kept; ``noisy``: still so, not to publish).

    Why: the two tables are measured minutes apart, and on a shared machine a slow spell in between moves every
    row's fall (one full run on a 2-core Xeon VM: between its tables transformers float32 fell to 0.87 of its speed
    where its bytes predict 0.93, and every compiled row to 0.76-0.83). The steps' packages were built by the rows:
    loaded here. ``model`` may be on the workbook's kernels already (it is then used as it is).
    """
    model = cpu_linear.on_workbook_kernels(model)  # once: compiled_request then uses it as it is
    runs = {str(c): compiled_request(lm, model, c, new_tokens) for c in contexts}
    times = in_turns({c: run for c, (_, run, _) in runs.items()}, {c: setup for c, (setup, _, _) in runs.items()},
                     repeats, lm.device)
    short, long = (times[str(c)] for c in contexts)
    return {"measured": short.median / long.median, "spread": ratio_spread(short, long), "noisy": any_noisy(times)}


def stream_ahead_in_turns(lm: LoadedModel, step_forms: dict[str, Llama], contexts: list[int], new_tokens: int,
                          repeats: int = 7) -> list[dict[str, Any]]:
    """Each compiled step in ``step_forms`` at each of ``contexts`` with its kernels asking for the weights ahead
    (:func:`utils.cpu_linear.stream_ahead`, the default) and without, decoded in turns, their greedy tokens
    compared: that speed-up against its baseline in this run. Empty where the workbook's kernels do not run."""
    if lm.device.type != "cpu" or not cpu_quant.available():
        return []
    out = []
    for weights, model in step_forms.items():
        for context in contexts:
            setup, run, _ = compiled_request(lm, model, context, new_tokens)
            ways = {how: (lambda start, nbytes=nbytes: _ahead(nbytes, run, start))
                    for how, nbytes in (("ahead", cpu_linear.STREAM_AHEAD), ("not", 0))}
            tokens = [way(setup()).tolist() for way in ways.values()]
            times = in_turns(ways, {k: setup for k in ways}, repeats, lm.device)
            ahead, plain = times.values()
            out.append({"weights": weights, "context": context, "speed ratio": round(plain.median / ahead.median, 3),
                        "spread": round(ratio_spread(ahead, plain), 3), "noisy": any_noisy(times),
                        "tokens equal": tokens[0] == tokens[1]})
    return out


def _ahead(nbytes: int, run: Callable[[Any], Any], start: Any) -> Any:
    with cpu_linear.stream_ahead(nbytes):
        return run(start)


Timed = tuple[Callable[[], Any], Callable[[Any], Any], int]
"""A decode to time in turns: ``(setup, run, tokens)``: ``run(setup())`` makes ``tokens`` tokens (setup untimed)."""


def compiled_request(lm: LoadedModel, model: Llama, context: int, new_tokens: int) -> Timed:
    """``model``'s compiled step at ``context`` (on the workbook's kernels, as its row runs; its package was built
    by the row: loaded here), warmed up, as a :data:`Timed` decode of ``new_tokens``."""
    model = cpu_linear.on_workbook_kernels(model)  # no copy where it is converted already
    ids = filler_ids(lm.tokenizer, context, lm.device)
    decoder = fast.FastDecoder.build(model, fast.static_length(context, new_tokens), compiled=True)
    decoder.warm_up(ids)
    return (lambda: decoder.prefill(ids)), (lambda start: decoder.decode(start, new_tokens)), new_tokens


def speed_ratio_in_turns(lm: LoadedModel, ours: Timed, theirs: Timed, repeats: int = 7) -> dict[str, float]:
    """``ours``' tok/s over ``theirs``', the two decoded in turns: ``{"measured", "spread"}`` (the ratio's) and
    ``"noisy"`` (a noisy round is timed once more and the steadier kept; True when it still is: not to publish)."""
    times = in_turns({"ours": ours[1], "theirs": theirs[1]}, {"ours": ours[0], "theirs": theirs[0]}, repeats, lm.device)
    ours_tok_s, theirs_tok_s = ours[2] / times["ours"].median, theirs[2] / times["theirs"].median
    return {"measured": round(ours_tok_s / theirs_tok_s, 3), "spread": round(ratio_spread(times["ours"], times["theirs"]), 3),
            "noisy": any_noisy(times), "ours tok/s": round(ours_tok_s, 1), "theirs tok/s": round(theirs_tok_s, 1)}


def share_in_turns(lm: LoadedModel, ours: Timed, bytes_per_token: float, repeats: int = 7) -> dict[str, float]:
    """A decode's share of the ceiling, the bandwidth probe's read timed in turns with it: ``{"measured": its
    bytes per second over the probe's (medians), "spread", "GBps": the probe's median, "noisy"}`` (as
    :func:`speed_ratio_in_turns`)."""
    read, probe_bytes = bandwidth_reader(lm.device)
    times = in_turns({"step": ours[1], "probe": read}, {"step": ours[0]}, repeats, lm.device)
    step_bytes_s, probe_bytes_s = ours[2] * bytes_per_token / times["step"].median, probe_bytes / times["probe"].median
    return {"measured": round(step_bytes_s / probe_bytes_s, 3), "spread": round(ratio_spread(*times.values()), 3),
            "GBps": round(probe_bytes_s / 1e9, 2), "noisy": any_noisy(times),
            "ceiling tok/s": round(probe_bytes_s / bytes_per_token, 1)}


def targets_in_turns(lm: LoadedModel, step_forms: dict[str, Llama], rows: list[dict[str, Any]], context: int,
                     new_tokens: int, with_llama_cpp: bool) -> dict[str, dict[str, float]]:
    """The ratio targets at ``context``, each timed in turns (the bf16 step against the probe and against
    transformers bf16, the best quantized step against llama.cpp): ``{target: {"measured", "spread", ...}}``.

    Why: the table's rows are timed minutes apart, and on a shared machine the probe and the rows move more than
    that (one full run on a 2-core EPYC VM: a probe of 25.5 GB/s at its start, against which the compiled bf16 row
    read 108%; probes in other runs 30-55 GB/s; llama.cpp's row 103-122 tok/s). In turns a slow or quick spell
    meets both sides alike."""
    at = {(r["name"], r["weights"]): r for r in rows if r["context"] == context}
    ids = filler_ids(lm.tokenizer, context, lm.device)
    out: dict[str, dict[str, float]] = {}
    if ("compiled step", "bfloat16") in at:
        bf16 = compiled_request(lm, step_forms["bfloat16"], context, new_tokens)
        out["bf16 share of ceiling"] = share_in_turns(lm, bf16, at["compiled step", "bfloat16"]["bytes_per_token"])
        hf_bf16 = lm.model if lm.dtype == torch.bfloat16 else copy.deepcopy(lm.model).to(torch.bfloat16)
        out["bf16 over transformers bf16"] = speed_ratio_in_turns(lm, bf16, (*decode_request(hf_bf16, ids, new_tokens), new_tokens))
    quantized = [r for r in rows if r["context"] == context and r["name"] == "compiled step" and r["weights"].startswith("int")]
    best = max(quantized, key=lambda r: r["tok_s"], default=None)
    if best and with_llama_cpp and any(name.startswith("llama.cpp") for name, _ in at):  # its row ran: it is installed
        peer_request = peer.LlamaCppRequest(ids[0].tolist(), new_tokens)
        try:
            theirs = (peer_request.prefill, peer_request.decode, new_tokens - 1)
            out["quantized over llama.cpp"] = {**speed_ratio_in_turns(
                lm, compiled_request(lm, step_forms[best["weights"]], context, new_tokens), theirs), "weights": best["weights"]}
        finally:
            peer_request.close()
    return out


def context_drops(rows: list[dict[str, Any]], in_turns: dict[str, dict[str, float]] | None = None
                  ) -> list[dict[str, Any]]:
    """Each compiled row's speed at the longest context over its speed at the shortest: measured, and predicted
    by the bytes a step reads (``bytes short / bytes long``: a step that only reads grows with its bytes).
    The measured ratio is the two rows' (``from_rows``), or, where ``in_turns[weights]`` holds one
    (:func:`fall_in_turns`), the one timed in turns, which judges the row.
    Met when the measured ratio is no lower than the prediction less its spread (the two timings'), taken no
    smaller than :data:`utils.decide.MIN_SPREAD` (two very steady timings still differ by their timer's grain)."""
    compiled = [r for r in rows if r["name"] == "compiled step"]
    short, long = min(r["context"] for r in rows), max(r["context"] for r in rows)
    out = []
    for r in (r for r in compiled if r["context"] == long and long > short):
        s = next((x for x in compiled if x["context"] == short and x["weights"] == r["weights"]), None)
        if s is None:
            continue
        from_rows, predicted = r["tok_s"] / s["tok_s"], s["bytes_per_token"] / r["bytes_per_token"]
        turns = (in_turns or {}).get(r["weights"])
        measured = turns["measured"] if turns else from_rows
        spread = turns["spread"] if turns else r.get("spread", 0) + s.get("spread", 0)
        out.append({"weights": r["weights"], "contexts": [short, long], "measured": round(measured, 3),
                    "from_rows": round(from_rows, 3), "in_turns": turns is not None,
                    "noisy": bool(turns and turns.get("noisy")),
                    "predicted_by_bytes": round(predicted, 3), "met": measured >= predicted * (1 - max(spread, MIN_SPREAD))})
    return out


def targets_at(rows: list[decode_table.Row], bandwidth: float) -> dict[str, Any]:
    """The fast path against :data:`TARGETS` at one context (None where a row is missing)."""
    by = {(r.name, r.weights): r for r in rows}
    compiled_bf16, hf_bf16 = by.get(("compiled step", "bfloat16")), by.get(("transformers", "bfloat16"))
    quantized = [r for r in rows if r.name == "compiled step" and r.weights.startswith("int")]
    best_q = max(quantized, key=lambda r: r.tok_s, default=None)
    peer_row = next((r for r in rows if r.name.startswith("llama.cpp")), None)
    return {
        "bf16 share of ceiling": compiled_bf16 and round(compiled_bf16.share(bandwidth), 3),
        "bf16 over transformers bf16": compiled_bf16 and hf_bf16 and round(compiled_bf16.tok_s / hf_bf16.tok_s, 2),
        "bf16 tokens": compiled_bf16 and compiled_bf16.agree,
        "quantized over llama.cpp": best_q and peer_row and round(best_q.tok_s / peer_row.tok_s, 2),
        "best quantized": best_q and f"{best_q.weights}: {best_q.agree}",
    }


def run_fast_path(lm: LoadedModel, contexts: list[int], new_tokens: int, repeats: int, quick: bool,
                  bandwidth: float, with_llama_cpp: bool = True, server: str | None = None) -> dict[str, Any]:
    """The fast-path table at each context, the kernels' own speed, llama.cpp and the targets; with ``server``
    (a base URL, or ``"llama.cpp"``: its server on the embedded file, see :func:`serving`), its row over HTTP."""
    forms = fast_models(lm, quick)
    # quick (CI): compile only the row that meets llama.cpp; the roofline lab compiles bf16 in the same run
    compiled = [QUICK_COMPILED] if quick else None
    step_forms = step_forms_of(forms, compiled)
    kernels = {w: round(bytes_read_per_token(m) / fast.projections_seconds(m) / 1e9, 2) for w, m in forms.items()}
    out: dict[str, Any] = {"rows": [], "kernel_GBps": kernels, "targets": {}, "llama_cpp": "not asked for",
                           "own_kernels": kernel_comparison(lm, forms, new_tokens)}
    if not quick and lm.device.type == "cpu":  # once per environment, not a variant's compile: timed apart
        out["inductor_headers_s"] = round(fast.build_headers(), 1)
        print(f"inductor's precompiled headers for this environment (built once, before the steps): "
              f"{out['inductor_headers_s']:.1f} s", flush=True)
    if not quick:  # a whole step builds in half a minute to a minute, once per machine: not in CI's quick run
        out["layer_groups"] = [c for w in LAYERED_COMPARED if (c := layered_comparison(lm, forms, contexts[0], new_tokens, w))]
    for context in contexts:
        rows = fast_rows_at(lm, forms, context, new_tokens, repeats, compiled, step_forms=step_forms)
        if with_llama_cpp:
            fp32 = next((r for r in rows if r.weights == "float32"), None)
            fp32_tokens = fp32.tokens if fp32 else generate(copy.deepcopy(forms["bfloat16"]).float(),
                                                            filler_ids(lm.tokenizer, context, lm.device), new_tokens)[0].tolist()
            peer_row, out["llama_cpp"] = decode_table.llama_cpp_row(lm, context, new_tokens, repeats, fp32_tokens)
            rows += [peer_row] if peer_row else []
            out["llama_cpp"] = out["llama_cpp"] or "ok"
        if server:  # started for its row only: no idle server beside the other rows' timings
            with serving(server, lm, context + new_tokens + 8) as (url, why):
                row, out["server"] = (server_row(lm, url, server == "llama.cpp", context, new_tokens, repeats,
                                                 next((r for r in rows if r.name.startswith("llama.cpp")), None))
                                      if url else (None, why))
            rows += [row] if row else []
        baseline = next(r for r in rows if r.name == "transformers" and r.weights == "bfloat16")
        print_rows_at(rows, bandwidth, baseline, out["llama_cpp"])
        if server:
            print(f"{context:>7}  server: {out['server']}")
        out["rows"] += [r.as_dict(bandwidth, baseline.tok_s) for r in rows]
        out["targets"][str(context)] = targets_at(rows, bandwidth)
    in_turns = {} if quick or len(contexts) < 2 else {  # every compiled row of the full run
        w: fall_in_turns(lm, m, (contexts[0], contexts[-1]), new_tokens) for w, m in step_forms.items()}
    out["context_drops"] = context_drops(out["rows"], in_turns)
    if not quick:
        out["stream_ahead"] = stream_ahead_in_turns(lm, step_forms, contexts, new_tokens)
    for context in [] if quick else contexts:  # the full run judges the ratio targets timed in turns
        turns = targets_in_turns(lm, step_forms, out["rows"], context, new_tokens, with_llama_cpp)
        got = out["targets"][str(context)]
        got.update({f"{name} (tables)": got[name] for name in turns})
        got.update({name: t["measured"] for name, t in turns.items()}, in_turns=turns)
    return out


def server_row(lm: LoadedModel, url: str, local: bool, context: int, new_tokens: int, repeats: int,
               peer_row: decode_table.Row | None) -> tuple[decode_table.Row | None, str]:
    """A server measured from outside (:func:`utils.openai_client.measure_speed`, one request at a time) on the
    table's prompt, as token ids: a row, and a note (its ratio to llama.cpp in process, or why there is no row).
    ``local``: it is llama.cpp's server on the embedded file, started by :func:`serving`."""
    try:
        speed = measure_speed(Client(url), filler_ids(lm.tokenizer, context)[0].tolist(), new_tokens,
                              repeats=repeats, **(llama_server.LlamaServer.EXACT if local else {"ignore_eos": True}))
    except ServerError as e:
        return None, f"no row: {e}"
    agree, note = "", "ok"
    if local and peer_row is not None:
        at = next((i for i, (x, y) in enumerate(zip(speed.text, peer_row.text)) if x != y), None)
        agree = ("same text as llama.cpp in process" if speed.text == peer_row.text
                 else f"text parts from llama.cpp in process at character {at}")
        ratio, (low, high) = speed.decode_tok_s / peer_row.tok_s, llama_server.HTTP_BAND
        note = (f"over HTTP / in process: {ratio:.2f}x, {'within' if low <= ratio <= high else 'OUTSIDE'} the band "
                f"{low}-{high}x (same kernels; llama_server.HTTP_BAND says why)")
    return decode_table.Row("llama-server over HTTP" if local else f"server {url}",
                    peer_row.weights if local and peer_row else "as served", context, speed.decode_tok_s,
                    peer_row.bytes_per_token if local and peer_row else 0.0, agree, noisy=speed.relative_spread > 0.25,
                    spread=speed.relative_spread, text=speed.text), note


@contextlib.contextmanager
def serving(server: str, lm: LoadedModel, longest: int) -> Iterator[tuple[str | None, str]]:
    """Yield (the server's URL, ""): ``server`` itself, or, for ``"llama.cpp"``, llama.cpp's server started here on
    the embedded file (one slot, room for ``longest`` tokens) and stopped at the end; or (None, why there is none:
    llama.cpp's server on another model, or not built), and the table goes on without its row."""
    if server != "llama.cpp":
        yield server, ""
        return
    why = ("it serves the embedded GGUF file on the CPU, not this model" if lm.name != EMBEDDED or lm.device.type != "cpu"
           else llama_server.status())  # main() built it before measuring: a build must not share the CPU with a timing
    if why:
        yield None, f"no row: {why}"
        return
    with llama_server.LlamaServer(parallel=1, context_per_slot=longest) as s:
        yield s.url, ""


def print_rows_at(rows: list[decode_table.Row], bandwidth: float, baseline: decode_table.Row, peer_note: str) -> None:
    """One context's table, as it is measured (a long run shows its progress)."""
    print(f"\nfast path at {rows[0].context} tokens of context (ceiling = {bandwidth / 1e9:.1f} GB/s ÷ MB/tok; "
          f"speed-up over transformers bf16):")
    decode_table.print_rows(rows, bandwidth, baseline)
    if peer_note != "ok":
        print(f"{rows[0].context:>7}  llama.cpp: no row ({peer_note})")
    elif imitated := os.environ.get("ATEN_CPU_CAPABILITY"):
        print(f"{rows[0].context:>7}  llama.cpp: built for this CPU's own instruction sets; ATEN_CPU_CAPABILITY={imitated} "
              "imitates a plainer CPU for PyTorch and the workbook's kernels only, so its ratio to llama.cpp here is "
              "not a laptop's")


def print_targets(fp: dict[str, Any]) -> None:
    """Each target, met or not, from this run's numbers; and what the matmul kernels allow."""
    print("kernels      projections alone read their weights at " +
          ", ".join(f"{w} {v} GB/s" for w, v in fp["kernel_GBps"].items()))
    for weights, c in fp.get("own_kernels", {}).items():
        print(f"kernels      {weights}: the workbook's kernels {c['workbook_GBps']} GB/s, the same weights on aten's "
              f"{c['aten_GBps']} GB/s ({c['speedup']:.2f}x); eager, {c['tokens']}")
    if fp.get("stream_ahead"):
        pairs = "; ".join(f"{a['weights']} @{a['context']} {a['speed ratio']:.3f}x (spread {a['spread']:.0%}"
                          f"{', NOISY: not to publish' if a.get('noisy') else ''})" for a in fp["stream_ahead"])
        same = all(a["tokens equal"] for a in fp["stream_ahead"])
        print(f"kernels      the weights asked for {cpu_linear.STREAM_AHEAD // 1024} KiB ahead (PREFETCHNTA) against "
              f"not, each compiled step timed in turns: {pairs}; greedy tokens "
              f"{'equal in every pair' if same else 'NOT equal in some pair'}")
    for c in fp.get("layer_groups", []):
        print(f"compile      {c['weights']} @{c['context']}: by layer groups, first call {c['layer groups first call']}, "
              f"{c['layer groups tok/s']} tok/s; the whole step, first call {c['whole step first call']}, "
              f"{c['whole step tok/s']} tok/s (timed in turns: {c['speed ratio']:.3f}x); {c['tokens']}")
    for context, got in fp["targets"].items():
        turns = got.get("in_turns", {})
        parts = []
        for name, floor in TARGETS.items():
            v = got.get(name)
            verdict = ("no row" if v is None else "NOISY: not judged, run again" if turns.get(name, {}).get("noisy")
                       else "met" if v >= floor else "not met")
            parts.append(f"{name} {'n/a' if v is None else v} ({verdict}, target {floor})")
        print(f"targets @{context:>5}  " + "; ".join(parts))
        for name, t in turns.items():
            probe = f", the probe reading {t['GBps']} GB/s" if "GBps" in t else ""
            print(f"targets @{context:>5}  {name} {t['measured']} timed in turns (spread {t['spread']:.0%}{probe}"
                  f"{', NOISY: not to publish' if t.get('noisy') else ''}); from the tables: {got.get(name + ' (tables)')}")
        if (asks := speedup_asks(turns)) is not None:
            print(f"targets @{context:>5}  {asks}")
    for d in fp.get("context_drops", []):
        (short, long) = d["contexts"]
        ok = "NOISY: not judged, run again" if d.get("noisy") else "met" if d["met"] else "not met"
        how = f" timed in turns ({d['from_rows']:.2f} from the two tables)" if d.get("in_turns") else ""
        print(f"targets      {d['weights']}: tok/s at {long:,} / at {short:,} = {d['measured']:.2f}{how}, its bytes "
              f"predict {d['predicted_by_bytes']:.2f} ({ok}: it may fall no more than its KV bytes predict)")
    print_compile_targets(fp["rows"], fp.get("layer_groups", []))


def speedup_asks(turns: dict[str, dict[str, Any]]) -> str | None:
    """What the bf16 speed-up target asked of the memory in this run: 3.5x transformers bf16's tok/s (timed in turns)
    as a share of the ceiling the probe read in turns (the bf16 share's pair). transformers' step is bound by its
    per-operator work, not by bytes: on a quick spell of the CPU it gains more than a bandwidth-bound step can, and
    above 100% of the ceiling no bf16 step could meet the target at that moment. None without both pairs."""
    ratio, share = turns.get("bf16 over transformers bf16", {}), turns.get("bf16 share of ceiling", {})
    if "theirs tok/s" not in ratio or "ceiling tok/s" not in share:
        return None
    need = TARGETS["bf16 over transformers bf16"] * ratio["theirs tok/s"]
    asks = need / share["ceiling tok/s"]
    return (f"bf16 over transformers bf16: transformers bf16 ran {ratio['theirs tok/s']} tok/s in turns, so the target "
            f"asks {need:.1f} tok/s of the bf16 step (it ran {ratio['ours tok/s']}): {asks:.0%} of the ceiling at the "
            f"probe's {share['GBps']} GB/s in turns ({share['ceiling tok/s']} tok/s)"
            + ("; above the ceiling: no bf16 step could meet it then" if asks > 1 else ""))


def print_compile_targets(rows: list[dict[str, Any]], layer_groups: list[dict[str, Any]] | None = None) -> None:
    """The compile targets from this run: a step built here within :data:`COLD_COMPILE_S` (a row's, or the
    layer-group comparison's: the same step, built there first where it runs before the rows), and one loaded from
    disk (by this run's second decoder, or because an earlier run built it) within :data:`WARM_COMPILE_S`."""
    compiled = [r for r in rows if r.get("compile_s")]
    cold = {f"{r['weights']} @{r['context']}": r["compile_s"] for r in compiled if r.get("compiled_how") != "loaded"}
    cold |= {f"{c['weights']} @{c['context']} (layer-group comparison)": c["compile_s"] for c in layer_groups or []
             if c.get("compiled_how") == "built"}
    warm = {f"{r['weights']} @{r['context']}": r["compile_s"] if r.get("compiled_how") == "loaded" else r.get("reload_s")
            for r in compiled}
    for what, times, limit in [("cold: its first call in this process, built here", cold, COLD_COMPILE_S),
                               ("a second time: loaded from disk", warm, WARM_COMPILE_S)]:
        got = {k: v for k, v in times.items() if v is not None}
        over = {k: v for k, v in got.items() if v > limit}
        verdict = ("no row" if not got else "met" if not over
                   else "not met for " + ", ".join(f"{k} ({v:.0f} s)" for k, v in over.items()))
        print(f"targets      compile <= {limit:.0f} s per variant ({what}): {verdict}; "
              f"slowest {max(got.values(), default=0):.1f} s")


def print_table(r: dict[str, Any]) -> None:
    """The figures, readable."""
    m = r["machine"]
    print(f"device       {m['device_name']} ({m['device']}), {m['torch_threads']} threads, "
          f"torch {m['torch_version']}, transformers {m['transformers_version']}")
    print(f"model        {r['model']['name']} in {r['model']['dtype']}, "
          f"{r['model']['weight_bytes'] / 1e6:.0f} MB of weights")
    print(f"bandwidth    {r['bandwidth_GBps']} GB/s measured; matmul {r['matmul_GFLOPs']} GFLOP/s")
    for n, v in r["prefill_tok_s"].items():
        print(f"prefill      {n:>5} tokens: {v:>9.1f} tok/s")
    print(f"decode       transformers {r['decode_tok_s_transformers']} tok/s; hand-written "
          f"{r['decode_tok_s_hand_written']} tok/s (greedy tokens agree {r['decode_tokens_agree']}); ceiling (prediction) {r['decode_ceiling_tok_s']} tok/s; "
          f"transformers reaches {100 * r['decode_share_of_ceiling']:.0f}% of it")
    if "fast_path" in r:
        print_targets(r["fast_path"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="Prefill/decode reference benchmark (last line: JSON).")
    p.add_argument("--model", default=None, help="hub id or folder (default: embedded SmolLM2-135M)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fast-path", action="store_true", help="add the roofline lab's table (compiles: minutes)")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024], help="fast-path context lengths")
    p.add_argument("--quick", action="store_true", help="fast path: bf16 eager rows and the compiled int4 row only (CI)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out of the fast-path table")
    p.add_argument("--server", default=None, metavar="URL",
                   help="add an OpenAI-compatible server's row to the fast-path table, measured over HTTP "
                        "(e.g. http://127.0.0.1:8080/v1); 'llama.cpp' starts llama.cpp's server here on the embedded file")
    a = p.parse_args(argv)
    if a.server and not a.fast_path:
        p.error("--server adds a row to the fast-path table: add --fast-path")
    start = time.perf_counter()
    if a.fast_path and not a.no_llama_cpp:
        why = peer.ensure_installed()  # before measuring: a build must not share the CPU with a timing
        print(f"llama.cpp: {why or 'installed'}", flush=True)
    lm = load_model(a.model, a.device, a.dtype)
    if lm.random_weights:
        print(f"{lm.name}: random weights. Speeds are real; the tokens mean nothing (agreement still counts).")
    if a.server == "llama.cpp" and lm.name == EMBEDDED:
        print(f"llama-server: {llama_server.ensure_built() or 'built'}", flush=True)  # before measuring, like llama.cpp
    result = run(lm, sorted(a.prompt_tokens), a.new_tokens, a.repeats)
    if a.fast_path:
        result["fast_path"] = run_fast_path(lm, sorted(a.contexts), a.new_tokens, a.repeats, a.quick,
                                            result["bandwidth_GBps"] * 1e9, not a.no_llama_cpp, a.server)
    result["bench_seconds"] = round(time.perf_counter() - start, 1)
    print_table(result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

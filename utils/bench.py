"""Reference benchmark: prefill and decode of the configured model on this machine.

    python -m utils.bench [--prompt-tokens 128 512] [--new-tokens 64] [--repeats 3]

Measures, with the workbook's protocol (warm-up, repeats, median): memory bandwidth
and matmul FLOP/s of the device, prefill tok/s at each prompt length, decode tok/s
through transformers and through the hand-written loop (:func:`utils.engine.decode_speed`
for both); then the decode ceiling ``bandwidth / bytes per token`` and the share of it
reached. Prints a readable table, then one JSON line last (machine-readable, for
collecting results from many machines: ``make bench | tail -1``).

Model, device and dtype follow ``WORKBOOK_MODEL`` / ``WORKBOOK_DEVICE`` /
``WORKBOOK_DTYPE`` or the flags.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from .engine import decode_speed, generate, measure_prefill
from .hardware import describe_machine, measure_matmul_flops, probe_bandwidth
from .llama import Llama
from .models import LoadedModel, load_model
from .roofline import decode_bytes_per_token, decode_ceiling_tok_s
from .tokens import filler_ids


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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="Prefill/decode reference benchmark (last line: JSON).")
    p.add_argument("--model", default=None, help="hub id or folder (default: embedded SmolLM2-135M)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    start = time.perf_counter()
    lm = load_model(a.model, a.device, a.dtype)
    result = run(lm, sorted(a.prompt_tokens), a.new_tokens, a.repeats)
    result["bench_seconds"] = round(time.perf_counter() - start, 1)
    print_table(result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""The benchmark runs end to end and its last line is JSON with the figures."""

from __future__ import annotations

import json
import threading

from utils import bench


def test_bench_last_line_is_json(capsys):
    result = bench.main(["--prompt-tokens", "8", "16", "--new-tokens", "3", "--repeats", "1",
                         "--device", "cpu", "--dtype", "float32"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    parsed = json.loads(last)
    assert parsed == json.loads(json.dumps(result))
    assert set(parsed["prefill_tok_s"]) == {"8", "16"}
    assert parsed["decode_new_tokens"] == 3 and parsed["decode_tok_s_transformers"] > 0
    assert parsed["bandwidth_GBps"] > 0 and parsed["machine"]["torch_version"]
    assert 0 < parsed["decode_share_of_ceiling"]
    assert parsed["decode_tokens_agree"] == "3/3"  # float32: the two loops make the same tokens


def test_bench_accepts_a_shape_only_model(capsys):
    result = bench.main(["--model", "shape:smollm2-135m", "--prompt-tokens", "8", "--new-tokens", "3",
                         "--repeats", "1", "--device", "cpu", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert "random weights" in out and result["model"]["name"] == "shape:smollm2-135m"
    assert result["model"]["n_params"] == 134_515_008 and result["decode_tok_s_transformers"] > 0


def test_a_server_row_is_measured_over_http_and_a_missing_server_is_a_note(lm, monkeypatch, tmp_path):
    """``--server URL``: the row of any OpenAI-compatible server (here a stand-in on 127.0.0.1 that streams one
    token every 5 ms), and for ``llama.cpp`` where it is not built, a note instead of a row."""
    from tests.test_openai_client import FakeServer, Plan  # the fake server of the client's tests

    server = FakeServer(Plan(gap=0.005))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        row, note = bench.server_row(lm, server.url, False, 16, 6, 2, None)
    finally:
        server.shutdown()
        server.server_close()
    assert note == "ok" and row.name == f"server {server.url}" and row.bytes_per_token == 0.0
    assert 50 < row.tok_s <= 1 / 0.005 * 1.05, row.tok_s  # 5 gaps of >= 5 ms each
    assert all(body["prompt"] == bench.filler_ids(lm.tokenizer, 16)[0].tolist() and body["ignore_eos"]
               for _, body, _ in server.seen)
    gone, _ = bench.server_row(lm, server.url, False, 16, 6, 2, None)  # stopped: no row, the error as the note
    assert gone is None
    monkeypatch.setenv("WORKBOOK_LLAMA_SERVER", str(tmp_path / "nowhere"))
    with bench.serving("llama.cpp", lm, 64) as (url, why):
        assert url is None and "not an executable file" in why


def test_a_rows_fall_with_context_is_judged_against_its_bytes(capsys):
    def row(weights, context, tok_s, mb, spread=0.02):
        return {"name": "compiled step", "weights": weights, "context": context, "tok_s": tok_s,
                "bytes_per_token": mb * 1e6, "spread": spread, "compile_s": 12.0 if context == 128 else 25.0}
    rows = [row("bfloat16", 128, 65.0, 273), row("bfloat16", 1024, 57.4, 293),  # falls 12%, bytes predict 7%
            row("int4", 128, 90.0, 98), row("int4", 1024, 30.6, 119),  # falls 66%: something grows beyond bytes
            {**row("bfloat16", 1024, 50.0, 293), "name": "transformers"}]
    drops = {d["weights"]: d for d in bench.context_drops(rows)}
    assert drops["bfloat16"]["predicted_by_bytes"] == round(273 / 293, 3) and drops["bfloat16"]["measured"] == round(57.4 / 65, 3)
    assert not drops["int4"]["met"] and not drops["bfloat16"]["met"]  # 0.883 < 0.932 x (1 - 0.04)
    assert bench.context_drops([row("bfloat16", 128, 65.0, 273), row("bfloat16", 1024, 62.0, 293)])[0]["met"]
    # two steady timings (spread 0, as an H200 gave) 0.6% under the bytes' prediction: within a timer's grain
    steady = bench.context_drops([row("bfloat16", 128, 851.8, 2476, 0.0), row("bfloat16", 1024, 836.8, 2506, 0.0)])
    assert steady[0]["met"] and steady[0]["measured"] < steady[0]["predicted_by_bytes"]
    # timed in turns, the row's fall judges it; the tables' ratio is kept beside it
    turns = bench.context_drops(rows, {"bfloat16": {"measured": 0.925, "spread": 0.01}})
    assert turns[0]["met"] and turns[0]["in_turns"] and turns[0]["from_rows"] == round(57.4 / 65, 3)
    assert not turns[1]["met"] and not turns[1]["in_turns"]
    bench.print_targets({"kernel_GBps": {}, "targets": {}, "rows": rows, "context_drops": list(drops.values()) + turns[:1]})
    out = capsys.readouterr().out
    assert "int4: tok/s at 1,024 / at 128 = 0.34, its bytes predict 0.82 (not met" in out
    assert "bfloat16: tok/s at 1,024 / at 128 = 0.93 timed in turns (0.88 from the two tables), its bytes predict 0.93 (met" in out
    assert "not met for bfloat16 @1024 (25 s), int4 @1024 (25 s)" in out
    assert "(a second time: loaded from disk): no row" in out


def test_the_compile_targets_judge_built_and_loaded_steps_apart(capsys):
    rows = [{"weights": "bfloat16", "context": 128, "compile_s": 45.0, "compiled_how": "built", "reload_s": 0.8},
            {"weights": "int4", "context": 128, "compile_s": 1.2, "compiled_how": "loaded", "reload_s": None},
            {"weights": "int4", "context": 1024, "compile_s": 12.0, "compiled_how": "built", "reload_s": 6.5}]
    bench.print_compile_targets(rows)
    cold, warm = capsys.readouterr().out.splitlines()
    assert "built here): not met for bfloat16 @128 (45 s); slowest 45.0 s" in cold  # a loaded step is not cold
    assert "loaded from disk): not met for int4 @1024 (6 s); slowest 6.5 s" in warm
    groups = [{"weights": "float32", "context": 128, "compile_s": 26.5, "compiled_how": "built"},
              {"weights": "int4", "context": 128, "compile_s": 0.3, "compiled_how": "loaded"}]
    bench.print_compile_targets(rows[1:], groups)  # the int4 @128 row loaded what the comparison built, or not
    cold = capsys.readouterr().out.splitlines()[0]
    assert "not met for float32 @128 (layer-group comparison) (26 s); slowest 26.5 s" in cold


def test_the_workbook_quant_kernels_are_timed_against_atens_on_the_same_weights(lm, capsys):
    """Each form that can run on the workbook's CPU kernels gets a line (a float form on utils.cpu_linear, a quantized
    one on utils.cpu_quant): its projections' speed on both kernels and the two eager token streams compared; a
    quantized form built for PyTorch's kernels gets none."""
    import copy

    from utils import quant
    from utils.llama import Llama

    fp32 = Llama.from_hf(lm.model).float()
    forms = {"bfloat16": copy.deepcopy(fp32).bfloat16(), "int8": quant.quantized_copy(fp32, 8, 8),
             "int4 g32 + int8 head": quant.quantized_copy(fp32, 4, 8, kernel="aten")}
    got = bench.kernel_comparison(lm, forms, 4)
    assert list(got) == ["bfloat16", "int8"]
    for weights in got:
        assert got[weights]["workbook_GBps"] > 0 and got[weights]["aten_GBps"] > 0
        assert "/4 greedy tokens equal" in got[weights]["tokens"]
    bench.print_targets({"kernel_GBps": {}, "targets": {}, "rows": [], "own_kernels": got})
    assert "int8: the workbook's kernels" in capsys.readouterr().out


def test_the_layer_groups_are_timed_against_the_whole_step(capsys):
    """The full bench times the quick row's step built by layer groups against the same model's whole step, with
    their tokens compared (here on the small test model: one group of its 4 blocks; in the step cache the bench
    uses, so a machine builds them once); a form on PyTorch's kernels (built whole) gets no line."""
    import pytest
    import torch

    from tests.test_report import TEST_MODEL_DIR
    from utils import quant
    from utils.models import load_model

    if not (TEST_MODEL_DIR / "config.json").exists():
        pytest.skip(f"no test model at {TEST_MODEL_DIR}: run `make model`")
    if quant.kernel_here(torch.device("cpu")) != "workbook":
        pytest.skip("the workbook's kernels are not built here")
    lm = load_model(str(TEST_MODEL_DIR), "cpu", "float32")
    forms = bench.fast_models(lm, quick=True)
    got = bench.layered_comparison(lm, forms, 16, 8)
    assert got["tokens"] == "8/8 greedy tokens equal" and got["speed ratio"] > 0
    assert all(got[f"{how} first call"].split()[0] in ("built", "loaded") for how in ("layer groups", "whole step"))
    bench.print_targets({"kernel_GBps": {}, "targets": {}, "rows": [], "layer_groups": [got]})
    assert "by layer groups, first call " in capsys.readouterr().out
    fall = bench.fall_in_turns(lm, forms[bench.QUICK_COMPILED], (16, 48), 8, repeats=2)
    assert 0 < fall["measured"] < 2 and fall["spread"] >= 0 and isinstance(fall["noisy"], bool)
    step = bench.compiled_request(lm, forms[bench.QUICK_COMPILED], 16, 8)
    share = bench.share_in_turns(lm, step, 1e6, repeats=2)  # 1 MB a step: a tiny share
    assert 0 < share["measured"] < 1 and share["spread"] >= 0 and share["GBps"] > 0 and isinstance(share["noisy"], bool)
    ratio = bench.speed_ratio_in_turns(lm, step, (*bench.decode_request(lm.model, bench.filler_ids(lm.tokenizer, 16), 8), 8),
                                       repeats=2)
    assert ratio["measured"] > 1 and ratio["spread"] >= 0  # the compiled int4 step against transformers' float32 loop
    assert isinstance(ratio["noisy"], bool)  # a noisy pair was timed once more; still noisy, it is flagged
    assert ratio["ours tok/s"] / ratio["theirs tok/s"] == pytest.approx(ratio["measured"], rel=0.01)
    assert share["ceiling tok/s"] == pytest.approx(share["GBps"] * 1e9 / 1e6, rel=0.01)
    row = {"context": 16, "name": "compiled step", "weights": "bfloat16", "bytes_per_token": 1e6, "tok_s": 1.0}
    turns = bench.targets_in_turns(lm, {"bfloat16": forms[bench.QUICK_COMPILED]}, [row], 16, 8, with_llama_cpp=True)
    assert set(turns) == {"bf16 share of ceiling", "bf16 over transformers bf16"}  # no llama.cpp row: no such target
    ahead = bench.stream_ahead_in_turns(lm, {"int4": forms[bench.QUICK_COMPILED]}, [16, 48], 8, repeats=2)
    assert [(a["weights"], a["context"], a["tokens equal"]) for a in ahead] == [("int4", 16, True), ("int4", 48, True)]
    assert all(a["speed ratio"] > 0 and a["spread"] >= 0 for a in ahead)
    bench.print_targets({"kernel_GBps": {}, "targets": {}, "rows": [], "stream_ahead": ahead})
    assert "KiB ahead (PREFETCHNTA) against not" in capsys.readouterr().out
    forms[bench.QUICK_COMPILED] = quant.quantized_copy(bench.Llama.from_hf(lm.model).float(), 4, 8, kernel="aten")
    assert bench.layered_comparison(lm, forms, 16, 8) == {}


def test_under_an_imitated_cpu_the_llama_cpp_row_says_it_is_not_imitated(capsys, monkeypatch):
    """ATEN_CPU_CAPABILITY reaches PyTorch and the workbook's kernels, not llama.cpp's build: the table says so."""
    from utils.decode_table import Row

    rows = [Row("transformers", "bfloat16", 128, 20.0, 2.7e8), Row("llama.cpp 0.3", "Q4_1 (GGUF file)", 128, 90.0, 1e8)]
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    bench.print_rows_at(rows, 2e10, rows[0], "ok")
    assert "not a laptop's" not in capsys.readouterr().out
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    bench.print_rows_at(rows, 2e10, rows[0], "ok")
    assert "ATEN_CPU_CAPABILITY=avx2 imitates a plainer CPU" in capsys.readouterr().out


def test_the_ratio_targets_are_judged_in_turns_and_the_tables_ratios_are_printed_beside_them(capsys):
    turns = {"bf16 share of ceiling": {"measured": 0.84, "spread": 0.05, "GBps": 31.2},
             "quantized over llama.cpp": {"measured": 1.19, "spread": 0.04, "weights": "int8"}}
    bench.print_targets({"kernel_GBps": {}, "rows": [], "targets": {"128": {
        "bf16 share of ceiling": 0.84, "bf16 share of ceiling (tables)": 1.079, "quantized over llama.cpp": 1.19,
        "quantized over llama.cpp (tables)": 1.38, "in_turns": turns}}})
    out = capsys.readouterr().out
    assert "bf16 share of ceiling 0.84 (met, target 0.8)" in out and "quantized over llama.cpp 1.19 (not met" in out
    assert "bf16 share of ceiling 0.84 timed in turns (spread 5%, the probe reading 31.2 GB/s); from the tables: 1.079" in out
    assert "quantized over llama.cpp 1.19 timed in turns (spread 4%); from the tables: 1.38" in out


def test_the_speedup_target_says_what_it_asks_of_the_ceiling(capsys):
    """3.5x transformers bf16's tok/s (in turns) over the ceiling the probe read in turns: this run's bound."""
    turns = {"bf16 share of ceiling": {"measured": 0.875, "spread": 0.05, "GBps": 43.16, "ceiling tok/s": 158.3},
             "bf16 over transformers bf16": {"measured": 3.188, "spread": 0.06, "ours tok/s": 138.5,
                                             "theirs tok/s": 43.4}}
    assert bench.speedup_asks(turns) == (
        "bf16 over transformers bf16: transformers bf16 ran 43.4 tok/s in turns, so the target asks 151.9 tok/s of the "
        "bf16 step (it ran 138.5): 96% of the ceiling at the probe's 43.16 GB/s in turns (158.3 tok/s)")
    turns["bf16 over transformers bf16"]["theirs tok/s"] = 48.0
    assert bench.speedup_asks(turns).endswith("106% of the ceiling at the probe's 43.16 GB/s in turns (158.3 tok/s); "
                                              "above the ceiling: no bf16 step could meet it then")
    assert bench.speedup_asks({"bf16 share of ceiling": turns["bf16 share of ceiling"]}) is None
    bench.print_targets({"kernel_GBps": {}, "rows": [], "targets": {"128": {"in_turns": turns}}})
    assert "targets @  128  bf16 over transformers bf16: transformers bf16 ran 48.0 tok/s" in capsys.readouterr().out


def test_a_noisy_target_timed_in_turns_is_flagged_not_judged(capsys):
    """A target whose timings in turns stayed noisy after their second round is printed as noisy, neither met nor
    not met (the rule: a noisy measurement is re-measured, not published); so is a noisy fall with context."""
    turns = {"bf16 share of ceiling": {"measured": 0.796, "spread": 0.5, "GBps": 49.9, "noisy": True},
             "bf16 over transformers bf16": {"measured": 3.9, "spread": 0.2, "noisy": False}}
    drop = {"weights": "int8", "contexts": [128, 1024], "measured": 0.6, "from_rows": 0.59, "in_turns": True,
            "predicted_by_bytes": 0.87, "met": False, "noisy": True}
    bench.print_targets({"kernel_GBps": {}, "rows": [], "context_drops": [drop], "targets": {"128": {
        "bf16 share of ceiling": 0.796, "bf16 share of ceiling (tables)": 0.93, "bf16 over transformers bf16": 3.9,
        "bf16 over transformers bf16 (tables)": 5.4, "in_turns": turns}}})
    out = capsys.readouterr().out
    assert "bf16 share of ceiling 0.796 (NOISY: not judged, run again, target 0.8)" in out
    assert "bf16 over transformers bf16 3.9 (met, target 3.5)" in out
    assert "timed in turns (spread 50%, the probe reading 49.9 GB/s, NOISY: not to publish)" in out
    assert "(spread 20%)" in out and "int8: tok/s at 1,024 / at 128 = 0.60" in out
    assert "(NOISY: not judged, run again: it may fall no more" in out


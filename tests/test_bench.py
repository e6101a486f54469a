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

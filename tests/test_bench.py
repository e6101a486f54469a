"""The benchmark runs end to end and its last line is JSON with the figures."""

from __future__ import annotations

import json

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

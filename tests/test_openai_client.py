"""The streaming client and the load generator against a small fake server on 127.0.0.1.

The fake server streams Server-Sent Events as an OpenAI-compatible engine does, with planted
sleeps (time to the first token, gaps between chunks) and planted failures (a drop mid-stream,
a chunk that is not JSON, silence, 500, 401, an empty stream). Nothing beyond 127.0.0.1 is
contacted. A request's behaviour can also be set in its prompt text: ``"ttft=0.8 gap=0.02"``.
Timing asserts have wide upper margins: the sleeps are the server's, not CPU work.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from utils.errors import WorkbookError
from utils.load_generator import (FAILED, NOT_RUN, OK, run_arrivals, run_concurrent, sweep_concurrency,
                                  weight_read_gain)
from utils.openai_client import Client, ServerError, StreamResult, measure_speed, meter_line
from utils.requests import Request, synthetic_trace

PIECES = ("The", " capital", " of", " France", " is", " Paris")


@dataclass(frozen=True)
class Plan:
    """How the fake server answers every POST (a prompt like ``"ttft=0.1 gap=0.02 status=500"`` overrides)."""

    ttft: float = 0.0
    gap: float = 0.0
    mode: str = "normal"  # normal | drop | garbage | error | silent | stall | empty | status
    status: int = 200
    usage: bool = True
    chunked: bool = False  # HTTP/1.1 chunked transfer encoding, as uvicorn-based servers send
    api_key: str | None = None  # required key, if any
    timings: float = 0.0  # > 0: the last chunk carries llama.cpp's "timings" with this predicted_per_second


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, plan: Plan) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.plan, self.seen, self.stopping = plan, [], threading.Event()

    def handle_error(self, request, client_address) -> None:  # a client that hung up: expected here
        pass

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class FakeHandler(BaseHTTPRequestHandler):
    disable_nagle_algorithm = True  # each chunk leaves when written, as a real engine's do
    server: FakeServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, body, dict(self.headers)))
        plan = _plan_from_prompt(self.server.plan, body)
        if plan.api_key and self.headers.get("Authorization") != f"Bearer {plan.api_key}":
            return self._json(401, {"error": {"message": "Invalid API key", "type": "invalid_request_error"}})
        if plan.mode == "status":
            return self._json(plan.status, {"error": {"message": "the engine fell over", "type": "server_error"}})
        if plan.mode == "silent":  # accept, read, then say nothing
            self.server.stopping.wait(10)
            return
        if plan.chunked:
            self.protocol_version = "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if plan.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._stream(plan, body)

    def _stream(self, plan: Plan, body: dict) -> None:
        chat = self.path.endswith("/chat/completions")
        if chat:  # a role-only first chunk: no text, so not the first token
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, plan)
        if plan.mode == "empty":
            return self._end(plan)
        pieces = [PIECES[i % len(PIECES)] for i in range(body["max_tokens"])]
        time.sleep(plan.ttft)
        for i, piece in enumerate(pieces):
            if i:
                time.sleep(plan.gap)
            if plan.mode == "stall" and i == 1:
                self.server.stopping.wait(10)
                return
            last = "length" if i == len(pieces) - 1 else None
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            self._event({"choices": [{**choice, "finish_reason": last}]}, plan)
            if plan.mode == "drop" and i == 1:
                self.close_connection = True
                return  # no terminating chunk, no [DONE]: the connection just closes
            if plan.mode == "error" and i == 1:
                return self._event({"error": {"message": "out of KV blocks", "code": 500}}, plan)
            if plan.mode == "garbage" and i == 1:
                self._write(b'data: {"choices": [{"text": " oops"\n\n', plan)
        if plan.usage:
            usage = {"prompt_tokens": 17, "completion_tokens": len(pieces), "total_tokens": 17 + len(pieces)}
            extra = {"timings": {"predicted_per_second": plan.timings}} if plan.timings else {}
            self._event({"choices": [], "usage": usage, **extra}, plan)
        self._end(plan)

    def _event(self, chunk: dict, plan: Plan) -> None:
        self._write(f"data: {json.dumps({'object': 'text_completion', **chunk})}\n\n".encode(), plan)

    def _end(self, plan: Plan) -> None:
        self._write(b"data: [DONE]\n\n", plan)
        if plan.chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _write(self, data: bytes, plan: Plan) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if plan.chunked else data)

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _plan_from_prompt(plan: Plan, body: dict) -> Plan:
    """``"ttft=0.1 gap=0.02 status=500"`` in a text prompt overrides the server's plan for that request."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return plan
    changes = dict(kv.split("=") for kv in prompt.split() if "=" in kv)
    if "status" in changes:
        return replace(plan, mode="status", status=int(changes["status"]))
    return replace(plan, **{k: float(v) for k, v in changes.items() if k in ("ttft", "gap")})


@pytest.fixture
def serve(monkeypatch):
    """Start fake servers (``serve(Plan(...))`` -> the server); all shut down after the test."""
    for name in ("WORKBOOK_SERVER", "WORKBOOK_SERVER_API_KEY", "WORKBOOK_SERVER_MODEL"):
        monkeypatch.delenv(name, raising=False)
    servers = []

    def start(plan: Plan = Plan()) -> FakeServer:
        server = FakeServer(plan)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stopping.set()
        server.shutdown()
        server.server_close()


def free_port() -> int:
    """A port on 127.0.0.1 that nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_for(server: FakeServer, **kw) -> Client:
    return Client(server.url, model="fake-model", **{"first_token_timeout_s": 2.0, "chunk_timeout_s": 2.0, **kw})


def assert_fails(call, kind: str, url: str, within_s: float = 2.0, *words: str) -> ServerError:
    """``call()`` raises a ServerError of ``kind`` naming ``url`` (and ``words``), within ``within_s``."""
    start = time.perf_counter()
    with pytest.raises(ServerError) as info:
        call()
    elapsed = time.perf_counter() - start
    err = info.value
    assert isinstance(err, WorkbookError) and err.kind == kind, (err.kind, str(err))
    assert url in str(err), str(err)
    for word in words:
        assert word in str(err), str(err)
    assert elapsed < within_s, f"took {elapsed:.2f} s"
    return err


# ----------------------------------------------------------------------------- normal streams


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_is_timed_and_counted_from_usage(serve, chat):
    server = serve(Plan(ttft=0.15, gap=0.05))
    client = client_for(server)
    r = client.chat("Capital of France?", 5) if chat else client.complete("The capital of France is", 5)
    assert isinstance(r, StreamResult)
    assert r.text == "The capital of France is" and r.finish_reason == "length"
    assert (r.prompt_tokens, r.output_tokens, r.counted_by) == (17, 5, "usage")
    assert 0.15 <= r.ttft_s < 0.15 + 0.35  # the planted time to first token (the role-only chunk is not a token)
    assert len(r.gaps_s) == 4 and all(0.045 <= g < 0.05 + 0.3 for g in r.gaps_s)
    assert r.decode_s == pytest.approx(sum(r.gaps_s))
    assert r.decode_tok_s == pytest.approx(4 / r.decode_s) and 2 < r.decode_tok_s <= 4 / 0.18
    assert r.total_s >= r.ttft_s + r.decode_s
    path, body, _ = server.seen[-1]
    assert path == ("/v1/chat/completions" if chat else "/v1/completions")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-model" and body["max_tokens"] == 5
    line = meter_line(r)
    assert "\n" not in line and "TTFT" in line and "counted by usage" in line and "finish length" in line


def test_without_usage_tokens_are_counted_by_chunks_or_a_tokenizer(serve):
    server = serve(Plan(usage=False))
    client = client_for(server)
    r = client.complete("one two three", 4)
    assert (r.output_tokens, r.prompt_tokens, r.counted_by) == (4, None, "chunks")
    assert "prompt     ? tok" in meter_line(r)
    r = client.complete([5, 6, 7, 8, 9], 4)  # token ids: the prompt counts itself
    assert (r.output_tokens, r.prompt_tokens, r.counted_by) == (4, 5, "chunks")
    assert server.seen[-1][1]["prompt"] == [5, 6, 7, 8, 9]
    r = client.chat("one two three", 6, tokenizer=str.split)  # words as tokens: " capital" etc.
    assert (r.output_tokens, r.prompt_tokens, r.counted_by) == (6, 3, "tokenizer")


def test_chunked_transfer_encoding_streams_the_same(serve):
    server = serve(Plan(gap=0.02, chunked=True))
    r = client_for(server).complete("hi", 3)
    assert r.text == "The capital of" and r.output_tokens == 3 and r.counted_by == "usage"


def test_the_server_comes_from_the_environment_and_the_model_from_the_server(serve, monkeypatch):
    server = serve(Plan(api_key="sekret"))
    monkeypatch.setenv("WORKBOOK_SERVER", server.url.removesuffix("/v1"))  # a bare host gets /v1
    monkeypatch.setenv("WORKBOOK_SERVER_API_KEY", "sekret")
    client = Client()
    assert client.base_url == server.url
    r = client.complete("hi", 2)
    path, body, headers = server.seen[-1]
    assert body["model"] == "fake-model" and headers["Authorization"] == "Bearer sekret"
    assert r.output_tokens == 2


# ----------------------------------------------------------------------------- failures: one clear error each, in time


def test_a_connection_dropped_mid_stream(serve):
    for chunked in (False, True):
        server = serve(Plan(mode="drop", chunked=chunked))
        url = server.url + "/completions"
        assert_fails(lambda: client_for(server).complete("hi", 5), "dropped", url, 2.0, "mid-stream")


def test_a_chunk_that_is_not_json_is_quoted(serve):
    server = serve(Plan(mode="garbage"))
    err = assert_fails(lambda: client_for(server).complete("hi", 5), "not_json", server.url + "/completions")
    assert '{"choices": [{"text": " oops"' in str(err)


def test_a_server_that_never_answers_times_out_on_the_first_token(serve):
    server = serve(Plan(mode="silent"))
    client = client_for(server, first_token_timeout_s=0.5)
    start = time.perf_counter()
    assert_fails(lambda: client.complete("hi", 5), "first_token_timeout", server.url, 2.0, "first token")
    assert time.perf_counter() - start >= 0.45


def test_a_stall_between_chunks_times_out(serve):
    for chunked in (False, True):
        server = serve(Plan(mode="stall", chunked=chunked))
        client = client_for(server, chunk_timeout_s=0.3)
        assert_fails(lambda: client.complete("hi", 5), "chunk_timeout", server.url, 2.0, "next chunk")


def test_an_error_sent_inside_the_stream(serve):
    server = serve(Plan(mode="error"))
    assert_fails(lambda: client_for(server).complete("hi", 5), "server_error", server.url, 2.0, "out of KV blocks")


def test_http_500_names_the_status_and_quotes_the_body(serve):
    server = serve(Plan(mode="status", status=500))
    assert_fails(lambda: client_for(server).complete("hi", 5), "http", server.url + "/completions", 2.0,
                 "HTTP 500", "the engine fell over")


def test_http_401_says_the_api_key(serve):
    server = serve(Plan(api_key="sekret"))
    err = assert_fails(lambda: client_for(server).chat("hi", 5), "http", server.url + "/chat/completions", 2.0,
                       "HTTP 401", "WORKBOOK_SERVER_API_KEY", "none was sent", "Invalid API key")
    assert err.status == 401
    assert_fails(lambda: client_for(server, api_key="wrong").chat("hi", 5), "http", server.url, 2.0, "one was sent")
    assert client_for(server, api_key="sekret").chat("hi", 2).output_tokens == 2


def test_an_empty_stream(serve):
    for chat in (False, True):  # nothing before [DONE]; or only a role chunk, no text
        server = serve(Plan(mode="empty"))
        client = client_for(server)
        assert_fails(lambda: client.chat("hi", 5) if chat else client.complete("hi", 5), "empty", server.url)


def test_connection_refused(serve):
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert_fails(lambda: Client(url, model="m").complete("hi", 5), "refused", url, 2.0, "connection refused")
    assert_fails(lambda: Client(url).complete("hi", 5), "refused", url + "/models")  # asking for the model


def test_the_client_and_the_load_generator_import_no_torch():
    code = "import sys, utils.openai_client, utils.load_generator; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_bad_settings_are_clear_errors():
    with pytest.raises(WorkbookError, match="looks like http"):
        Client("127.0.0.1:8080")
    with pytest.raises(WorkbookError, match="chunk_timeout_s"):
        Client("http://127.0.0.1:1/v1", chunk_timeout_s=0)


# ----------------------------------------------------------------------------- the load generator


def trace(n: int, arrivals: list[float] | None = None, max_new_tokens: int = 3) -> list[Request]:
    return [Request(i, (arrivals or [0.0] * n)[i], (1, 2, 3), max_new_tokens) for i in range(n)]


def test_four_threads_take_about_a_quarter_of_one_threads_time(serve):
    client = client_for(serve(Plan(ttft=0.1, gap=0.05)))  # each request sleeps 0.2 s on the server
    one = run_concurrent(trace(8), 1, client).summary
    four = run_concurrent(trace(8), 4, client).summary
    assert one.ok == four.ok == 8 and one.output_tokens == four.output_tokens == 24
    assert one.wall_s >= 8 * 0.2
    assert four.wall_s / one.wall_s < 0.6
    assert four.throughput_tok_s > 1.6 * one.throughput_tok_s
    assert 0.1 <= four.ttft_p50_s <= four.ttft_p99_s and 0.045 <= four.tbt_p50_s <= four.tbt_p99_s


def test_goodput_counts_exactly_the_requests_under_both_targets(serve):
    client = client_for(serve(Plan()))
    prompts = ["ttft=0.02 gap=0.02",  # meets both
               "ttft=0.9 gap=0.02",  # first token too late
               "ttft=0.02 gap=0.3",  # tokens too slow
               "status=500",  # failed
               "ttft=0.0 gap=0.0"]  # meets both
    run = run_concurrent(trace(5), 5, client, ttft_target_s=0.45, tbt_target_s=0.15, prompts=prompts)
    s = run.summary
    assert [o.status for o in run.outcomes] == [OK, OK, OK, FAILED, OK]
    assert s.met_targets == 2 and s.goodput_share == pytest.approx(2 / 5)
    assert s.goodput_per_s == pytest.approx(2 / s.wall_s)
    assert (s.ok, s.failed, s.not_run) == (4, 1, 0) and s.failures == {"http": 1}
    assert "HTTP 500" in s.first_error and "goodput" in s.describe()


def test_a_deadline_stops_the_run_and_reports_what_did_not_run(serve):
    client = client_for(serve(Plan(ttft=0.2, gap=0.1)))  # 0.4 s per request
    start = time.perf_counter()
    run = run_concurrent(trace(6), 1, client, deadline_s=1.0)
    assert time.perf_counter() - start < 1.7
    statuses = [o.status for o in run.outcomes]
    assert statuses[:2] == [OK, OK] and statuses[3:] == [NOT_RUN] * 3
    assert statuses[2] == FAILED and run.outcomes[2].kind == "deadline"  # cut mid-stream at the deadline
    assert (run.summary.ok, run.summary.failed, run.summary.not_run) == (2, 1, 3)


def test_arrivals_are_kept_and_bounded_by_the_deadline(serve):
    client = client_for(serve(Plan()))
    start = time.perf_counter()
    run = run_arrivals(trace(4, [0.0, 0.2, 0.4, 30.0]), client, deadline_s=0.8)
    assert time.perf_counter() - start < 1.5  # did not wait for the request due at 30 s
    assert [o.status for o in run.outcomes] == [OK, OK, OK, NOT_RUN]
    for o in run.outcomes[:3]:
        assert o.request.arrival_s <= o.sent_s < o.request.arrival_s + 0.15 and o.late_s < 0.15


def test_a_poisson_trace_of_the_workbook_replays_with_its_lengths(serve):
    server = serve(Plan())
    reqs = synthetic_trace(6, 40.0, (3, 8), (2, 4), seed=1)  # 40 requests/s: all sent within ~0.3 s
    run = run_arrivals(reqs, client_for(server), deadline_s=5.0)
    assert run.summary.ok == 6 and run.summary.output_tokens == sum(r.max_new_tokens for r in reqs)
    sent = sorted((body["prompt"], body["max_tokens"]) for _, body, _ in server.seen)
    assert sent == sorted((list(r.prompt), r.max_new_tokens) for r in reqs)  # token ids, as given


def test_a_failing_request_is_counted_not_raised(serve):
    client = client_for(serve(Plan()))
    prompts = ["ok=1", "status=503", "ok=1"]
    run = run_concurrent(trace(3), 1, client, prompts=prompts)
    assert [o.status for o in run.outcomes] == [OK, FAILED, OK]
    assert run.outcomes[1].kind == "http" and "HTTP 503" in run.outcomes[1].error
    assert run.summary.failed == 1 and "HTTP 503" in run.summary.first_error
    down = Client(f"http://127.0.0.1:{free_port()}/v1", model="m")
    refused = run_concurrent(trace(2), 2, down)
    assert refused.summary.failures == {"refused": 2} and "connection refused" in refused.summary.first_error


def test_measure_speed_warms_up_repeats_and_reads_the_servers_own_timer(serve):
    server = serve(Plan(gap=0.02, timings=77.5))
    speed = measure_speed(client_for(server), [1, 2, 3], 6, repeats=3, ignore_eos=True)
    assert len(speed.results) == 3 and len(server.seen) == 4  # one untimed warm-up
    assert all(body["ignore_eos"] is True for _, body, _ in server.seen)
    assert speed.server_decode_tok_s == 77.5
    assert 20 < speed.decode_tok_s <= 1 / 0.02 * 1.05, speed.decode_samples  # 5 gaps of >= 20 ms
    assert 0 <= speed.relative_spread < 1 and speed.text == "The capital of France is Paris"
    plain = measure_speed(client_for(serve(Plan())), [1, 2, 3], 4, repeats=2)
    assert math.isnan(plain.server_decode_tok_s)  # a server that does not time itself


def test_sweep_concurrency_runs_every_level_in_rounds(serve):
    server = serve(Plan(gap=0.01))
    runs = sweep_concurrency(trace(4), [1, 2], client_for(server), repeats=2)
    assert list(runs) == [1, 2] and all(len(rs) == 2 for rs in runs.values())
    assert all(r.summary.ok == 4 for rs in runs.values() for r in rs)
    assert len(server.seen) == 2 * 2 * 4
    with pytest.raises(WorkbookError):
        sweep_concurrency(trace(2), [0], client_for(server))


def test_weight_read_gain_is_the_shared_weight_read_prediction():
    assert weight_read_gain(0.2, 0.01, 32, 1) == pytest.approx(1.0)
    # c requests: c prefills back to back, then (n - 1) shared steps, against c whole requests alone
    assert weight_read_gain(0.2, 0.01, 32, 4) == pytest.approx(4 * (0.2 + 31 * 0.01) / (4 * 0.2 + 31 * 0.01))
    assert weight_read_gain(1e-9, 0.01, 32, 4) == pytest.approx(4.0, rel=1e-6)  # decode only: c times
    # a step alone that is half weight read, half each row's own work: step(4) = 0.005 + 4 x 0.005
    assert weight_read_gain(1e-9, 0.01, 32, 4, read_s=0.005) == pytest.approx(4 * 0.01 / 0.025, rel=1e-6)
    assert weight_read_gain(0.2, 0.01, 32, 4, read_s=0.0) == pytest.approx(1.0)  # no shared read: no gain
    assert weight_read_gain(0.2, 0.01, 32, 4, read_s=1.0) == weight_read_gain(0.2, 0.01, 32, 4)  # capped at TBT
    with pytest.raises(WorkbookError):
        weight_read_gain(0.2, -0.01, 32, 4)


def test_one_slot_ttft_ratio_is_the_queue_a_single_slot_makes():
    from utils.load_generator import _one_slot_ttfts, one_slot_ttft_ratio
    # 4 clients, 4 requests, one slot: each waits for those ahead, T = 0.1 + 31 x 0.01 = 0.41 s each
    assert _one_slot_ttfts(0.1, 0.41, 4, 4) == pytest.approx([0.1, 0.51, 0.92, 1.33])
    assert one_slot_ttft_ratio(0.1, 0.01, 32, 4, 4) == pytest.approx((0.51 + 0.92) / 2 / 0.4)
    # 2 clients, 4 requests: the third is sent when the first ends and starts when the second ends
    assert _one_slot_ttfts(0.1, 0.41, 2, 4) == pytest.approx([0.1, 0.51, 0.51, 0.51])
    assert one_slot_ttft_ratio(0.1, 0.01, 32, 1, 3) == pytest.approx(1.0)  # one client: no queue, one prompt a pass
    assert one_slot_ttft_ratio(0.1, 0.01, 32, 8, 8) > one_slot_ttft_ratio(0.1, 0.01, 32, 4, 4)  # longer queue
    with pytest.raises(WorkbookError):
        one_slot_ttft_ratio(0.1, 0.01, 32, 4, 0)

"""Time any OpenAI-compatible server from the outside: TTFT, the gaps between tokens, decode tok/s.

Every serving engine -- vLLM, SGLang, TGI, llama.cpp's server, llama-cpp-python's -- speaks the
same HTTP dialect, OpenAI's: ``POST {base}/completions`` (a prompt) or ``POST
{base}/chat/completions`` (messages). With ``"stream": true`` the answer comes back as
Server-Sent Events, one ``data:`` line per chunk of text as the engine makes it::

    data: {"choices": [{"text": " Paris", "finish_reason": null}]}
    data: {"choices": [{"text": ".", "finish_reason": "stop"}]}
    data: {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2}}
    data: [DONE]

So a client sees the two phases of chapters 03-06 from the outside:

- **TTFT**, from sending the request to the first chunk with text: the prefill, plus what the
  server adds (its queue, tokenizing, other requests' steps) and the network. It bounds the
  prefill from above, so ``prompt tokens / TTFT`` bounds prefill tok/s from below.
- **the gaps between chunks** (time between tokens, TBT): one decode step each, plus any stall
  while the engine runs another request's prefill in the same iteration (chapter 07's
  head-of-line blocking, which chunked prefill bounds). An engine that puts several tokens in one
  chunk makes the gaps per chunk, not per token.
- **decode tok/s** = output tokens after the first / time after the first chunk (the workbook's
  convention, as in :mod:`utils.engine`).

Token counts come from the ``usage`` the server sends when asked (``"stream_options":
{"include_usage": true}``); a server that sends none (llama-cpp-python's) is counted with a
tokenizer you pass in, else as one token per chunk: :attr:`StreamResult.counted_by` says which.

Point it at a server with environment variables (or the same as arguments of :class:`Client`)::

    WORKBOOK_SERVER=http://127.0.0.1:8080/v1   # llama.cpp / llama-cpp-python (the default)
    WORKBOOK_SERVER=http://gpu-host:8000/v1    # vLLM: vllm serve <model>
    WORKBOOK_SERVER=http://gpu-host:30000/v1   # SGLang: python -m sglang.launch_server --model-path <model>
    WORKBOOK_SERVER_API_KEY=sk-...             # sent as "Authorization: Bearer sk-..." (vllm serve --api-key)
    WORKBOOK_SERVER_MODEL=<model>              # else the first model the server lists (GET {base}/models)

    client = Client()
    result = client.complete("The capital of France is", max_tokens=32)
    print(meter_line(result))

Every failure raises :class:`ServerError`, whose message names the URL and what happened: the server
is down, no first token in time, a stall between chunks, HTTP 4xx/5xx, a chunk that is not JSON, an
empty stream, a connection dropped mid-stream. Nothing waits forever: there are three time limits
(connect, first token, between chunks). Standard library only (``http.client``): no torch.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from .errors import WorkbookError, check_count, check_number

DEFAULT_SERVER = "http://127.0.0.1:8080/v1"
"""Where llama.cpp's server (and llama-cpp-python's) listens by default."""

Tokenizer = Callable[[str], Any]
"""Text -> token ids (or their count), e.g. ``tokenizer.encode``."""


class ServerError(WorkbookError):
    """A request to a server failed; the message names the URL and what happened.

    ``kind`` says which failure, for counting them: ``refused``, ``connect``, ``connect_timeout``,
    ``first_token_timeout``, ``chunk_timeout``, ``deadline``, ``http``, ``not_json``,
    ``server_error`` (an error sent inside the stream), ``empty``, ``dropped``.
    ``status`` is the HTTP status for ``http``.
    """

    def __init__(self, message: str, *, url: str, kind: str, status: int | None = None) -> None:
        super().__init__(message)
        self.url, self.kind, self.status = url, kind, status


# ----------------------------------------------------------------------------- one request's measurements


@dataclass(frozen=True)
class StreamResult:
    """One streamed request, timed on the client: seconds from sending it.

    ``chunk_s``: when each chunk with text arrived; ``ttft_s`` is the first of them.
    ``counted_by``: where the token counts come from: ``"usage"`` (the server's own count),
    ``"tokenizer"`` (the tokenizer passed in) or ``"chunks"`` (one token per chunk with text;
    the prompt is then counted only when it was sent as token ids, else ``None``).
    """

    url: str
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    output_tokens: int
    counted_by: str
    chunk_s: tuple[float, ...]
    total_s: float  # until [DONE] (or the end of the stream)
    server_timings: dict | None = None  # llama.cpp's server times itself and says so ("timings"); others: None

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0]

    @property
    def gaps_s(self) -> list[float]:
        """Time between consecutive chunks with text (time between tokens, per chunk)."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def decode_s(self) -> float:
        """From the first chunk with text to the last."""
        return self.chunk_s[-1] - self.chunk_s[0]

    @property
    def decode_tok_s(self) -> float:
        """Output tokens after the first over the time after the first (nan with one chunk)."""
        n = self.output_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else math.nan

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first: the mean time between tokens (0 for one token)."""
        n = self.output_tokens - 1
        return self.decode_s / n if n > 0 else 0.0

    @property
    def max_gap_s(self) -> float:
        """The longest stall between two chunks (0 for one chunk)."""
        return max(self.gaps_s, default=0.0)


def meter_line(r: StreamResult) -> str:
    """One line per request, in the spirit of chapter 06's meter (:mod:`utils.meter`).

    TTFT replaces "prompt eval time": seen from the client it holds the prefill plus the queue and
    the network, so the prefill speed it implies is a lower bound (``>=``).
    """
    pre_ms, dec_ms, n_dec = 1e3 * r.ttft_s, 1e3 * r.decode_s, max(r.output_tokens - 1, 0)
    if r.prompt_tokens:
        prompt = f"prompt {r.prompt_tokens:5d} tok, TTFT {pre_ms:9.2f} ms (>= {1e3 * r.prompt_tokens / pre_ms:8.1f} tok/s)"
    else:
        prompt = f"prompt     ? tok, TTFT {pre_ms:9.2f} ms"
    per_tok = dec_ms / n_dec if n_dec else math.nan
    return (f"{prompt} | eval {n_dec:5d} tok, {dec_ms:9.2f} ms ({per_tok:7.2f} ms per token, "
            f"{r.decode_tok_s:7.1f} tok/s) | total {1e3 * r.total_s:9.2f} ms | "
            f"finish {r.finish_reason or '?'} | counted by {r.counted_by}")


# ----------------------------------------------------------------------------- the client


@dataclass
class Client:
    """An OpenAI-compatible server: where it is, its key, its model, and three time limits (s).

    ``base_url``: e.g. ``http://127.0.0.1:8080/v1`` (``/v1`` is added to a bare host); default
    ``$WORKBOOK_SERVER``, else :data:`DEFAULT_SERVER`. ``api_key``: default ``$WORKBOOK_SERVER_API_KEY``.
    ``model``: default ``$WORKBOOK_SERVER_MODEL``, else the first one ``GET {base}/models`` lists.
    ``first_token_timeout_s`` bounds the wait from sending to the first chunk with text (a long prompt
    on a slow machine needs a long one); ``chunk_timeout_s`` bounds every wait after it.
    ``include_usage``: ask for the server's token counts (servers that do not know the option ignore it).
    """

    base_url: str | None = None
    api_key: str | None = None
    model: str | None = None
    connect_timeout_s: float = 5.0
    first_token_timeout_s: float = 60.0
    chunk_timeout_s: float = 30.0
    include_usage: bool = True

    def __post_init__(self) -> None:
        url = (self.base_url or os.environ.get("WORKBOOK_SERVER") or DEFAULT_SERVER).rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WorkbookError(f"A server URL looks like http://127.0.0.1:8080/v1, got {url!r}.")
        self.base_url = url if parts.path else url + "/v1"
        self.api_key = self.api_key if self.api_key is not None else os.environ.get("WORKBOOK_SERVER_API_KEY")
        self.model = self.model or os.environ.get("WORKBOOK_SERVER_MODEL") or None
        for name in ("connect_timeout_s", "first_token_timeout_s", "chunk_timeout_s"):
            check_number(getattr(self, name), name, "s")

    def complete(self, prompt: str | Sequence[int], max_tokens: int = 64, *, tokenizer: Tokenizer | None = None,
                 deadline: float | None = None, **params: Any) -> StreamResult:
        """Stream ``POST {base}/completions``: ``prompt`` is text or token ids; ``params`` go in the body
        (``temperature`` defaults to 0). ``deadline``: a ``time.perf_counter()`` time to give up at."""
        body = {"prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt]}
        return self._stream("/completions", body, max_tokens, prompt, tokenizer, deadline, params)

    def chat(self, messages: str | Sequence[dict], max_tokens: int = 64, *, tokenizer: Tokenizer | None = None,
             deadline: float | None = None, **params: Any) -> StreamResult:
        """Stream ``POST {base}/chat/completions``: ``messages`` is a list of ``{"role", "content"}``
        or one string (a single user message). A tokenizer counts the messages' text, not the chat template."""
        msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
        text = "\n".join(str(m.get("content", "")) for m in msgs)
        return self._stream("/chat/completions", {"messages": msgs}, max_tokens, text, tokenizer, deadline, params)

    def models(self, deadline: float | None = None) -> list[str]:
        """The model ids the server lists (``GET {base}/models``)."""
        url = self.base_url + "/models"
        resp, sock = _open(self, url, "GET", None, time.perf_counter() + self.first_token_timeout_s, deadline)
        try:
            data = json.loads(resp.read(1 << 20) or b"{}")
            return [str(m["id"]) for m in data.get("data", [])]
        except (ValueError, KeyError, TypeError, AttributeError, OSError, http.client.HTTPException) as e:
            raise ServerError(f"{url} did not answer with a list of models: {e}", url=url, kind="not_json") from None
        finally:
            _close(resp, sock)

    def model_name(self, deadline: float | None = None) -> str:
        """``model``, else the first model the server lists (asked once), else ``"default"``."""
        if not self.model:
            try:
                self.model = (self.models(deadline) or ["default"])[0]
            except ServerError as e:
                if e.status not in (404, 405):
                    raise
                self.model = "default"
        return self.model

    def _stream(self, path: str, body: dict, max_tokens: int, prompt: str | Sequence[int],
                tokenizer: Tokenizer | None, deadline: float | None, params: dict) -> StreamResult:
        body = {"model": self.model_name(deadline), **body, "max_tokens": check_count(max_tokens, "max_tokens"),
                "temperature": 0.0, **params, "stream": True}
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        url = self.base_url + path
        start = time.perf_counter()
        resp, sock = _open(self, url, "POST", body, start + self.first_token_timeout_s, deadline)
        try:
            tally = _read_stream(_EventReader(resp, sock, url, self, start, deadline), path.startswith("/chat"))
        finally:
            _close(resp, sock)
        return _result(url, tally, start, prompt, tokenizer)


# ----------------------------------------------------------------------------- connecting


def _open(client: Client, url: str, method: str, body: dict | None, first_by: float,
          deadline: float | None) -> tuple[http.client.HTTPResponse, socket.socket]:
    """Connect, send, and wait for the status line (until ``first_by``): the open response and its socket
    (whose time limit the reader sets; http.client lets go of it when the server will close it)."""
    conn, sock = _connect(client, url, deadline)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if client.api_key:
        headers["Authorization"] = f"Bearer {client.api_key}"
    parts, resp = urlsplit(url), None
    try:
        try:
            conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""),
                         None if body is None else json.dumps(body).encode(), headers)
            sock.settimeout(max(_limit(first_by - time.perf_counter(), deadline), 1e-3))
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            raise _wait_error(e, url, client, got_token=False, deadline=deadline) from None
        _check_status(resp, url, client)
        return resp, sock
    except BaseException:
        _close(resp, sock)
        raise


def _connect(client: Client, url: str, deadline: float | None) -> tuple[http.client.HTTPConnection, socket.socket]:
    """A connection to the server within ``connect_timeout_s``, or ServerError (refused, timed out, ...)."""
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=max(_limit(client.connect_timeout_s, deadline), 1e-3))
    try:
        conn.connect()
    except OSError as e:
        conn.close()
        raise _connect_error(e, url, client.connect_timeout_s) from None
    return conn, conn.sock


def _close(resp: http.client.HTTPResponse | None, sock: socket.socket) -> None:
    """Hang up: the response (it holds a reference to the socket), then the socket itself."""
    if resp is not None:
        resp.close()
    sock.close()


def _limit(seconds: float, deadline: float | None) -> float:
    """``seconds``, or less if the run's ``deadline`` (a perf_counter time) comes first."""
    return seconds if deadline is None else min(seconds, deadline - time.perf_counter())


def _connect_error(e: OSError, url: str, timeout_s: float) -> ServerError:
    if isinstance(e, ConnectionRefusedError):
        return ServerError(f"Could not connect to {url}: connection refused. Is the server running? Start it, "
                           f"or point WORKBOOK_SERVER at one (e.g. {DEFAULT_SERVER}).", url=url, kind="refused")
    if isinstance(e, TimeoutError):
        return ServerError(f"Timed out after {timeout_s:g} s connecting to {url}: is the host reachable?",
                           url=url, kind="connect_timeout")
    return ServerError(f"Could not connect to {url}: {e}", url=url, kind="connect")


def _wait_error(e: BaseException, url: str, client: Client, got_token: bool, deadline: float | None,
                chunks: int = 0) -> ServerError:
    """A read that failed: a time limit ran out, or the connection broke."""
    if isinstance(e, TimeoutError):
        if deadline is not None and time.perf_counter() >= deadline - 1e-3:
            return ServerError(f"Stopped waiting for {url}: the run's deadline passed mid-request.",
                               url=url, kind="deadline")
        if not got_token:
            return ServerError(f"Timed out after {client.first_token_timeout_s:g} s waiting for the first token "
                               f"from {url} (first_token_timeout_s).", url=url, kind="first_token_timeout")
        return ServerError(f"Timed out after {client.chunk_timeout_s:g} s waiting for the next chunk from {url} "
                           f"after {chunks} chunks (chunk_timeout_s).", url=url, kind="chunk_timeout")
    where = "before any chunk" if chunks == 0 else f"mid-stream after {chunks} chunk(s), before 'data: [DONE]'"
    return ServerError(f"The connection to {url} dropped {where} ({type(e).__name__}: {e}).", url=url, kind="dropped")


def _check_status(resp: http.client.HTTPResponse, url: str, client: Client) -> None:
    """Raise on HTTP 4xx/5xx, quoting the start of the body."""
    if resp.status < 400:
        return
    try:
        body = resp.read(600).decode("utf-8", "replace").strip()
    except (OSError, http.client.HTTPException):
        body = ""
    hint = ""
    if resp.status in (401, 403):
        hint = (" The server wants an API key: check WORKBOOK_SERVER_API_KEY (one was sent)." if client.api_key else
                " The server wants an API key: set WORKBOOK_SERVER_API_KEY (none was sent).")
    elif resp.status == 404:
        hint = " Is the base URL right (it usually ends in /v1), and the model name?"
    raise ServerError(f"{url} answered HTTP {resp.status} {resp.reason}.{hint} Body: {_quote(body, 300)}",
                      url=url, kind="http", status=resp.status)


def _quote(text: str, n: int) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


# ----------------------------------------------------------------------------- reading the stream


class _EventReader:
    """The ``data:`` payloads of a Server-Sent Events response, each read within its time limit."""

    def __init__(self, resp: http.client.HTTPResponse, sock: socket.socket, url: str,
                 client: Client, start: float, deadline: float | None) -> None:
        self.resp, self.sock, self.url, self.client = resp, sock, url, client
        self.first_by, self.deadline = start + client.first_token_timeout_s, deadline

    def next(self, got_token: bool, chunks: int) -> str | None:
        """The next payload (``"[DONE]"`` included), or None when the stream ends."""
        while True:
            wait = self.client.chunk_timeout_s if got_token else self.first_by - time.perf_counter()
            try:
                wait = _limit(wait, self.deadline)
                if wait <= 0:
                    raise TimeoutError
                self.sock.settimeout(wait)
                line = self.resp.readline(1 << 20)
            except (OSError, http.client.HTTPException) as e:
                raise _wait_error(e, self.url, self.client, got_token, self.deadline, chunks) from None
            if not line:
                return None
            text = line.decode("utf-8", "replace").strip()
            if text.startswith("data:"):
                return text[5:].strip()
            if text and not text.startswith((":", "event:", "id:", "retry:")):
                raise ServerError(f"{self.url} sent a line that is not a Server-Sent Event (did it ignore "
                                  f"\"stream\": true?): {_quote(text, 200)}", url=self.url, kind="not_json")
            # blank lines end an event; ": ..." comments (keep-alives), "event:", "id:" carry no data


@dataclass
class _Tally:
    """What the stream said so far."""

    pieces: list[str] = field(default_factory=list)
    chunk_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    timings: dict | None = None
    payloads: int = 0
    end_s: float = math.nan


def _read_stream(reader: _EventReader, chat: bool) -> _Tally:
    """Read payloads until ``[DONE]``, timing each chunk that carries text."""
    tally, url = _Tally(), reader.url
    while True:
        payload = reader.next(got_token=bool(tally.chunk_s), chunks=tally.payloads)
        now = time.perf_counter()
        if payload is None and not tally.finish_reason:  # a stream may end without [DONE] once finished
            if tally.payloads == 0:
                raise ServerError(f"{url} ended the stream without sending any chunk.", url=url, kind="empty")
            raise ServerError(f"The connection to {url} dropped mid-stream after {tally.payloads} chunk(s), before "
                              "'data: [DONE]'.", url=url, kind="dropped")
        if payload is None or payload == "[DONE]":
            break
        _add_chunk(tally, _parse(payload, url), chat, now, url)
    tally.end_s = now
    if not tally.chunk_s:
        what = "no chunk" if tally.payloads == 0 else f"{tally.payloads} chunk(s) but no text"
        why = f" (finish reason {tally.finish_reason!r})" if tally.finish_reason else ""
        raise ServerError(f"{url} ended the stream with {what}{why}: no token to time.", url=url, kind="empty")
    return tally


def _parse(payload: str, url: str) -> dict:
    try:
        chunk = json.loads(payload)
    except ValueError:
        chunk = None
    if not isinstance(chunk, dict):
        raise ServerError(f"{url} sent a chunk that is not a JSON object: {_quote('data: ' + payload, 200)}",
                          url=url, kind="not_json")
    if chunk.get("error"):  # vLLM and others report a failure inside the stream
        err = chunk["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise ServerError(f"{url} reported an error mid-stream: {_quote(str(msg), 300)}", url=url, kind="server_error")
    return chunk


def _add_chunk(tally: _Tally, chunk: dict, chat: bool, now: float, url: str) -> None:
    """Count one chunk: its text (timed when not empty), its finish reason, its usage."""
    tally.payloads += 1
    if isinstance(chunk.get("usage"), dict):
        tally.usage = chunk["usage"]
    if isinstance(chunk.get("timings"), dict):
        tally.timings = chunk["timings"]
    choices = chunk.get("choices") or [{}]
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise ServerError(f"{url} sent a chunk without a list of choices: {_quote(json.dumps(chunk), 200)}",
                          url=url, kind="not_json")
    choice = choices[0]
    if chat:  # chat sends deltas; reasoning models may stream their thinking apart from the answer
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        piece = delta.get("content") or delta.get("reasoning_content") or ""
    else:
        piece = choice.get("text") or ""
    if piece:
        tally.pieces.append(str(piece))
        tally.chunk_s.append(now)
    tally.finish_reason = choice.get("finish_reason") or tally.finish_reason


def _result(url: str, tally: _Tally, start: float, prompt: str | Sequence[int],
            tokenizer: Tokenizer | None) -> StreamResult:
    """The :class:`StreamResult` of a finished stream, with its token counts and where they came from."""
    text = "".join(tally.pieces)
    usage = tally.usage or {}
    if isinstance(usage.get("completion_tokens"), int):
        n_prompt, n_out, source = usage.get("prompt_tokens"), usage["completion_tokens"], "usage"
    elif tokenizer is not None:
        n_prompt, n_out, source = _count(tokenizer, prompt), _count(tokenizer, text), "tokenizer"
    else:
        n_prompt = None if isinstance(prompt, str) else len(prompt)
        n_out, source = len(tally.chunk_s), "chunks"
    return StreamResult(url, text, tally.finish_reason, n_prompt, n_out, source,
                        tuple(t - start for t in tally.chunk_s), tally.end_s - start, tally.timings)


def _count(tokenizer: Tokenizer, text: str | Sequence[int]) -> int:
    """Tokens in ``text`` (token ids count as themselves); the tokenizer may return ids or a count."""
    if not isinstance(text, str):
        return len(text)
    out = tokenizer(text)
    return int(out) if isinstance(out, int) else len(out)


# ----------------------------------------------------------------------------- one request, repeated


@dataclass(frozen=True)
class StreamSpeed:
    """One request sent ``repeats`` times, one after another, after an untimed warm-up: medians and spread."""

    results: tuple[StreamResult, ...]

    @property
    def decode_samples(self) -> list[float]:
        """Decode tok/s of each repeat, seen by the client."""
        return [r.decode_tok_s for r in self.results]

    @property
    def decode_tok_s(self) -> float:
        return statistics.median(self.decode_samples)

    @property
    def ttft_s(self) -> float:
        return statistics.median(r.ttft_s for r in self.results)

    @property
    def relative_spread(self) -> float:
        """Interquartile range over median of the repeats' decode tok/s (0 with fewer than 2)."""
        xs = self.decode_samples
        if len(xs) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        return (q3 - q1) / statistics.median(xs)

    @property
    def server_decode_tok_s(self) -> float:
        """What the server timed itself (llama.cpp's ``timings.predicted_per_second``), median; nan if not sent."""
        own = [float(r.server_timings["predicted_per_second"]) for r in self.results
               if r.server_timings and isinstance(r.server_timings.get("predicted_per_second"), (int, float))]
        return statistics.median(own) if len(own) == len(self.results) else math.nan

    @property
    def text(self) -> str:
        return self.results[-1].text


def measure_speed(client: Client, prompt: str | Sequence[int], max_tokens: int, *, repeats: int = 3,
                  **params: Any) -> StreamSpeed:
    """Send the same request ``1 + repeats`` times in a row (the first untimed: the server's warm-up) and
    keep the timed ones; ``params`` go to :meth:`Client.complete` (e.g. ``ignore_eos=True``)."""
    check_count(repeats, "repeats")
    client.complete(prompt, max_tokens, **params)
    return StreamSpeed(tuple(client.complete(prompt, max_tokens, **params) for _ in range(repeats)))

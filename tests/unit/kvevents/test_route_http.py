"""``route --serve``'s HTTP server over real loopback sockets (uvicorn in a thread, a fixed index;
no Kafka): the endpoints, every malformed-request class with its JSON status, slow and idle
clients, the connection bound, and /metrics in Prometheus format."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import uvicorn
from cli_events import batch, created
from kvevents.consumer import CacheIndex, Liveness, WorkerKey
from kvevents.schemas import WIDE_TOKEN_ID, KVCacheEvent, KVCacheStoredBlockData, KVCacheStoredData
from prometheus_client.parser import text_string_to_metric_families

from kvevents.commands._route_app import StaticSource
from kvevents.commands._route_http import ServeOptions, bind, make_server

BS = 4
PROMPT = list(range(100, 116))  # four blocks of 4 tokens


def store_prefix(index: CacheIndex, instance: str, tokens: list[int], blocks: int, level: int = 0) -> None:
    stored = [
        KVCacheStoredBlockData(
            hash((instance, i)) & 0xFFFFFFFF, tokens[i * BS : (i + 1) * BS], cache_level=level
        )
        for i in range(blocks)
    ]
    events = [created(0, 0), KVCacheEvent(1, KVCacheStoredData(None, stored), 64, 0)]
    index.apply(batch(events, 0, instance=instance, dp=1))


class LivenessSource(StaticSource):
    """A fixed index whose instance ``stale`` went quiet long ago."""

    def __init__(self, index: CacheIndex) -> None:
        super().__init__(index)
        clock = [1000.0]
        self.liveness = Liveness(10.0, clock=lambda: clock[0])  # type: ignore[assignment]
        for name in ("a", "b", "c", "d"):
            self.liveness.observe(name, 1000.0)
        self.liveness.observe("stale", 900.0)
        self._clock = clock

    def not_routable(self, now: float | None = None) -> dict[WorkerKey, str]:
        states = self.liveness.not_routable({k.instance_id for k in self.index.workers()}, self._clock[0])
        return {k: states[k.instance_id] for k in self.index.workers() if k.instance_id in states}


@dataclass
class Running:
    host: str
    port: int
    source: LivenessSource
    index: CacheIndex

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextlib.contextmanager
def run_in_thread(server: uvicorn.Server, sock: socket.socket) -> Iterator[int]:
    """Run ``server`` on ``sock`` in a daemon thread until the block ends; its port."""
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def serving(options: ServeOptions) -> Iterator[Running]:
    index = CacheIndex()
    store_prefix(index, "a", PROMPT, 2)
    store_prefix(index, "b", PROMPT, 4)
    store_prefix(index, "c", PROMPT, 3, level=1)  # offloaded
    store_prefix(index, "stale", PROMPT, 4)
    source = LivenessSource(index)
    sock = bind("127.0.0.1", 0)
    server = make_server(sock, source, options)
    with run_in_thread(server, sock) as port:
        yield Running("127.0.0.1", port, source, index)


@pytest.fixture
def srv() -> Iterator[Running]:
    yield from serving(
        ServeOptions(block_size=BS, max_body_bytes=64 * 1024, header_timeout_s=1.0, body_timeout_s=1.0)
    )


def raw(srv: Running, data: bytes, *, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Send bytes, read one response (status, lower-cased headers, body)."""
    with socket.create_connection((srv.host, srv.port), timeout=timeout) as s:
        s.sendall(data)
        return read_response(s, head_only=data.startswith(b"HEAD "))


def read_response(s: socket.socket, *, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One response; ``head_only``: an answer to HEAD (Content-Length, but no body follows)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {buf!r}")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = 0 if head_only else int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body[:length]


class ResponseReader:
    """Responses read one after another from one connection, keeping the bytes past each:
    pipelined answers may arrive in one segment (:func:`read_response` would drop the rest)."""

    def __init__(self, s: socket.socket) -> None:
        self.s = s
        self.buf = b""

    def _more(self) -> None:
        chunk = self.s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {self.buf!r}")
        self.buf += chunk

    def read(self, *, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = 0 if head_only else int(headers.get("content-length", "0"))
        self.buf = rest
        while len(self.buf) < length:
            self._more()
        body, self.buf = self.buf[:length], self.buf[length:]
        return int(lines[0].split()[1]), headers, body


def request(srv: Running, method: str, path: str, body: bytes | None = None, extra: str = "") -> tuple[int, dict[str, str], dict]:  # type: ignore[type-arg]  # fmt: skip
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}"
    if body is not None:
        head += f"Content-Length: {len(body)}\r\nContent-Type: application/json\r\n"
    status, headers, data = raw(srv, head.encode() + b"\r\n" + (body or b""))
    return (
        status,
        headers,
        json.loads(data) if data and headers.get("content-type", "").startswith("application/json") else {},
    )


def post(srv: Running, path: str, payload: object) -> tuple[int, dict]:  # type: ignore[type-arg]
    status, _, body = request(srv, "POST", path, json.dumps(payload).encode())
    return status, body


def test_match_single_batch_and_hashes_leave_stale_workers_out(srv: Running) -> None:
    status, body = post(srv, "/match", {"token_ids": PROMPT, "block_size": BS})
    assert status == 200 and body["blocks"] == 4
    assert body["best"] == {"instance_id": "b", "attention_dp_rank": 0, "matched_blocks": 4,
                            "primary_blocks": 4, "score": 4.0, "degraded": False}  # fmt: skip
    assert [s["instance_id"] for s in body["scores"]] == ["b", "c", "a"]
    assert body["left_out"] == [
        {"instance_id": "stale", "attention_dp_rank": 0, "state": "stale", "matched_blocks": 4}
    ]
    status, body = post(
        srv, "/match", {"prompts": [{"token_ids": PROMPT}, {"token_ids": [5] * 8}], "secondary_weight": 0.5}
    )
    assert status == 200 and len(body["results"]) == 2
    assert [(s["instance_id"], s["score"]) for s in body["results"][0]["scores"]] == [
        ("b", 4.0),
        ("a", 2.0),
        ("c", 1.5),
    ]
    assert body["results"][1] == {"blocks": 2, "scores": [], "best": None, "left_out": []}
    hashes = [hash(("b", i)) & 0xFFFFFFFF for i in range(3)]
    status, body = post(srv, "/match/hashes", {"block_hashes": hashes})
    assert status == 200 and body["best"]["instance_id"] == "b" and body["best"]["matched_blocks"] == 3
    status, body = post(
        srv, "/match/hashes", {"prompts": [{"block_hashes": hashes[:1]}, {"block_hashes": [1]}]}
    )
    assert status == 200 and [r["blocks"] for r in body["results"]] == [1, 1]


def test_workers_healthz_readyz_and_head(srv: Running) -> None:
    status, _, body = request(srv, "GET", "/workers")
    assert status == 200
    states = {w["instance_id"]: w["state"] for w in body["workers"]}
    assert states == {"a": "live", "b": "live", "c": "live", "stale": "stale"}
    assert body["summary"]["stale_workers"] == 1 and body["summary"]["live_workers"] == 3
    assert request(srv, "GET", "/healthz")[2]["status"] == "ok"
    assert request(srv, "GET", "/readyz")[:1] == (200,)
    status, headers, _ = request(srv, "HEAD", "/healthz")
    assert status == 200 and int(headers["content-length"]) > 0


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"{not json", "bad /match body"),
        (b"[1, 2]", "Expected `object`"),
        (b"{}", "not both"),
        (b'{"token_ids": [1], "prompts": []}', "not both"),
        (b'{"token_ids": "12"}', "got `str` - at `$.token_ids`"),
        (b'{"token_ids": [1, "2"]}', "$.token_ids[1]"),
        (b'{"token_ids": [-1]}', ">= 0"),
        (b'{"token_ids": [18446744073709551616]}', "token_ids holds 18446744073709551616, more than 64 bits"),
        # a lora_id past 64 bits was wrapped by the fast path (an answer for another adapter)
        # and a 500 on the general one; a prompt shorter than a block took the fast path too
        (b'{"token_ids": [1, 2], "lora_id": 18446744073709551616}', "lora_id 18446744073709551616 is more"),
        (b'{"prompts": [{"token_ids": [1], "lora_id": 2' + b"0" * 20 + b"}]}", "prompts[0].lora_id 2000"),
        (b'{"prompts": [{"token_ids": [1]}], "lora_id": 2' + b"0" * 20 + b"}", "prompts[0].lora_id 2000"),
        (b'{"token_ids": [1], "block_size": 0}', "$.block_size"),
        (b'{"token_ids": [1], "secondary_weight": 2}', "$.secondary_weight"),
        (b'{"token_ids": [1], "tokens": [1]}', "unknown field `tokens`"),
        (b'{"prompts": [' + b",".join([b'{"token_ids": [1]}'] * 257) + b"]}", "length <= 256"),
        (b'{"token_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}", "$.token_ids[0]"),  # was a 500
        (b"[" * 5000 + b"]" * 5000, "Expected `object`"),
    ],
)
def test_bad_bodies_get_400_naming_the_field(srv: Running, payload: bytes, message: str) -> None:
    status, headers, body = request(srv, "POST", "/match", payload)
    assert status == 400 and headers["content-type"] == "application/json"
    assert message in body["error"] and body["status"] == 400


def test_a_prompt_with_multimodal_pad_tokens_matches_what_the_bridge_stored(srv: Running) -> None:
    """SGLang's pad values pass 2**31 (they were a 400); the bridge stores such a token as
    WIDE_TOKEN_ID with its value as the extra id, and /match hashes the prompt the same way."""
    pad = 10**6 + 2**62 - 5
    stored = KVCacheStoredBlockData(
        0xABC, [7, 8, WIDE_TOKEN_ID, WIDE_TOKEN_ID], token_extra_ids=[0, 0, pad, pad]
    )
    srv.index.apply(
        batch(
            [created(0, 0), KVCacheEvent(1, KVCacheStoredData(None, [stored]), 64, 0)], 0, instance="mm", dp=1
        )
    )
    status, body = post(srv, "/match", {"token_ids": [7, 8, pad, pad], "block_size": BS})
    assert status == 200 and body["best"]["instance_id"] == "mm" and body["best"]["matched_blocks"] == 1
    status, body = post(srv, "/match", {"token_ids": [7, 8, pad, pad + 1], "block_size": BS})
    assert status == 200 and body["best"] is None


def test_bad_hashes_body(srv: Running) -> None:
    status, _, body = request(srv, "POST", "/match/hashes", b'{"block_hashes": [18446744073709551616]}')
    assert status == 400 and "block_hashes" in body["error"]


@pytest.mark.parametrize("window", [2**31, 2**40, 2**63])
def test_a_window_size_no_cache_can_have_is_an_empty_answer_not_a_500(srv: Running, window: int) -> None:
    """Found by fuzzing (make soak): /match/hashes answered 500 (OverflowError in the core)."""
    hashes = [hash(("b", i)) & 0xFFFFFFFF for i in range(3)]
    status, body = post(srv, "/match/hashes", {"block_hashes": hashes, "window_size": window})
    assert status == 200 and body["scores"] == [] and body["best"] is None
    status, body = post(srv, "/match", {"token_ids": PROMPT, "block_size": BS, "window_size": window})
    assert status == 200 and body["scores"] == []


def test_wrong_path_and_method_get_json_404_and_405_with_allow(srv: Running) -> None:
    status, _, body = request(srv, "POST", "/nowhere", b"{}")
    assert status == 404 and "POST /match" in body["error"]
    status, headers, body = request(srv, "GET", "/match")
    assert status == 405 and headers["allow"] == "POST" and "GET is not allowed" in body["error"]
    status, headers, body = request(srv, "POST", "/workers", b"{}")
    assert status == 405 and headers["allow"] == "GET, HEAD"


def test_length_classes_400_411_413_close_the_connection(srv: Running) -> None:
    for bad in ("-1", "abc", "1e3"):
        status, headers, body = raw(
            srv, f"POST /match HTTP/1.1\r\nHost: x\r\nContent-Length: {bad}\r\n\r\n{{}}".encode()
        )
        assert status == 400 and headers["connection"] == "close" and json.loads(body)["status"] == 400, bad
    status, headers, body = raw(srv, b"POST /match HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (
        status == 411 and headers["connection"] == "close" and "Content-Length" in json.loads(body)["error"]
    )
    # 100 MB announced: answered at once, nothing of the body sent
    status, headers, body = raw(srv, b"POST /match HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
    assert (
        status == 413
        and headers["connection"] == "close"
        and "limit of 65536 bytes" in json.loads(body)["error"]
    )


def test_chunked_body_over_the_limit_gets_413_while_reading(srv: Running) -> None:
    with socket.create_connection((srv.host, srv.port), timeout=5) as s:
        s.sendall(b"POST /match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 16384
        try:
            for _ in range(64):  # 1 MiB offered, 64 KiB allowed
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, headers, body = read_response(s)
    assert status == 413 and headers["connection"] == "close"
    # a chunked body within the limit is read and answered
    data = json.dumps({"token_ids": PROMPT}).encode()
    status, _, body = raw(
        srv,
        b"POST /match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (len(data), data),
    )
    assert status == 200 and json.loads(body)["best"]["instance_id"] == "b"


def test_slow_loris_head_and_slow_body_get_408_and_the_service_keeps_answering(srv: Running) -> None:
    started = time.monotonic()
    with socket.create_connection((srv.host, srv.port), timeout=5) as slow:
        slow.sendall(b"POST /match HTTP/1.1\r\n")
        for _ in range(3):  # a header line now and then, never the end of the head
            time.sleep(0.2)
            assert post(srv, "/match", {"token_ids": PROMPT})[0] == 200  # others are served meanwhile
            slow.sendall(b"X-Slow: 1\r\n")
        status, headers, _ = read_response(slow)
        assert status == 408 and headers["connection"] == "close"
        assert slow.recv(10) == b""  # closed
    assert time.monotonic() - started < 3.0
    with socket.create_connection((srv.host, srv.port), timeout=5) as slow_body:
        slow_body.sendall(b'POST /match HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"token_ids"')
        status, headers, body = read_response(slow_body)
        assert status == 408 and "body did not arrive" in json.loads(body)["error"]


def test_requests_in_pieces_within_the_deadlines_are_served_on_one_connection(srv: Running) -> None:
    """A head and a body each sent in pieces (0.6 s each, deadlines 1 s) are answered, and the
    connection, idle between requests for longer than the head deadline, still serves."""
    data = json.dumps({"token_ids": PROMPT}).encode()
    head = b"POST /match HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data)
    with socket.create_connection((srv.host, srv.port), timeout=5) as s:
        for pieces in ([head[:10], head[10:30], head[30:] + data], [head, data[:5], data[5:20], data[20:]]):
            for i, piece in enumerate(pieces):
                if i:
                    time.sleep(0.6 / (len(pieces) - 1))
                s.sendall(piece)
            status, _, body = read_response(s)
            assert status == 200 and json.loads(body)["best"]["instance_id"] == "b"
            time.sleep(1.3)  # idle past the head deadline: the keep-alive timeout (5 s) rules
        s.sendall(head)  # and a body that stops half-way gets its own deadline
        s.sendall(data[:5])
        status, _, body = read_response(s)
        assert status == 408 and "body did not arrive within 1 s" in json.loads(body)["error"]


@pytest.mark.slow
def test_a_thousand_idle_connections_cost_no_thread_and_are_closed(srv: Running) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2500:  # both ends of 1,000 connections live in this process
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    threads_before = threading.active_count()
    idle = [socket.create_connection((srv.host, srv.port), timeout=5) for _ in range(1000)]
    try:
        t0 = time.monotonic()
        assert request(srv, "GET", "/healthz")[0] == 200
        assert post(srv, "/match", {"token_ids": PROMPT})[0] == 200
        assert time.monotonic() - t0 < 2.0
        assert threading.active_count() == threads_before  # uvicorn: one event loop, no thread each
        time.sleep(1.5)  # the head deadline (1 s) closes every silent connection
        closed = 0
        for s in idle:
            s.settimeout(2)
            try:
                data = s.recv(4096)
                closed += data == b"" or data.startswith(b"HTTP/1.1 408")
            except (ConnectionResetError, TimeoutError):
                pass
        assert closed == 1000
    finally:
        for s in idle:
            s.close()


def test_connections_past_the_bound_get_503() -> None:
    for running in serving(ServeOptions(block_size=BS, max_connections=5, header_timeout_s=5.0)):
        held = [socket.create_connection((running.host, running.port), timeout=5) for _ in range(5)]
        try:
            time.sleep(0.2)
            status, _headers, body = raw(running, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # type: ignore[arg-type]
            assert status == 503 and "more than 5 open connections" in json.loads(body)["error"]
        finally:
            for s in held:
                s.close()
        time.sleep(0.2)
        assert raw(running, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200  # type: ignore[arg-type]


def test_keep_alive_connection_serves_many_requests(srv: Running) -> None:
    data = json.dumps({"token_ids": PROMPT}).encode()
    req = b"POST /match HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
    with socket.create_connection((srv.host, srv.port), timeout=5) as s:
        for _ in range(20):
            s.sendall(req)
            status, _, body = read_response(s)
            assert status == 200 and json.loads(body)["best"]["instance_id"] == "b"


def test_pipelined_head_and_post_are_answered_in_order(srv: Running) -> None:
    """Each response's head waits for its body to go out in one write; a HEAD answer (no body)
    is still sent when it completes, before the next pipelined answer."""
    data = json.dumps({"token_ids": PROMPT}).encode()
    post_req = b"POST /match HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
    with socket.create_connection((srv.host, srv.port), timeout=5) as s:
        s.sendall(
            b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            + post_req
            + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        answers = ResponseReader(s)  # the answers may come in one segment
        status, headers, _ = answers.read(head_only=True)
        assert status == 200 and int(headers["content-length"]) > 0
        status, _, body = answers.read()
        assert status == 200 and json.loads(body)["best"]["instance_id"] == "b"
        status, _, body = answers.read()
        assert status == 200 and json.loads(body)["status"] == "ok"


def test_joined_writes_send_head_and_body_once_and_pass_the_rest() -> None:
    """The transport wrapper alone (a recording transport stands in)."""
    from kvevents.commands._route_http import _JoinedWrites

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.closed = False

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def close(self) -> None:
            self.closed = True

        def is_closing(self) -> bool:
            return self.closed

    t = Recorder()
    joined = _JoinedWrites(t)  # type: ignore[arg-type]
    joined.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # not held
    joined.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    joined.write(b"{}")
    joined.flush()
    joined.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")  # a HEAD answer: no body write
    joined.flush()
    joined.write(b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
    assert not joined.is_closing()
    joined.close()  # a held head goes out before the close
    assert t.writes == [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n",
        b"HTTP/1.1 500 Internal Server Error\r\n\r\n",
    ]
    assert t.closed


def test_metrics_are_prometheus_text_with_requests_and_index_figures(srv: Running) -> None:
    post(srv, "/match", {"token_ids": PROMPT})
    request(srv, "GET", "/nowhere")
    with socket.create_connection((srv.host, srv.port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = read_response(s)
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    assert (
        samples[
            ("kvevents_router_requests_total", (("process", "0"), ("route", "/match"), ("status", "200")))
        ]
        == 1
    )
    assert (
        samples[("kvevents_router_requests_total", (("process", "0"), ("route", "other"), ("status", "404")))]
        == 1
    )
    assert (
        samples[
            (
                "kvevents_router_request_duration_seconds_count",
                (("form", "single"), ("process", "0"), ("route", "/match")),
            )
        ]
        == 1
    )
    assert samples[("kvevents_index_workers", (("process", "0"),))] == 4
    assert samples[("kvevents_index_liveness_workers", (("process", "0"), ("state", "stale")))] == 1
    assert samples[("kvevents_index_held_blocks", (("process", "0"),))] == 13


@pytest.mark.parametrize("direct", [True, False])
def test_match_latency_histogram_tells_single_batch_and_error_answers_apart(direct: bool) -> None:
    index = CacheIndex()
    sock = bind("127.0.0.1", 0)
    server = make_server(sock, StaticSource(index), ServeOptions(block_size=BS, direct=direct))
    with run_in_thread(server, sock) as port:
        running = Running("127.0.0.1", port, LivenessSource(index), index)
        for body in (
            {"token_ids": PROMPT},
            {"token_ids": PROMPT},
            {"prompts": [{"token_ids": PROMPT}, {"token_ids": PROMPT}]},
            {"token_ids": "not tokens"},
        ):
            post(running, "/match", body)
        post(running, "/match/hashes", {"block_hashes": [1, 2]})
        post(running, "/match/hashes", {"prompts": [{"block_hashes": [1]}]})
        post(running, "/match/hashes", {"block_hashes": "no"})
        request(running, "GET", "/healthz")
        status, _headers, body = raw(running, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    counts = {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
        if s.name == "kvevents_router_request_duration_seconds_count"
    }
    p = ("process", "0")
    assert counts == {
        (("form", "single"), p, ("route", "/match")): 2,
        (("form", "batch"), p, ("route", "/match")): 1,
        (("form", "error"), p, ("route", "/match")): 1,
        (("form", "single"), p, ("route", "/match/hashes")): 1,
        (("form", "batch"), p, ("route", "/match/hashes")): 1,
        (("form", "error"), p, ("route", "/match/hashes")): 1,
        (p, ("route", "/healthz")): 1,
    }


def test_metrics_show_the_process_garbage_collections_when_timed() -> None:
    import gc

    from kvevents.commands._route_gc import GcPauses

    pauses = GcPauses()
    pauses.count, pauses.seconds, pauses.max_seconds = [7, 2, 1], [0.01, 0.004, 0.003], [0.002, 0.003, 0.003]
    index = CacheIndex()
    sock = bind("127.0.0.1", 0)
    server = make_server(sock, StaticSource(index), ServeOptions(block_size=BS), gc_pauses=pauses)
    with run_in_thread(server, sock) as port:
        running = Running("127.0.0.1", port, LivenessSource(index), index)
        status, _headers, body = raw(running, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }
    gen = (("generation", "1"), ("process", "0"))
    assert samples[("kvevents_router_gc_collections_total", gen)] == 2
    assert samples[("kvevents_router_gc_pause_seconds_total", gen)] == 0.004
    assert samples[("kvevents_router_gc_pause_max_seconds", gen)] == 0.003
    assert samples[("kvevents_router_gc_frozen_objects", (("process", "0"),))] == gc.get_freeze_count()


def test_metrics_leave_gc_out_when_not_timed(srv: Running) -> None:
    _status, _headers, body = raw(srv, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"kvevents_router_gc_" not in body

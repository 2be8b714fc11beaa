"""The service's own request reader (service.Handler.parse_request) on a raw socket: requests that arrive in pieces,
header names in any case, several requests on one kept-alive connection, HTTP/1.0, and a chunked body (refused,
never taken for the next request)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import time
from pathlib import Path
from typing import Any

from tests.coordinator.helpers import FAST, Env, serving, wait_for


def connect(env: Env) -> socket.socket:
    host, port = env.srv.server_address[:2]
    return socket.create_connection((str(host), int(port)), timeout=10)


class Reader:
    """One buffered reader over the socket for every answer on it (answers sent together share its buffer;
    http.client closes its file after each answer, so it is handed a view that does not close)."""

    def __init__(self, sock: socket.socket) -> None:
        self.file = sock.makefile("rb")

    def makefile(self, *_a: Any, **_k: Any) -> Any:
        return self

    def readline(self, limit: int = -1) -> bytes:
        return self.file.readline(limit)

    def read(self, n: int = -1) -> bytes:
        return self.file.read(n)

    def close(self) -> None:
        pass

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        resp = http.client.HTTPResponse(self)  # type: ignore[arg-type]
        resp.begin()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()

    def closed(self) -> bool:
        try:
            return self.file.read(1) == b""
        except ConnectionResetError:
            return True


def request(method: str, path: str, headers: list[str], body: bytes = b"", version: str = "HTTP/1.1") -> bytes:
    return (f"{method} {path} {version}\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode() + body


def register_body() -> bytes:
    return json.dumps({"job": "hx", "nnodes": 1, "node_rank": 0, "ranks": [0], "incarnation": "i1"}).encode()


def test_requests_in_pieces_any_header_case_and_kept_alive(env: Env) -> None:
    body = register_body()
    with connect(env) as s:
        r = Reader(s)
        # one request in pieces of 3 bytes, names in odd cases: read whole, answered, the connection kept
        req = request("POST", "/v1/agents/register", ["host: x", f"AUTHORIZATION: bearer {env.token}",
                                                      f"content-LENGTH: {len(body)}", "Content-Type: application/json"],
                      body)
        for i in range(0, len(req), 3):
            s.sendall(req[i:i + 3])
            time.sleep(0.001)
        status, hdrs, data = r.answer()
        assert status == 200, data
        assert json.loads(data)["agent_id"] == "hx@0" and int(hdrs["content-length"]) == len(data)
        # two more on the same connection, sent together (the reader must not run one into the other)
        s.sendall(request("GET", "/v1/jobs/hx", [f"Authorization: Bearer {env.token}"]) +
                  request("GET", "/v1/health", []))
        status, _, data = r.answer()
        got: Any = json.loads(data)
        assert status == 200 and got["job"] == "hx" and got["nodes"][0]["alive"], got
        status, _, data = r.answer()
        assert status == 200 and json.loads(data)["ok"] is True


def test_http_1_0_closes_after_its_answer(env: Env) -> None:
    with connect(env) as s:
        r = Reader(s)
        s.sendall(request("GET", "/v1/health", [], version="HTTP/1.0"))
        status, _, data = r.answer()
        assert status == 200 and json.loads(data)["ok"] is True
        assert r.closed(), "an HTTP/1.0 request without keep-alive must close the connection"


def test_a_chunked_body_is_refused_and_the_connection_closed(env: Env) -> None:
    body = register_body()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    with connect(env) as s:
        r = Reader(s)
        s.sendall(request("POST", "/v1/agents/register", [f"Authorization: Bearer {env.token}",
                                                          "Transfer-Encoding: chunked"], chunked))
        status, hdrs, _ = r.answer()
        assert status == 411 and hdrs.get("connection") == "close"
        assert r.closed()
    assert env.coordinator.catalog.jobs() == []  # nothing of the chunked body was taken as a request


def test_a_held_poll_ends_as_soon_as_its_client_closes(tmp_path: Path) -> None:
    """The poll is held for 30 s; its client closing ends it at once (the event loop sees the connection go), not
    when its wait runs out: the agent is counted out of the open polls, and so lost after --lost-after."""
    cfg = dataclasses.replace(FAST, poll_wait_s=30.0)
    with serving(tmp_path, cfg) as env:
        polls = lambda: env.coordinator.hub.stats(cfg.lost_after_s)[2]  # noqa: E731
        with connect(env) as s:
            r = Reader(s)
            body = register_body()
            s.sendall(request("POST", "/v1/agents/register", [f"Authorization: Bearer {env.token}",
                                                              f"Content-Length: {len(body)}"], body))
            assert r.answer()[0] == 200
            poll = json.dumps({"incarnation": "i1", "wait_s": 30}).encode()
            s.sendall(request("POST", "/v1/agents/hx@0/poll", [f"Authorization: Bearer {env.token}",
                                                               f"Content-Length: {len(poll)}"], poll))
            wait_for(lambda: polls() == 1, 10, "the poll held")
            r.file.close()  # its buffered reader holds the socket open too
        gone = time.monotonic()
        wait_for(lambda: polls() == 0, 10, "the poll ended")
        assert time.monotonic() - gone < 5, "the poll was held on after its client closed"
        wait_for(lambda: not env.coordinator.hub.alive("hx@0", cfg.lost_after_s), 10, "the agent counted out")

"""Local HTTP servers on 127.0.0.1 that answer like the clouds' documented metadata endpoints:

    aws    IMDSv2: PUT /latest/api/token (X-aws-ec2-metadata-token-ttl-seconds, 1-21600) gives a token that
           expires; GET /latest/meta-data/spot/instance-action needs a live token (else 401): 404 without a
           notice, 200 {"action", "time"} with one
    gce    GET /computeMetadata/v1/instance/preempted needs Metadata-Flavor: Google (else 403), answers
           TRUE/FALSE with Metadata-Flavor and ETag headers; ?wait_for_change=true[&last_etag=E][&timeout_sec=N]
           holds the answer until the value differs from E
    azure  GET /metadata/scheduledevents?api-version=... needs Metadata: true (else 400): {"DocumentIncarnation",
           "Events"}; POST with {"StartRequests": [{"EventId"}]} approves events (they leave the document);
           /metadata/instance/compute/name?format=text gives the VM's name when one is set (else 404)
    alibaba  ECS in security hardening mode: PUT /latest/api/token (X-aliyun-ecs-metadata-token-ttl-seconds)
           gives a token; GET /latest/meta-data/instance/spot/termination-time needs it (else 401): 404 without
           a notice, 200 with the release time (UTC, 2026-12-02T07:05:00Z)

Faults for tests: ``fail_next`` requests answer 500; ``delay`` seconds before every answer; ``expire_tokens()``.
"""

from __future__ import annotations

import email.utils
import json
import secrets
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeCloud:
    def __init__(self, kind: str) -> None:
        assert kind in ("aws", "gce", "azure", "alibaba")
        self.kind = kind
        self.lock = threading.Condition()
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # method, path, headers
        self.fail_next = 0
        self.delay = 0.0
        # aws
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.token_puts = 0
        self.unauthorized = 0
        self.action: dict[str, str] | None = None
        # alibaba (tokens as aws's)
        self.termination_time: str | None = None
        # gce
        self.preempted = False
        # azure
        self.events: list[dict[str, Any]] = []
        self.incarnation = 1
        self.acked: list[str] = []
        self.vm_name: str | None = None
        cloud = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _answer(self, status: int, body: bytes | str = b"", headers: dict[str, str] | None = None) -> None:
                data = body.encode() if isinstance(body, str) else body
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _common(self, method: str) -> bool:
                with cloud.lock:
                    cloud.requests.append((method, self.path, {k.lower(): v for k, v in self.headers.items()}))
                    fail = cloud.fail_next > 0
                    if fail:
                        cloud.fail_next -= 1
                    delay = cloud.delay
                if delay:
                    time.sleep(delay)
                if fail:
                    self._answer(500, "internal error")
                    return False
                return True

            def do_PUT(self) -> None:
                if not self._common("PUT"):
                    return
                getattr(cloud, f"_{cloud.kind}")(self, "PUT")

            def do_GET(self) -> None:
                if not self._common("GET"):
                    return
                getattr(cloud, f"_{cloud.kind}")(self, "GET")

            def do_POST(self) -> None:
                if not self._common("POST"):
                    return
                getattr(cloud, f"_{cloud.kind}")(self, "POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- what the tests change ------------------------------------------------------------------

    def notify(self, lead_s: float = 120.0, action: str = "terminate", event_id: str = "evt-1",
               vm: str | None = None) -> float:
        """Issue this cloud's preemption notice; returns the deadline it announces (epoch seconds)."""
        deadline = time.time() + lead_s
        with self.lock:
            if self.kind == "aws":
                self.action = {"action": action,
                               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline))}
            elif self.kind == "alibaba":
                self.termination_time = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline))
            elif self.kind == "gce":
                self.preempted = True
                deadline = time.time() + 30.0
            else:
                self.events.append({
                    "EventId": event_id, "EventType": "Preempt", "ResourceType": "VirtualMachine",
                    "Resources": [vm or "vm-0"], "EventStatus": "Scheduled",
                    "NotBefore": email.utils.formatdate(deadline, usegmt=True), "Description": "spot eviction",
                    "EventSource": "Platform", "DurationInSeconds": -1})
                self.incarnation += 1
            self.lock.notify_all()
        return deadline

    def expire_tokens(self) -> None:
        with self.lock:
            self.tokens.clear()

    # -- the clouds -----------------------------------------------------------------------------

    def _aws(self, h: Any, method: str) -> None:
        with self.lock:
            action = self.action
        self._tokened(h, method, "X-aws-ec2-metadata-token", {
            "/latest/meta-data/spot/instance-action": None if action is None else json.dumps(action)})

    def _alibaba(self, h: Any, method: str) -> None:
        self._tokened(h, method, "X-aliyun-ecs-metadata-token", {
            "/latest/meta-data/instance/spot/termination-time": self.termination_time})

    def _tokened(self, h: Any, method: str, header: str, items: dict[str, str | None]) -> None:
        """A metadata service whose reads need a session token (``header``; its TTL in ``header-ttl-seconds``):
        ``items`` path -> the answer (None: 404)."""
        path = h.path
        if method == "PUT" and path == "/latest/api/token":
            try:
                ttl = int(h.headers.get(f"{header}-ttl-seconds", ""))
            except ValueError:
                ttl = 0
            if not 1 <= ttl <= 21600:
                h._answer(400, "bad ttl")
                return
            token = secrets.token_urlsafe(24)
            with self.lock:
                self.tokens[token] = time.monotonic() + ttl
                self.token_puts += 1
            h._answer(200, token, {f"{header}-ttl-seconds": str(ttl)})
            return
        if method == "GET" and path.startswith("/latest/meta-data/"):
            token = h.headers.get(header, "")
            with self.lock:
                ok = token in self.tokens and self.tokens[token] > time.monotonic()
                if not ok:
                    self.unauthorized += 1
            if not ok:
                h._answer(401, "")
                return
            if items.get(path) is not None:
                h._answer(200, str(items[path]), {"Content-Type": "text/plain"})
                return
        h._answer(404, "Not Found")

    def _gce(self, h: Any, method: str) -> None:
        url = urllib.parse.urlsplit(h.path)
        if url.path != "/computeMetadata/v1/instance/preempted" or method != "GET":
            h._answer(404, "Not Found", {"Metadata-Flavor": "Google"})
            return
        if h.headers.get("Metadata-Flavor") != "Google":
            h._answer(403, "Missing Metadata-Flavor:Google header.", {"Metadata-Flavor": "Google"})
            return
        q = urllib.parse.parse_qs(url.query)

        def etag() -> str:
            return "etag-true" if self.preempted else "etag-false"

        with self.lock:
            if q.get("wait_for_change") == ["true"]:
                last = (q.get("last_etag") or [""])[0]
                wait = float((q.get("timeout_sec") or ["300"])[0])
                end = time.monotonic() + wait
                # Without last_etag, GCE answers when the value next changes; with it, at once if it differs.
                start_tag = last or etag()
                while etag() == start_tag and time.monotonic() < end:
                    self.lock.wait(max(0.0, end - time.monotonic()))
            value, tag = ("TRUE" if self.preempted else "FALSE"), etag()
        h._answer(200, value, {"Metadata-Flavor": "Google", "ETag": tag, "Content-Type": "application/text"})

    def _azure(self, h: Any, method: str) -> None:
        url = urllib.parse.urlsplit(h.path)
        if h.headers.get("Metadata") != "true":
            h._answer(400, json.dumps({"error": "Bad request. Required metadata header not specified"}))
            return
        if url.path == "/metadata/instance/compute/name":
            if self.vm_name:
                h._answer(200, self.vm_name)
            else:
                h._answer(404, "Not Found")
            return
        if url.path != "/metadata/scheduledevents" or "api-version=" not in url.query:
            h._answer(404, "Not Found")
            return
        if method == "POST":
            body = json.loads(h.rfile.read(int(h.headers.get("Content-Length") or 0)) or b"{}")
            with self.lock:
                for req in body.get("StartRequests") or []:
                    self.acked.append(req["EventId"])
                    self.events = [e for e in self.events if e["EventId"] != req["EventId"]]
                self.incarnation += 1
            h._answer(200, "")
            return
        with self.lock:
            doc = {"DocumentIncarnation": self.incarnation, "Events": list(self.events)}
        h._answer(200, json.dumps(doc), {"Content-Type": "application/json"})

"""The coordinator's HTTP/1.1 server: one asyncio event loop for every connection (standard library only).

With the standard library's thread-per-connection server, each agent's held long poll was a thread: at 2,048
nodes, 4,000 threads contending for the GIL and the hub's lock, a third of the coordinator's CPU in futex and
scheduler work (docs/benchmarks.md). Here a connection is an ``asyncio.Protocol``: a held poll is a future on
the loop, woken from any thread through one batched ``call_soon_threadsafe`` (``Wakeup``), and a client that
closes its connection is noticed at once (``connection_lost``), without looking at its socket.

What the server does itself: it reads the request line and headers (names in lower case, lines ending in
CRLF or LF, at most 64 KiB and 100 headers: 431), asks the application's ``head`` about them before reading
any of the body (the security gate: a refusal is answered and the connection closed, the body unread), reads
exactly Content-Length bytes, answers ``Expect: 100-continue``, keeps HTTP/1.1 connections alive (HTTP/1.0
only with ``Connection: keep-alive``), answers requests sent together in order, and writes each answer with one
send. The application's ``handle`` answers on the loop (it must not block) or returns an awaitable; blocking
work goes to ``Server.run_blocking`` (a thread pool). TLS: ``ssl.SSLObject`` over memory buffers (the handshake
within 30 s), so that a refused client certificate still gets its alert.

Why by hand (a library would otherwise do): the servers built on asyncio (aiohttp's among them) serve TLS
through asyncio's SSL transport, which closes a connection whose client certificate it refused without the
alert, and the security gate must answer from the request head before any body is read.
"""

from __future__ import annotations

import asyncio
import email.utils
import http
import json
import re
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

__all__ = ["App", "Request", "Response", "Server", "Wakeup"]

MAX_HEAD = 65536
MAX_HEADERS = 100
HANDSHAKE_S = 30.0  # a TLS client that has not finished its handshake by then is dropped
BLOCKING_THREADS = 256  # requests that may block (catalog writes, a trigger's wait, a restore board's wait)
_END = re.compile(rb"\r?\n\r?\n")
_PHRASES = {int(st): st.phrase for st in http.HTTPStatus}
_date: list[Any] = [0, ""]
T = TypeVar("T")


def http_date() -> str:
    now = int(time.time())
    if _date[0] != now:
        _date[:] = [now, email.utils.formatdate(now, usegmt=True)]
    return str(_date[1])


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: dict[str, str]
    """Names in lower case."""
    peer: str
    conn: Connection
    body: bytes = b""
    state: Any = None
    """What the application's ``head`` kept for ``handle`` (its admission)."""

    def get(self, name: str, default: None = None) -> str | None:
        """A header by name in any case (what the security gate asks for)."""
        return self.headers.get(name.lower(), default)


@dataclass
class Response:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"
    close: bool = False


class App(Protocol):
    def head(self, req: Request) -> Response | None:
        """Before the body is read: None to go on, or the refusal (the connection is then closed)."""
        ...

    def handle(self, req: Request) -> Response | Awaitable[Response]: ...

    def failed(self, req: Request, e: BaseException) -> Response:
        """The answer to a request whose ``handle`` raised."""
        ...


class Wakeup:
    """A held request's wake-up, callable from any thread (under any lock: it only takes its server's own).
    Many wake-ups at once (a round's commands to 2,048 agents) cost one ``call_soon_threadsafe``."""

    __slots__ = ("fut", "server")

    def __init__(self, server: Server) -> None:
        self.server = server
        self.fut: asyncio.Future[None] | None = None

    def __call__(self) -> None:
        self.server._woken(self)

    async def wait(self, timeout: float) -> None:
        """Until woken or ``timeout`` passed (the caller looks again at what it waits for)."""
        loop = self.server.loop
        fut = self.fut = loop.create_future()
        timer = loop.call_later(timeout, _done, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self.fut = None

    def now(self) -> None:
        """Wakes it from the loop's own thread."""
        _done(self.fut)


def _done(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


class Connection(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.req: Request | None = None  # its head read, its body not yet
        self.length = 0
        self.keep = True
        self.busy = False  # a request is being answered: what comes next waits in buf
        self.gone = False  # the client closed (or half-closed) its side
        self.paused = False
        self.waiting: Wakeup | None = None  # a held request, woken when the client goes
        self.tls: ssl.SSLObject | None = None  # TLS over memory buffers (_tls_in, _tls_out)
        self.handshaken = False
        self._tls_timer: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) else ""
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and body in one packet anyway
        self.server.conns.add(self)
        if self.server.tls is not None:
            self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
            self.tls = self.server.tls.wrap_bio(self._in, self._out, server_side=True)
            self._tls_timer = self.server.loop.call_later(HANDSHAKE_S, transport.abort)

    def _tls_in(self, data: bytes) -> bytes | None:
        """TLS records in, plain bytes out (None: the connection is closed). Done here over memory buffers rather
        than by the loop's own TLS so that a refused handshake still sends its alert (asyncio drops it), and the
        client learns why (an unknown client certificate) rather than seeing the connection just closed."""
        assert self.tls is not None and self.transport is not None
        self._in.write(data)
        if not self.handshaken:
            try:
                self.tls.do_handshake()
            except ssl.SSLWantReadError:
                self._tls_flush()
                return b""
            except (ssl.SSLError, OSError):
                self._tls_flush()
                self.transport.close()
                return None
            self.handshaken = True
            if self._tls_timer is not None:
                self._tls_timer.cancel()
        out: list[bytes] = []
        while True:
            try:
                chunk = self.tls.read(65536)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:  # close_notify: the client's EOF
                self._tls_flush()
                self.buf += b"".join(out)
                self.eof_received()
                return None
            except (ssl.SSLError, OSError):
                self._tls_flush()
                self.transport.close()
                return None
            if not chunk:
                break
            out.append(chunk)
        self._tls_flush()
        return b"".join(out)

    def _tls_flush(self) -> None:
        pending = self._out.read()
        if pending and self.transport is not None and not self.transport.is_closing():
            self.transport.write(pending)

    def _send(self, data: bytes) -> None:
        assert self.transport is not None
        if self.tls is None:
            self.transport.write(data)
            return
        try:
            self.tls.write(data)
        except (ssl.SSLError, OSError):
            self.transport.close()
            return
        self._tls_flush()

    def data_received(self, data: bytes) -> None:
        if self.tls is not None:
            plain = self._tls_in(data)
            if not plain:
                return
            data = plain
        self.buf += data
        if self.busy:
            if len(self.buf) > 2 * self.server.max_buffer and not self.paused:
                self.paused = True
                assert self.transport is not None
                self.transport.pause_reading()
            return
        self._next()

    def eof_received(self) -> bool:
        self._went()
        if not self.busy and self.transport is not None:
            self.transport.close()
        return True  # a request being answered still gets its answer

    def connection_lost(self, exc: Exception | None) -> None:
        if self._tls_timer is not None:
            self._tls_timer.cancel()
        self._went()
        self.server.conns.discard(self)

    def _went(self) -> None:
        self.gone = True
        if self.waiting is not None:
            self.waiting.now()

    # ---- requests ----------------------------------------------------------------------------------------------

    def _next(self) -> None:
        """Reads what the buffer holds of the next request; starts answering it once whole."""
        while not self.busy and self.transport is not None and not self.transport.is_closing():
            if self.req is None:
                end = _END.search(self.buf, 0, MAX_HEAD + 4)
                if end is None:
                    if len(self.buf) > MAX_HEAD:
                        self._refuse(431, "the request's header fields are too large")
                    elif self.gone:
                        self.transport.close()
                    return
                head = bytes(self.buf[:end.start()])
                del self.buf[:end.end()]
                if not self._parse(head):
                    return
                continue
            if len(self.buf) < self.length:
                if self.gone:
                    self.transport.close()
                return
            req, self.req = self.req, None
            req.body = bytes(self.buf[:self.length])
            del self.buf[:self.length]
            self._start(req)

    def _parse(self, head: bytes) -> bool:
        lines = str(head, "iso-8859-1").split("\n")
        while lines and not lines[0].strip():
            lines.pop(0)  # stray empty lines before a request line (RFC 9112 2.2)
        parts = lines[0].split() if lines else []
        if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
            self._refuse(400, "the request line is not HTTP/1.x")
            return False
        if len(lines) > MAX_HEADERS + 1:
            self._refuse(431, "too many header fields")
            return False
        hdrs: dict[str, str] = {}
        for raw in lines[1:]:
            name, sep, value = raw.partition(":")
            if not sep or not name.strip():
                self._refuse(400, f"a malformed header line {raw[:80]!r}")
                return False
            hdrs[name.strip().lower()] = value.strip()
        method, target, version = parts
        conn = hdrs.get("connection", "").lower()
        self.keep = conn != "close" and (version == "HTTP/1.1" or conn == "keep-alive")
        req = Request(method, target, version, hdrs, self.peer, self)
        refused = self.server.app.head(req)
        if refused is not None:
            refused.close = True
            self._write(refused)
            return False
        try:
            self.length = int(hdrs.get("content-length") or 0)
        except ValueError:
            self.length = -1
        if self.length < 0 or "transfer-encoding" in hdrs:  # the application's head lets none through: a fence
            self._refuse(411, "send the body with Content-Length (chunked bodies are not read)")
            return False
        if self.length and hdrs.get("expect", "").lower() == "100-continue":
            self._send(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.req = req
        return True

    def _start(self, req: Request) -> None:
        self.busy = True
        try:
            out = self.server.app.handle(req)
        except Exception as e:
            self._answer(self.server.app.failed(req, e))
            return
        if isinstance(out, Response):
            self._answer(out)
            return
        task = self.server.loop.create_task(self._wait(req, out))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    async def _wait(self, req: Request, out: Awaitable[Response]) -> None:
        try:
            resp = await out
        except asyncio.CancelledError:
            raise
        except Exception as e:
            resp = self.server.app.failed(req, e)
        self._answer(resp)

    def _answer(self, resp: Response) -> None:
        self._write(resp)
        self.busy = False
        if self.transport is None or self.transport.is_closing():
            return
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        if self.buf or self.gone:
            self.server.loop.call_soon(self._next)  # the next request sent with this one

    def _refuse(self, status: int, why: str) -> None:
        body = json.dumps({"error": "usage", "what": "the coordinator could not read the request", "why": why,
                           "hint": "send an HTTP/1.1 request with Content-Length"}).encode()
        self._write(Response(status, body, close=True))

    def _write(self, resp: Response) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        close = resp.close or not self.keep
        head = [f"HTTP/1.1 {resp.status} {_PHRASES.get(resp.status, '')}", "Server: cryosleep",
                f"Date: {http_date()}", f"Content-Type: {resp.content_type}", f"Content-Length: {len(resp.body)}"]
        head += [f"{k}: {v}" for k, v in resp.headers.items()]
        if close:
            head.append("Connection: close")
        self._send(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + resp.body)  # one send, not two
        if close:
            t.close()


class Server:
    """Listens on ``addr`` at once (an address in use raises OSError here); serves once ``serve_forever`` runs
    (in a thread of its own) until ``shutdown``."""

    def __init__(self, addr: tuple[str, int], app: App, tls: ssl.SSLContext | None = None,
                 max_buffer: int = 4 << 20) -> None:
        self.app = app
        self.tls = tls
        self.max_buffer = max_buffer
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(addr)
            self.socket.listen(4096)
        except OSError:
            self.socket.close()
            raise
        self.socket.setblocking(False)
        self.server_address: tuple[Any, ...] = self.socket.getsockname()
        self.loop = asyncio.new_event_loop()
        self.blocking = ThreadPoolExecutor(BLOCKING_THREADS, thread_name_prefix="http")
        self.conns: set[Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self._wake_lock = threading.Lock()
        self._wake: list[Wakeup] = []
        self._stop: asyncio.Event | None = None
        self._done = threading.Event()
        self._started = False
        self._closing = False

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host!s}:{port}"

    def wakeup(self) -> Wakeup:
        return Wakeup(self)

    def _woken(self, w: Wakeup) -> None:
        with self._wake_lock:
            self._wake.append(w)
            first = len(self._wake) == 1
        if first:
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _flush(self) -> None:
        with self._wake_lock:
            woken, self._wake = self._wake, []
        for w in woken:
            _done(w.fut)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.loop.run_in_executor(self.blocking, fn, *args)

    def serve_forever(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._started = True
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            for task in list(self.tasks):
                task.cancel()
            if self.tasks:
                self.loop.run_until_complete(asyncio.gather(*self.tasks, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            self._done.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        if self._closing:  # shut down before it started serving
            return
        srv = await self.loop.create_server(lambda: Connection(self), sock=self.socket, backlog=4096)
        await self._stop.wait()
        srv.close()
        await asyncio.sleep(0.05)  # answers already woken (the hub closed) go out
        for c in list(self.conns):
            if c.transport is not None:
                c.transport.abort()
        await asyncio.sleep(0)

    def shutdown(self) -> None:
        """Stops serving and closes every connection; returns once the loop ended."""
        self._closing = True
        if not self._started:
            return

        def go() -> None:
            if self._stop is not None:
                self._stop.set()
            else:  # not listening yet: ask again once it is
                self.loop.call_later(0.01, go)

        try:
            self.loop.call_soon_threadsafe(go)
        except RuntimeError:
            return  # already closed
        self._done.wait(10.0)
        self.blocking.shutdown(wait=False, cancel_futures=True)

    def server_close(self) -> None:
        self.socket.close()

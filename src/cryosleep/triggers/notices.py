"""Preemption-notice watchers: the warnings clouds give before they take a machine back.

    AwsWatcher    EC2 spot instance-action through IMDSv2 (a session token, refreshed before it expires and
                  again on 401); 404 means no notice; 200 gives {"action": ..., "time": ...}: the deadline
    GceWatcher    Compute Engine ``instance/preempted`` (TRUE/FALSE), optionally long-polled with
                  ``wait_for_change``; the machine goes 30 s after the notice
    AzureWatcher  Scheduled Events: an event of type ``Preempt``, its NotBefore the deadline (at least 30 s
                  for Spot VMs); acknowledged (StartRequests) once the job is safe, so the eviction need not wait
    AlibabaWatcher  ECS preemptible instances: ``instance/spot/termination-time``, 404 until the instance is to
                  be released, then the release time (UTC), about 5 minutes ahead; with a session token, as the
                  metadata service's security hardening mode requires

Each watcher's ``check()`` asks its endpoint once and returns a Notice or None, raising NoticeEndpointError
when the endpoint cannot be read; ``watch()`` polls until a notice comes or it is stopped, logging endpoint
errors and retrying: a metadata service that misbehaves never takes the agent down. Only the standard
library's urllib speaks HTTP here. ``probe()`` finds which cloud's endpoint answers (``--notices auto``).

A new source is one ``Watcher`` subclass here (its name, its documented endpoint, how to tell that endpoint
answers, how to read a notice and its deadline) named in ``WATCHERS``: the CLI's ``--notices`` and
``--notice-url``, ``--notices auto`` and the trigger runner take it from there.
"""

from __future__ import annotations

import calendar
import email.utils
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "DEFAULT_URLS",
    "SOURCES",
    "WATCHERS",
    "AlibabaWatcher",
    "AwsWatcher",
    "AzureWatcher",
    "GceWatcher",
    "Notice",
    "NoticeEndpointError",
    "Watcher",
    "make_watcher",
    "probe",
]

GCE_NOTICE_S = 30.0  # Compute Engine stops a preempted VM 30 s after the notice
AZURE_MIN_S = 30.0  # Spot eviction: NotBefore at least 30 s after the event appears
AWS_DEFAULT_S = 120.0  # spot interruption notices come 2 minutes ahead, when the time cannot be read
# ECS releases a preemptible instance 5 minutes after its notice; a time that cannot be read is taken as less
ALIBABA_DEFAULT_S = 120.0

Log = Callable[[str], None]


@dataclass(frozen=True)
class Notice:
    source: str  # a Watcher's source (SOURCES)
    deadline: float  # absolute, epoch seconds: when the machine goes
    detail: str  # what the endpoint said, in words
    event_id: str = ""  # the cloud's id for the event (Azure), to acknowledge it

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "deadline": self.deadline, "detail": self.detail, "event_id": self.event_id}


class NoticeEndpointError(Exception):
    """The metadata endpoint could not be read (refused, timed out, answered an error)."""


def _request(method: str, url: str, headers: Mapping[str, str], timeout: float,
             body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body); an HTTP error status is returned, not raised; no answer raises."""
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers))
    # No proxy: these endpoints are on the machine's own link; a proxy would answer for another machine.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as e:
        data = e.read() if e.fp is not None else b""
        return e.code, {k.lower(): v for k, v in (e.headers or {}).items()}, data
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise NoticeEndpointError(f"{method} {url}: {reason}") from e


def _http_date(text: str) -> float | None:
    """Epoch seconds of an RFC 3339 (AWS: 2026-11-29T23:10:00Z) or RFC 1123 (Azure) time, or None."""
    text = text.strip()
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S.%fZ"):
        try:
            return float(calendar.timegm(time.strptime(text, fmt)))
        except ValueError:
            pass
    try:
        return email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError, IndexError):
        return None


class Watcher:
    """One cloud's notice endpoint. Subclasses implement ``check`` and ``answers``; ``done`` is called once the
    job is safe."""

    source: ClassVar[str] = ""
    """The name in ``--notices``, ``--notice-url SOURCE=URL`` and the trigger's ``notice:SOURCE``."""
    default_url: ClassVar[str] = ""
    """The cloud's documented link-local metadata endpoint (``--notice-url`` replaces it)."""
    watch_options: ClassVar[dict[str, Any]] = {}
    """Options the trigger runner watches with (``make_watcher`` applies them under the caller's)."""

    def __init__(self, base_url: str | None = None, *, interval: float = 5.0, timeout: float = 2.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.base = (base_url or self.default_url).rstrip("/")
        self.interval = interval
        self.timeout = timeout
        self.clock = clock
        self.errors = 0  # consecutive endpoint errors

    def check(self) -> Notice | None:
        raise NotImplementedError

    @classmethod
    def answers(cls, base: str, timeout: float) -> bool:
        """The endpoint at ``base`` answers like this cloud's (``--notices auto``); raises NoticeEndpointError
        when nothing answers."""
        raise NotImplementedError

    def done(self, notice: Notice, log: Log) -> None:
        """The job is safe (or gone): tell the cloud, where it listens for that. Default: nothing to say."""

    def watch(self, stop: threading.Event, log: Log) -> Notice | None:
        """Poll until a notice comes (returned) or ``stop`` is set (None). Endpoint errors are logged (the
        first, then every 60th, and the recovery) and retried at the poll interval."""
        while not stop.is_set():
            try:
                notice = self.check()
            except NoticeEndpointError as e:
                self.errors += 1
                if self.errors == 1 or self.errors % 60 == 0:
                    log(f"{self.source} notice endpoint error #{self.errors}, retrying every {self.interval:g} s: {e}")
                notice = None
            except Exception as e:  # a malformed answer must not end the watch either
                self.errors += 1
                log(f"{self.source} notice watcher: unexpected {type(e).__name__}: {e}; retrying")
                notice = None
            else:
                if self.errors:
                    log(f"{self.source} notice endpoint answers again after {self.errors} error(s)")
                self.errors = 0
            if notice is not None:
                return notice
            stop.wait(self.interval)
        return None


class AwsWatcher(Watcher):
    """EC2 spot instance-action through IMDSv2."""

    source = "aws"
    default_url = "http://169.254.169.254"
    TOKEN_PATH = "/latest/api/token"
    TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
    TOKEN_HEADER = "X-aws-ec2-metadata-token"
    ACTION_PATH = "/latest/meta-data/spot/instance-action"

    def __init__(self, base_url: str | None = None, *, token_ttl: int = 21600, **kw: Any) -> None:
        super().__init__(base_url, **kw)
        self.token_ttl = token_ttl
        self._token = ""
        self._token_expires = 0.0  # monotonic

    def _get_token(self) -> str:
        now = time.monotonic()
        # Renew once 90 % of its life is gone: never send a token that expires on the way.
        if self._token and now < self._token_expires:
            return self._token
        status, _, body = _request("PUT", self.base + self.TOKEN_PATH, {self.TOKEN_TTL_HEADER: str(self.token_ttl)},
                                   self.timeout)
        if status != 200 or not body.strip():
            raise NoticeEndpointError(f"the {self.source} metadata token request answered HTTP {status}: "
                                      f"{body[:200]!r}")
        self._token = body.decode().strip()
        self._token_expires = now + self.token_ttl * 0.9
        return self._token

    @classmethod
    def answers(cls, base: str, timeout: float) -> bool:
        status, _, body = _request("PUT", base + cls.TOKEN_PATH, {cls.TOKEN_TTL_HEADER: "60"}, timeout)
        return status == 200 and bool(body.strip())

    def _get(self, path: str) -> bytes | None:
        """GET with the session token (a new one, once, on 401): the body, or None on 404 (no notice)."""
        for attempt in (1, 2):
            status, _, body = _request("GET", self.base + path, {self.TOKEN_HEADER: self._get_token()}, self.timeout)
            if status == 401 and attempt == 1:  # the token expired or was revoked: a new one, once
                self._token = ""
                continue
            break
        if status == 404:
            return None
        if status != 200:
            raise NoticeEndpointError(f"{path.rpartition('meta-data/')[2]} answered HTTP {status}: {body[:200]!r}")
        return body

    def check(self) -> Notice | None:
        body = self._get(self.ACTION_PATH)
        if body is None:
            return None
        now = self.clock()
        try:
            doc = json.loads(body)
            action, when = str(doc.get("action", "")), str(doc.get("time", ""))
        except (ValueError, AttributeError, RecursionError):
            raise NoticeEndpointError(f"spot/instance-action is not the documented JSON: {body[:200]!r}") from None
        deadline = _http_date(when)
        if deadline is None:
            deadline = now + AWS_DEFAULT_S
            when = f"{when!r} unreadable, assuming {AWS_DEFAULT_S:g} s"
        return Notice("aws", deadline, f"spot instance-action {action or '?'} at {when}")


class GceWatcher(Watcher):
    """Compute Engine ``instance/preempted``; ``long_poll`` uses wait_for_change (one request per change)."""

    source = "gce"
    default_url = "http://metadata.google.internal"
    # A long poll is answered the moment the value changes: the notice's 30 s are not spent polling.
    watch_options: ClassVar[dict[str, Any]] = {"long_poll": True}
    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self, base_url: str | None = None, *, long_poll: bool = False, long_poll_s: int = 60,
                 **kw: Any) -> None:
        super().__init__(base_url, **kw)
        self.long_poll = long_poll
        self.long_poll_s = long_poll_s
        self._etag = ""

    @classmethod
    def answers(cls, base: str, timeout: float) -> bool:
        status, headers, _ = _request("GET", base + cls.PATH, {"Metadata-Flavor": "Google"}, timeout)
        return status == 200 and headers.get("metadata-flavor", "").lower() == "google"

    def check(self) -> Notice | None:
        url, timeout = self.base + self.PATH, self.timeout
        if self.long_poll:
            url += f"?wait_for_change=true&timeout_sec={self.long_poll_s}"
            if self._etag:
                url += f"&last_etag={self._etag}"
            timeout += self.long_poll_s
        status, headers, body = _request("GET", url, {"Metadata-Flavor": "Google"}, timeout)
        if status != 200:
            raise NoticeEndpointError(f"instance/preempted answered HTTP {status}: {body[:200]!r}")
        self._etag = headers.get("etag", "")
        value = body.decode(errors="replace").strip().upper()
        if value == "TRUE":
            return Notice("gce", self.clock() + GCE_NOTICE_S, f"instance/preempted TRUE ({GCE_NOTICE_S:g} s notice)")
        if value != "FALSE":
            raise NoticeEndpointError(f"instance/preempted answered neither TRUE nor FALSE: {body[:200]!r}")
        return None

    def watch(self, stop: threading.Event, log: Log) -> Notice | None:
        if self.long_poll:
            # A long poll returns as soon as the value changes; the poll interval only spaces out errors.
            saved, self.interval = self.interval, min(self.interval, 1.0)
            try:
                return super().watch(stop, log)
            finally:
                self.interval = saved
        return super().watch(stop, log)


class AzureWatcher(Watcher):
    """Azure Scheduled Events: the first ``Preempt`` event that concerns this VM (or any VM, when its name is
    not known and cannot be read from the instance metadata)."""

    source = "azure"
    default_url = "http://169.254.169.254"
    PATH = "/metadata/scheduledevents?api-version=2020-07-01"
    NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"

    def __init__(self, base_url: str | None = None, *, vm_name: str | None = None, acknowledge: bool = True,
                 **kw: Any) -> None:
        super().__init__(base_url, **kw)
        self.vm_name = vm_name
        self._name_known = vm_name is not None
        self.acknowledge = acknowledge

    def _name(self) -> str | None:
        if not self._name_known:
            self._name_known = True
            try:
                status, _, body = _request("GET", self.base + self.NAME_PATH, {"Metadata": "true"}, self.timeout)
                if status == 200 and body.strip():
                    self.vm_name = body.decode().strip()
            except NoticeEndpointError:
                pass
        return self.vm_name

    @classmethod
    def answers(cls, base: str, timeout: float) -> bool:
        status, _, body = _request("GET", base + cls.PATH, {"Metadata": "true"}, timeout)
        return status == 200 and b"DocumentIncarnation" in body

    def check(self) -> Notice | None:
        status, _, body = _request("GET", self.base + self.PATH, {"Metadata": "true"}, self.timeout)
        if status != 200:
            raise NoticeEndpointError(f"scheduledevents answered HTTP {status}: {body[:200]!r}")
        try:
            events = json.loads(body).get("Events") or []
            if not isinstance(events, list):
                raise ValueError("Events is not a list")
        except (ValueError, AttributeError, RecursionError):
            raise NoticeEndpointError(f"scheduledevents is not the documented JSON: {body[:200]!r}") from None
        name = self._name()
        now = self.clock()
        for ev in events:
            if not isinstance(ev, dict) or ev.get("EventType") != "Preempt":
                continue
            resources = ev.get("Resources") or []
            if not isinstance(resources, list):  # not the documented list of names: the event may be ours
                resources = []
            if name and resources and name not in resources:
                continue
            not_before = str(ev.get("NotBefore") or "")
            deadline = _http_date(not_before) if not_before else None
            if deadline is None:  # started already, or unreadable: the Spot minimum
                deadline = now + AZURE_MIN_S
            return Notice("azure", deadline,
                          f"scheduled event Preempt {ev.get('EventId', '?')} not before {not_before or 'now'} "
                          f"({ev.get('EventStatus', '?')})", event_id=str(ev.get("EventId", "")))
        return None

    def done(self, notice: Notice, log: Log) -> None:
        """Approve the event (StartRequests): the job is safe, the eviction need not wait for NotBefore."""
        if not self.acknowledge or not notice.event_id:
            return
        body = json.dumps({"StartRequests": [{"EventId": notice.event_id}]}).encode()
        try:
            status, _, answer = _request("POST", self.base + self.PATH,
                                         {"Metadata": "true", "Content-Type": "application/json"}, self.timeout, body)
        except NoticeEndpointError as e:
            log(f"azure: could not acknowledge event {notice.event_id}: {e}")
            return
        if status != 200:
            log(f"azure: acknowledging event {notice.event_id} answered HTTP {status}: {answer[:200]!r}")
        else:
            log(f"azure: acknowledged event {notice.event_id}")


class AlibabaWatcher(AwsWatcher):
    """Alibaba Cloud ECS preemptible instances: the metadata service's ``instance/spot/termination-time`` (404: no
    notice; 200: the release time, UTC). Its session tokens work as IMDSv2's, under Alibaba's header names."""

    source = "alibaba"
    default_url = "http://100.100.100.200"
    TOKEN_TTL_HEADER = "X-aliyun-ecs-metadata-token-ttl-seconds"
    TOKEN_HEADER = "X-aliyun-ecs-metadata-token"
    ACTION_PATH = "/latest/meta-data/instance/spot/termination-time"

    def check(self) -> Notice | None:
        body = self._get(self.ACTION_PATH)
        if body is None:
            return None
        when = body.decode(errors="replace").strip()
        deadline = _http_date(when)
        if deadline is None:
            deadline = self.clock() + ALIBABA_DEFAULT_S
            when = f"{when[:64]!r} unreadable, assuming {ALIBABA_DEFAULT_S:g} s"
        return Notice("alibaba", deadline, f"preemptible instance released at {when}")


# The sources, in the order ``--notices auto`` lists them: a new one is named here.
WATCHERS: tuple[type[Watcher], ...] = (AwsWatcher, GceWatcher, AzureWatcher, AlibabaWatcher)
SOURCES = tuple(w.source for w in WATCHERS)
DEFAULT_URLS = {w.source: w.default_url for w in WATCHERS}
_BY_SOURCE = {w.source: w for w in WATCHERS}


def make_watcher(source: str, base_url: str | None = None, **kw: Any) -> Watcher:
    """The watcher of ``source``, with its ``watch_options`` under ``kw``."""
    cls = _BY_SOURCE[source]
    return cls(base_url, **{**cls.watch_options, **kw})


def probe(urls: Mapping[str, str] | None = None, timeout: float = 1.0) -> list[str]:
    """The clouds whose notice endpoint answers here, like that cloud's (``--notices auto``)."""
    urls = urls or {}
    found: list[str] = []

    def ask(cls: type[Watcher]) -> None:
        try:
            ok = cls.answers((urls.get(cls.source) or cls.default_url).rstrip("/"), timeout)
        except NoticeEndpointError:
            ok = False
        if ok:
            found.append(cls.source)

    threads = [threading.Thread(target=ask, args=(w,), daemon=True) for w in WATCHERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1.0)
    return [s for s in SOURCES if s in found]

"""The notice watchers against real HTTP servers on 127.0.0.1 that answer like the documented endpoints."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from cryosleep.triggers import notices
from cryosleep.triggers.notices import AlibabaWatcher, AwsWatcher, AzureWatcher, GceWatcher, NoticeEndpointError
from tests.clouds import FakeCloud


@pytest.fixture
def cloud(request: pytest.FixtureRequest) -> Iterator[FakeCloud]:
    c = FakeCloud(request.param)
    yield c
    c.close()


def closed_port_url() -> str:
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("cloud", ["aws"], indirect=True)
def test_aws_token_flow_no_notice_then_notice(cloud: FakeCloud) -> None:
    w = AwsWatcher(cloud.url, interval=0.05)
    assert w.check() is None and w.check() is None and w.check() is None
    assert cloud.token_puts == 1, "the token is reused while it lives"
    puts = [r for r in cloud.requests if r[0] == "PUT"]
    assert puts[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    deadline = cloud.notify(lead_s=120, action="stop")
    n = w.check()
    assert n is not None and n.source == "aws"
    assert abs(n.deadline - deadline) <= 1.0  # the notice's time, to the second
    assert "stop" in n.detail


@pytest.mark.parametrize("cloud", ["aws"], indirect=True)
def test_aws_401_gets_a_new_token_and_ttl_renews_before_expiry(cloud: FakeCloud) -> None:
    w = AwsWatcher(cloud.url)
    assert w.check() is None
    cloud.expire_tokens()  # revoked (or expired) on the server side: 401, then one new token
    assert w.check() is None
    assert cloud.unauthorized == 1 and cloud.token_puts == 2
    short = AwsWatcher(cloud.url, token_ttl=1)
    assert short.check() is None
    time.sleep(1.0)  # 90 % of its life gone: renewed before use, so the server never sees a stale token
    before = cloud.unauthorized
    assert short.check() is None
    assert cloud.unauthorized == before and cloud.token_puts == 4


@pytest.mark.parametrize("cloud", ["aws"], indirect=True)
def test_aws_errors_are_raised_by_check_and_survived_by_watch(cloud: FakeCloud) -> None:
    w = AwsWatcher(cloud.url, interval=0.05)
    cloud.fail_next = 1
    with pytest.raises(NoticeEndpointError, match="500"):
        w.check()
    cloud.fail_next = 5
    logs: list[str] = []
    stop = threading.Event()
    got: list[notices.Notice | None] = []
    t = threading.Thread(target=lambda: got.append(w.watch(stop, logs.append)))
    t.start()
    time.sleep(0.6)
    assert t.is_alive(), "the watcher gave up on a failing endpoint"
    cloud.notify(lead_s=90)
    t.join(5)
    assert got and got[0] is not None and got[0].source == "aws"
    assert any("error #1" in m for m in logs) and any("answers again" in m for m in logs), logs


@pytest.mark.parametrize("cloud", ["aws"], indirect=True)
def test_slow_endpoint_times_out_and_garbage_is_an_error(cloud: FakeCloud) -> None:
    w = AwsWatcher(cloud.url, timeout=0.2)
    cloud.delay = 1.0
    t0 = time.monotonic()
    with pytest.raises(NoticeEndpointError):
        w.check()
    assert time.monotonic() - t0 < 0.9
    cloud.delay = 0.0
    with cloud.lock:
        cloud.action = {"oops": "x"}  # not the documented JSON: an action without a time
    n = w.check()
    assert n is not None and n.deadline - time.time() == pytest.approx(notices.AWS_DEFAULT_S, abs=2)
    with pytest.raises(NoticeEndpointError):
        AwsWatcher(closed_port_url(), timeout=0.5).check()


@pytest.mark.parametrize("cloud", ["gce"], indirect=True)
def test_gce_preempted_true_false_and_header(cloud: FakeCloud) -> None:
    w = GceWatcher(cloud.url, clock=lambda: 1000.0)
    assert w.check() is None
    assert cloud.requests[-1][2]["metadata-flavor"] == "Google"
    cloud.notify()
    n = w.check()
    assert n is not None and n.source == "gce" and n.deadline == 1030.0
    cloud.fail_next = 1
    with pytest.raises(NoticeEndpointError, match="500"):
        w.check()


@pytest.mark.parametrize("cloud", ["gce"], indirect=True)
def test_gce_long_poll_answers_when_the_value_changes(cloud: FakeCloud) -> None:
    w = GceWatcher(cloud.url, long_poll=True, long_poll_s=10, interval=5.0)
    stop = threading.Event()
    got: list[notices.Notice | None] = []
    t = threading.Thread(target=lambda: got.append(w.watch(stop, lambda m: None)))
    t.start()
    time.sleep(0.8)
    flipped = time.monotonic()
    cloud.notify()
    t.join(5)
    assert got and got[0] is not None
    assert time.monotonic() - flipped < 1.0, "the long poll did not return on the change"
    gets = [r for r in cloud.requests if r[0] == "GET"]
    assert len(gets) <= 3 and all("wait_for_change=true" in r[1] for r in gets), gets


@pytest.mark.parametrize("cloud", ["azure"], indirect=True)
def test_azure_preempt_event_deadline_other_events_and_other_vms(cloud: FakeCloud) -> None:
    w = AzureWatcher(cloud.url, interval=0.05)
    assert w.check() is None
    with cloud.lock:
        cloud.events.append({"EventId": "f1", "EventType": "Freeze", "Resources": ["vm-0"], "NotBefore": ""})
    assert w.check() is None
    deadline = cloud.notify(lead_s=45, event_id="p1")
    n = w.check()
    assert n is not None and n.event_id == "p1" and abs(n.deadline - deadline) <= 1.0
    assert cloud.requests[-1][2]["metadata"] == "true"
    w.done(n, lambda m: None)
    assert cloud.acked == ["p1"]
    assert w.check() is None  # approved: gone from the document
    cloud.vm_name = "vm-7"
    named = AzureWatcher(cloud.url)
    cloud.notify(lead_s=45, event_id="p2", vm="vm-3")
    assert named.check() is None, "an event for another VM was taken for ours"
    cloud.notify(lead_s=45, event_id="p3", vm="vm-7")
    got = named.check()
    assert got is not None and got.event_id == "p3"


@pytest.mark.parametrize("cloud", ["azure"], indirect=True)
def test_azure_started_event_without_not_before_gets_the_spot_minimum(cloud: FakeCloud) -> None:
    with cloud.lock:
        cloud.events.append({"EventId": "s1", "EventType": "Preempt", "Resources": ["vm-0"], "NotBefore": "",
                             "EventStatus": "Started"})
    n = AzureWatcher(cloud.url, clock=lambda: 500.0).check()
    assert n is not None and n.deadline == 530.0


@pytest.mark.parametrize("cloud", ["alibaba"], indirect=True)
def test_alibaba_token_flow_no_notice_then_the_release_time(cloud: FakeCloud) -> None:
    """ECS in security hardening mode: every read carries a session token (Alibaba's header names, not AWS's);
    404 until the instance is to be released, then its release time: the deadline, to the second."""
    w = AlibabaWatcher(cloud.url, interval=0.05)
    assert w.check() is None and w.check() is None
    assert cloud.token_puts == 1 and cloud.unauthorized == 0
    (put,) = [r for r in cloud.requests if r[0] == "PUT"]
    assert put[2]["x-aliyun-ecs-metadata-token-ttl-seconds"] == "21600"
    assert all("x-aliyun-ecs-metadata-token" in r[2] for r in cloud.requests if r[0] == "GET")
    cloud.expire_tokens()  # a token past its TTL: 401, then one new token
    assert w.check() is None and cloud.unauthorized == 1 and cloud.token_puts == 2
    deadline = cloud.notify(lead_s=300)
    got: list[notices.Notice | None] = []
    t = threading.Thread(target=lambda: got.append(w.watch(threading.Event(), lambda _m: None)))
    t.start()
    t.join(5)
    (n,) = got
    assert n is not None and n.source == "alibaba" and abs(n.deadline - deadline) <= 1.0
    assert "released at" in n.detail


@pytest.mark.parametrize("cloud", ["alibaba"], indirect=True)
def test_alibaba_unreadable_time_and_errors(cloud: FakeCloud) -> None:
    w = AlibabaWatcher(cloud.url, clock=lambda: 1000.0)
    cloud.termination_time = "soon"
    n = w.check()
    assert n is not None and n.deadline == 1000.0 + notices.ALIBABA_DEFAULT_S and "unreadable" in n.detail
    cloud.fail_next = 1  # the token request fails: the endpoint error is raised, the watch would retry
    w._token = ""
    with pytest.raises(NoticeEndpointError, match="alibaba metadata token request answered HTTP 500"):
        w.check()
    assert w.check() is not None  # a token again
    cloud.fail_next = 1  # the read fails
    with pytest.raises(NoticeEndpointError, match="termination-time answered HTTP 500"):
        w.check()
    assert AwsWatcher(cloud.url).answers(cloud.url, 1.0) is False  # AWS's header names get no token here
    assert AlibabaWatcher.answers(cloud.url, 1.0) is True


def test_probe_finds_the_cloud_that_answers() -> None:
    clouds = {k: FakeCloud(k) for k in notices.SOURCES}
    try:
        for k, c in clouds.items():
            others = {o: closed_port_url() for o in notices.SOURCES if o != k}
            assert notices.probe({k: c.url, **others}, timeout=0.5) == [k]
        assert notices.probe({k: closed_port_url() for k in notices.SOURCES}, timeout=0.5) == []
    finally:
        for c in clouds.values():
            c.close()


def test_make_watcher_defaults_to_the_documented_endpoints() -> None:
    assert notices.make_watcher("aws").base == "http://169.254.169.254"
    assert notices.make_watcher("gce").base == "http://metadata.google.internal"
    assert notices.make_watcher("azure", "http://127.0.0.1:9/").base == "http://127.0.0.1:9"
    assert notices.make_watcher("alibaba").base == "http://100.100.100.200"


def test_every_source_comes_from_the_one_list() -> None:
    """A source is named once, in WATCHERS: the CLI's --notices and --notice-url, --notices auto and the runner's
    options (the long poll for gce) come from its class."""
    from cryosleep.cli.main import parse
    from cryosleep.cli.triggers import trigger_config

    assert tuple(w.source for w in notices.WATCHERS) == notices.SOURCES and len(set(notices.SOURCES)) >= 3
    assert all(notices.DEFAULT_URLS[w.source] == w.default_url.rstrip("/") != "" for w in notices.WATCHERS)
    gce = notices.make_watcher("gce", interval=1.0)
    assert isinstance(gce, GceWatcher) and gce.long_poll  # the runner's option
    assert not notices.make_watcher("gce", long_poll=False).long_poll  # the caller's comes first
    argv = ["run", "--notices", ",".join(notices.SOURCES),
            *[a for s in notices.SOURCES for a in ("--notice-url", f"{s}=http://127.0.0.1:9")], "train.py"]
    cfg = trigger_config(parse(argv))
    assert cfg.notices == list(notices.SOURCES) and set(cfg.notice_urls) == set(notices.SOURCES)

"""The restore's board at the coordinator (coordinator/rendezvous.py), over real HTTP."""

from __future__ import annotations

import threading
import time

import pytest

from cryosleep.coordinator import rendezvous
from cryosleep.errors import UsageError
from tests.coordinator.helpers import Env


def test_posts_and_reads_by_prefix_per_snapshot(env: Env) -> None:
    c = env.client()
    assert c.rendezvous("s1", {"ready/0": {"ok": True}, "uid/a/1": "00ff"}) == {}
    got = c.rendezvous("s1", prefix="ready/")
    assert list(got) == ["ready/0"] and got["ready/0"]["value"] == {"ok": True} and got["ready/0"]["age_s"] >= 0
    assert c.rendezvous("s2", prefix="") == {}  # another snapshot's board is empty


def test_a_read_waits_for_enough_keys_and_wakes_when_they_come(env: Env) -> None:
    c = env.client()
    t = threading.Timer(0.3, lambda: env.client().rendezvous("s", {"ready/1": {"ok": True}}))
    t.start()
    start = time.monotonic()
    got = c.rendezvous("s", {"ready/0": {"ok": True}}, prefix="ready/", min_keys=2, wait_s=10)
    took = time.monotonic() - start
    t.join()
    assert sorted(got) == ["ready/0", "ready/1"] and 0.2 < took < 5
    start = time.monotonic()
    got = c.rendezvous("s", prefix="ready/", min_keys=3, wait_s=0.5)  # never comes: the wait ends
    assert len(got) == 2 and 0.4 < time.monotonic() - start < 5


def test_entries_expire_and_a_board_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    b = rendezvous.Board()
    b.exchange("s", {"k": 1})
    monkeypatch.setattr(rendezvous, "KEEP_S", 0.0)
    time.sleep(0.01)
    assert b.exchange("s", prefix="") == {"items": {}}
    monkeypatch.setattr(rendezvous, "MAX_KEYS", 2)
    with pytest.raises(UsageError, match="too many keys"):
        b.exchange("s", {"a": 1, "b": 2, "c": 3})

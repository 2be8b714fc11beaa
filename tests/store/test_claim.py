"""Conditional writes (Backend.put_if) and the job's claim built on them (agent/resume.py), on a directory and on a
real S3 server: of writers that read the same version, exactly one wins."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cryosleep.agent import resume
from cryosleep.errors import Conflict
from cryosleep.store.backend import Backend, LocalBackend


def test_put_if_creates_once_and_then_only_over_the_version_read(backend: Backend) -> None:
    assert backend.get_versioned("jobs/a.json") is None
    v1 = backend.put_if("jobs/a.json", b"one", None)
    with pytest.raises(Conflict):
        backend.put_if("jobs/a.json", b"two", None)  # it exists now
    got = backend.get_versioned("jobs/a.json")
    assert got is not None and got == (b"one", v1)
    v2 = backend.put_if("jobs/a.json", b"two", v1)
    assert v2 != v1
    with pytest.raises(Conflict):
        backend.put_if("jobs/a.json", b"three", v1)  # stale: someone wrote since
    assert backend.get("jobs/a.json") == b"two"
    assert [o.name for o in backend.list("jobs/")] == ["jobs/a.json"]  # the lock files stay out of listings


def test_of_writers_over_one_version_exactly_one_wins(tmp_path: Path) -> None:
    """On a directory (a lock per name). Not run against the test S3 server: Ceph RGW's POSIX driver checks
    If-Match and then writes without serializing the writers (all 6 of 6 concurrent writers succeeded, measured);
    AWS S3 serializes them (the losers get 412 or 409)."""
    backend = LocalBackend(tmp_path / "cas")
    v = backend.put_if("jobs/b.json", b"base", None)
    go = threading.Barrier(6)

    def attempt(i: int) -> bool:
        go.wait()
        try:
            backend.put_if("jobs/b.json", f"writer {i}".encode(), v)
            return True
        except Conflict:
            return False

    with ThreadPoolExecutor(6) as ex:
        won = [i for i, ok in enumerate(ex.map(attempt, range(6))) if ok]
    assert len(won) == 1
    assert backend.get("jobs/b.json") == f"writer {won[0]}".encode()


def test_two_claims_of_one_job_one_takes_it_and_the_other_sees_who(backend: Backend,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = resume.Claim("unused", "j"), resume.Claim("unused", "j")
    for c in (first, second):
        monkeypatch.setattr(c, "backend", lambda: backend)
    assert first.read() is None and second.read() is None
    first.write("running", None)
    with pytest.raises(Conflict):
        second.write("running", None)  # both read "no record": the second write loses
    rec = second.read()
    assert rec is not None and rec.run == first.run and rec.state == "running"
    # the first run's heartbeats keep going over its own record
    assert first.keep("running", None) and first.keep("running", None)
    # a run that takes the record over (the first one's lease lapsed): the first one no longer writes
    second.read()
    second.write("running", "snap-1")
    assert first.keep("ended", None) is False
    assert first.lost is not None and first.lost.run == second.run
    final = resume.Claim("unused", "j")
    monkeypatch.setattr(final, "backend", lambda: backend)
    got = final.read()
    assert got is not None and got.run == second.run and got.snapshot == "snap-1"

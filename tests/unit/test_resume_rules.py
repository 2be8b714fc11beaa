"""The launcher's resume rules (agent/resume.py): every case without jobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from cryosleep.agent import resume
from cryosleep.agent.resume import Candidate, Found, StoreRecord, choose


def spec(*args: str, nproc: int = 2, python: str = "/opt/venv/bin/python3") -> dict[str, object]:
    return {"name": "exp", "program": [python, "-u", "/srv/train.py", *args], "nproc_per_node": nproc,
            "nnodes": 1, "node_rank": 0, "env": {"SLURM_JOB_ID": "1"}}


def snap(sid: str, mode: str = "stop", at: float = 10.0, verified: bool = True, **kw: object) -> Candidate:
    return Candidate(sid, mode, at, dict(spec("--lr", "1"), **kw), verified, "local")


NOW = spec("--lr", "1")


def test_a_suspended_job_resumes_its_stop_snapshot() -> None:
    c = choose(Found(NOW, last_state="suspended", last_snapshot="s2", candidates=(snap("s1"), snap("s2"))), "auto")
    assert c.action == "restore" and c.snapshot is not None and c.snapshot.id == "s2"
    assert "suspended in snapshot s2" in c.reasons[0]


def test_the_interpreter_path_may_differ_but_nothing_else() -> None:
    moved = Found(spec("--lr", "1", python="/usr/bin/python3.12"), last_state="suspended", last_snapshot="s1",
                  candidates=(snap("s1"),))
    assert choose(moved, "auto").action == "restore"
    other = Found(spec("--lr", "2"), last_state="suspended", last_snapshot="s1", candidates=(snap("s1"),))
    c = choose(other, "auto")
    assert c.action == "refuse" and "s1" in c.reasons[0] and "'--lr', '1'" in c.reasons[0]
    shape = Found(spec("--lr", "1", nproc=4), last_state="suspended", last_snapshot="s1", candidates=(snap("s1"),))
    assert "nproc_per_node: 2 then, 4 now" in choose(shape, "auto").reasons[0]


def test_fresh_wins_and_a_suspended_snapshot_missing_from_every_store_is_refused() -> None:
    f = Found(NOW, last_state="suspended", last_snapshot="s9", candidates=(snap("s1"),))
    assert choose(f, "fresh").action == "fresh"
    c = choose(f, "auto")
    assert c.action == "refuse" and "in no store" in c.reasons[0]


@pytest.mark.parametrize("state", ["exited", "failed", "lost", None])
def test_without_a_suspension_the_job_starts_anew(state: str | None) -> None:
    c = choose(Found(NOW, last_state=state, candidates=(snap("s1", mode="keep-running"),)), "auto")
    assert c.action == "fresh"


def test_resume_latest_after_a_crash_takes_the_newest_verified_snapshot_of_this_command() -> None:
    cands = (snap("k1", "keep-running", 1.0), snap("k2", "keep-running", 2.0), snap("k3", "keep-running", 3.0,
             verified=False), snap("k4", "keep-running", 4.0, nproc_per_node=4))
    c = choose(Found(NOW, last_state="lost", candidates=cands), "latest")
    assert c.action == "restore" and c.snapshot is not None and c.snapshot.id == "k2"
    # a job that ended well is not resumed by --resume latest
    assert choose(Found(NOW, last_state="exited", candidates=cands), "latest").action == "fresh"
    assert choose(Found(NOW, last_state="failed", candidates=()), "latest").action == "fresh"


def test_a_new_machine_reads_the_store_record_and_a_newer_store_record_wins() -> None:
    f = Found(NOW, store_state="suspended", store_snapshot="s1", store_at=5.0, candidates=(snap("s1"),))
    assert choose(f, "auto").action == "restore"
    # here it was suspended, but since then another machine resumed it and it ended there
    f = Found(NOW, last_state="suspended", last_snapshot="s1", last_at=5.0, store_state="ended", store_at=9.0,
              candidates=(snap("s1"),))
    assert choose(f, "auto").action == "fresh"
    # a store record that says running, with no agent here: the crash case
    f = Found(NOW, store_state="running", store_at=9.0, candidates=(snap("k1", "keep-running"),))
    assert choose(f, "auto").action == "fresh"
    assert choose(f, "latest").action == "restore"


def test_store_records_round_trip_and_junk_reads_as_none(tmp_path: Path) -> None:
    resume.write_local_record(tmp_path, StoreRecord("exp", "suspended", "s1"))
    rec = resume.read_local_record(tmp_path, "exp")
    assert rec is not None and (rec.state, rec.snapshot) == ("suspended", "s1")
    assert resume.read_local_record(tmp_path, "other") is None
    for junk in (b"", b"[]", b'{"job": "exp"}', b'{"job": "exp", "state": "x", "snapshot": 3}', b"\xff"):
        assert StoreRecord.parse(junk) is None


def test_a_run_holds_the_job_elsewhere_only_while_its_lease_is_fresh() -> None:
    now = 1000.0
    rec = resume.StoreRecord("j", "running", None, host="a", at=now - 5, run="r1")
    assert resume.live_elsewhere(rec, "r2", now, host="b")
    assert not resume.live_elsewhere(rec, "r1", now, host="b")  # our own run
    assert not resume.live_elsewhere(rec, "r2", now, host="a")  # this machine's run: dead (we hold its lock)
    assert not resume.live_elsewhere(resume.StoreRecord("j", "running", None, host="a", at=now - resume.LEASE_S,
                                                        run="r1"), "r2", now, host="b")  # lapsed
    for state in ("suspended", "ended", "failed"):
        assert not resume.live_elsewhere(resume.StoreRecord("j", state, None, host="a", at=now, run="r1"), "r2",
                                         now, host="b")
    assert not resume.live_elsewhere(None, "r2", now, host="b")

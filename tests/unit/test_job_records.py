"""`cryosleep jobs rm` and `jobs prune`: real job directories (the real JobDir API), real processes holding a job's
lock where an agent is needed, a real process named as the sandbox's init where a sandbox is. Every refusal, and
nothing followed out of the jobs directory. (tests/jobs/test_run_cli.py removes the records of really run jobs.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cryosleep.agent import records
from cryosleep.cli.main import main
from cryosleep.core.job import JobDir, JobSpec, JobState
from cryosleep.errors import Busy, NotEligible, NotFound
from tests.unit.test_job_lock import hold

# An agent starting the job while `jobs rm` holds its lock: it waits (the record says the job's agent is ending),
# then gets the lock of the job's path, in a fresh directory
START = """
import os, sys
from cryosleep.core.job import JobDir
job = JobDir(sys.argv[1], __import__("pathlib").Path(sys.argv[2]))
fd = job.take_lock(wait_ending=60, on_wait=lambda: print("waiting", flush=True))
print("locked", os.fstat(fd).st_ino == os.stat(job.lock_file).st_ino, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def jobs(cryo_home: Path) -> Path:
    d = cryo_home / "jobs"
    d.mkdir()
    return d


def make(jobs: Path, name: str, state: str, *, init_pid: int = 0, agent_pid: int = 0, ended_ago: float | None = 60,
         snapshot: str | None = None, ending: bool = False) -> JobDir:
    """A job's directory as an agent leaves it: its record, a rank's log and an exit file, a control block."""
    job = JobDir(name, jobs)
    spec = JobSpec(name=name, program=["python3", "t.py"], cwd="/", env={}, nproc_per_node=1)
    ended = state in ("exited", "failed", "suspended")
    job.write(spec, JobState(state=state, init_pid=init_pid, agent_pid=agent_pid, last_snapshot=snapshot,
                             ended_at=time.time() - ended_ago if ended and ended_ago is not None else None,
                             ending_since=time.time() if ending else None))
    job.logs.mkdir()
    job.rank_log(0).write_text("0 1.0\n" * 1000)
    (job.logs / "rank-0.exit").write_text("exit 0")
    job.ctl.mkdir()
    job.ctl_path(0).write_bytes(b"\0" * 4096)
    return job


@contextmanager
def agent(job: JobDir) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the job's lock, as its agent does."""
    with hold(job, 600) as p:
        yield p


@contextmanager
def sandbox_init(tmp_path: Path) -> Iterator[int]:
    """A live process that /proc names as a sandbox's init (cryosleep-init), as a lost job's sandbox leaves."""
    exe = tmp_path / "cryosleep-init"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", exe)
    p = subprocess.Popen([str(exe), "600"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


def gone_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["jobs", *argv, "--json"]) == 1
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_rm_removes_ended_jobs_records(jobs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ex, fa = make(jobs, "ex", "exited"), make(jobs, "fa", "failed")
    lost = make(jobs, "lost", "running", init_pid=gone_pid())  # its agent gone (no lock), its sandbox too
    other = make(jobs, "other", "exited")
    assert main(["jobs", "rm", "ex", "fa", "lost", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["job"], r["state"]) for r in out["removed"]] == [("ex", "exited"), ("fa", "failed"), ("lost", "lost")]
    assert all(r["bytes"] >= 6000 for r in out["removed"])  # the log, the control block, the record
    assert not ex.path.exists() and not fa.path.exists() and not lost.path.exists()
    assert other.exists() and sorted(p.name for p in jobs.iterdir()) == ["other"]  # nothing left over
    assert main(["jobs", "--json", "rm", "other"]) == 0  # --json before the subcommand too
    assert json.loads(capsys.readouterr().out)["removed"][0]["job"] == "other"
    assert main(["jobs", "rm", "nothing-here"]) == 1
    assert "no job named 'nothing-here'" in capsys.readouterr().err


def test_jobs_without_a_subcommand_lists_as_before(jobs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make(jobs, "a", "exited")
    assert main(["jobs", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["job"] == "a" and row["state"] == "exited" and row["dir"] == str(jobs / "a") and row["ranks"] == [0]
    assert main(["jobs"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["job", "state", "ranks", "init", "started", "last",
                                                               "snapshot", "detail"]


def test_a_running_job_is_refused(jobs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with sandbox_init(tmp_path) as init:
        job = make(jobs, "exp", "running", init_pid=init, agent_pid=4321)
        with agent(job):
            err = refused(capsys, "rm", "exp")
            assert err["error"] == "busy" and err["what"] == "job 'exp' is running (agent 4321): its record is kept"
            assert "kill 4321" in str(err["hint"]) and "snapshot exp --stop" in str(err["hint"])
    assert job.exists() and job.rank_log(0).exists() and job.ctl_path(0).exists()
    starting = make(jobs, "starting", "starting")  # its agent has not started the sandbox yet
    with agent(starting), pytest.raises(Busy, match="'starting' is running"):
        records.remove(["starting"])
    assert starting.exists()


def test_an_ending_job_is_refused_while_its_agent_holds_the_lock(jobs: Path, capsys: pytest.CaptureFixture[str]
                                                                 ) -> None:
    """After a stop snapshot, or as its job exits, the agent finishes its bookkeeping under the lock."""
    for name, state, kw in (("ending", "running", {"init_pid": gone_pid()}),
                            ("stopping", "running", {"init_pid": os.getpid(), "ending": True}),
                            ("done", "exited", {})):
        job = make(jobs, name, state, agent_pid=77, **kw)  # type: ignore[arg-type]
        with agent(job):
            err = refused(capsys, "rm", name)
            assert err["what"] == f"job {name!r} is still ending (agent 77): its record is kept for now", name
            assert "cryosleep jobs" in str(err["hint"])
        assert job.exists()
        assert main(["jobs", "rm", name]) == 0  # once its agent is gone
        assert f"removed job {name} (" in capsys.readouterr().out and not job.path.exists()


def test_a_suspended_job_is_refused(jobs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = make(jobs, "sus", "suspended", snapshot="sus-20261201-1")
    err = refused(capsys, "rm", "sus")
    assert err["error"] == "not_eligible" and "suspended in snapshot sus-20261201-1" in str(err["what"])
    assert "cryosleep restore sus-20261201-1" in str(err["hint"])
    assert job.exists() and job.rank_log(0).exists()


def test_a_lost_job_whose_sandbox_still_runs_is_refused(jobs: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Its agent SIGKILLed outside a snapshot: the workers train on, writing into the job's directory."""
    with sandbox_init(tmp_path) as init:
        job = make(jobs, "orphan", "running", init_pid=init)
        assert job.read()[1].state == "lost"
        err = refused(capsys, "rm", "orphan")
        assert err["error"] == "busy" and f"init PID {init}" in str(err["what"])
        assert f"kill -9 {init}" in str(err["hint"])
        assert job.exists()
    # a recycled PID of another program is no sandbox
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        make(jobs, "recycled", "running", init_pid=sleeper.pid)
        assert main(["jobs", "rm", "recycled"]) == 0
    finally:
        sleeper.kill()
        sleeper.wait()
    assert main(["jobs", "rm", "orphan"]) == 0  # its sandbox ended


def test_rm_is_all_or_nothing(jobs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make(jobs, "a", "exited"), make(jobs, "b", "failed")
    make(jobs, "s", "suspended", snapshot="s-1")
    err = refused(capsys, "rm", "a", "s", "missing", "b")
    assert err["what"] == "2 of 4 job records cannot be removed; nothing was removed (not a, b either)"
    assert "suspended in snapshot s-1" in str(err["why"]) and "no job named 'missing'" in str(err["why"])
    assert [e["error"] for e in err["details"]["refused"]] == ["not_eligible", "not_found"]  # type: ignore[index]
    assert a.exists() and b.exists()
    assert not a.agent_alive() and not b.agent_alive()  # their locks were let go


def test_nothing_is_followed_out_of_the_jobs_directory(jobs: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    outside = tmp_path / "outside"
    elsewhere = make(outside, "evil", "exited")
    (jobs / "evil").symlink_to(elsewhere.path)  # a job path that is a link
    err = refused(capsys, "rm", "evil")
    assert err["error"] == "not_eligible" and "not a job directory Cryosleep made" in str(err["what"])
    assert (jobs / "evil").is_symlink() and elsewhere.rank_log(0).exists()
    job = make(jobs, "links", "exited")  # links inside a job directory: removed, never followed
    precious = outside / "precious"
    precious.mkdir()
    (precious / "data").write_text("keep")
    (job.logs / "to-dir").symlink_to(precious)
    (job.path / "to-file").symlink_to(precious / "data")
    lock = make(jobs, "lock", "exited")  # a lock file that is a link: not opened through it
    lock.lock_file.symlink_to(precious / "data")
    assert main(["jobs", "rm", "links"]) == 0
    assert "removed job links" in capsys.readouterr().out
    assert not job.path.exists() and (precious / "data").read_text() == "keep"
    err = refused(capsys, "rm", "lock")
    assert "lock of job 'lock' could not be taken" in str(err["what"])
    assert main(["jobs", "prune"]) == 0
    assert "kept job lock" in capsys.readouterr().out
    assert (precious / "data").read_text() == "keep" and elsewhere.rank_log(0).exists()


def test_prune(jobs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = make(jobs, "old", "exited", ended_ago=3 * 86400)
    new = make(jobs, "new", "failed", ended_ago=60)
    lost = make(jobs, "lost", "running", init_pid=gone_pid())
    os.utime(lost.spec_file, (time.time() - 2 * 86400,) * 2)  # lost: its record's last write is when it ended
    sus = make(jobs, "sus", "suspended", snapshot="sus-1", ended_ago=30 * 86400)
    run = make(jobs, "run", "running", init_pid=os.getpid(), agent_pid=os.getpid())
    (jobs / ".removing-x-0000").mkdir()  # what an interrupted removal left
    (jobs / ".removing-x-0000" / "job.json").write_text("{}")
    with agent(run):
        assert main(["jobs", "prune", "--older-than", "1d", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert sorted(r["job"] for r in out["removed"]) == ["lost", "old"]
        assert {k["job"]: k["state"] for k in out["kept"]} == {"new": "failed", "run": "running", "sus": "suspended"}
        assert "less than --older-than" in next(k["why"] for k in out["kept"] if k["job"] == "new")
        assert out["bytes"] == sum(r["bytes"] for r in out["removed"]) > 0
        assert not old.path.exists() and not lost.path.exists() and not (jobs / ".removing-x-0000").exists()
        assert new.exists() and sus.exists() and run.exists()
        assert main(["jobs", "prune"]) == 0
        text = capsys.readouterr().out
        assert "removed job new (failed" in text and "kept job run (running): job 'run' is running" in text
        assert "1 job record(s) removed" in text
    assert sorted(p.name for p in jobs.iterdir()) == ["run", "sus"]
    with pytest.raises(SystemExit) as bad:  # argparse: not an age
        main(["jobs", "prune", "--older-than", "soon"])
    assert bad.value.code == 2 and "not an age: 'soon'" in capsys.readouterr().err


def test_a_job_starting_while_its_record_is_removed_gets_a_fresh_directory(jobs: Path) -> None:
    """`jobs rm` holds the job's lock while it moves the directory away and deletes it; an agent starting the job
    meanwhile waits, then locks the file at the job's path (not the old one, moved away with its directory)."""
    job = make(jobs, "race", "running", init_pid=gone_pid())  # lost: a restore of it waits for an "ending" agent
    claim = records._claim(job)  # what `jobs rm race` holds between its checks and the deletion
    p = subprocess.Popen([sys.executable, "-c", START, "race", str(jobs)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert p.stdout is not None and p.stdout.readline() == "waiting\n"
        removed = records._delete(claim)
        assert removed.state == "lost" and removed.job == "race"
        assert p.stdout.readline() == "locked True\n"
        assert job.path.is_dir() and not job.spec_file.exists()  # a fresh directory: none of the old files
        assert job.agent_alive()  # the starting agent holds the lock at the job's path
        with pytest.raises(NotFound):
            records.remove(["race"])  # no record yet: nothing of the starting agent's is removed
    finally:
        p.kill()
        p.wait()


def test_the_decisions() -> None:
    st = JobState(state="exited", ended_at=100.0)
    assert records.refusal("x", None, st, locked=False, sandbox_alive=False) is None
    assert isinstance(records.refusal("x", None, JobState(state="weird"), locked=False, sandbox_alive=False),
                      NotEligible)
    assert records.prune_why_kept(100.0, 160.0, None) is None
    assert records.prune_why_kept(100.0, 160.0, 60.0) is None
    assert records.prune_why_kept(100.0, 159.0, 60.0) == "ended 59 s ago, less than --older-than (60 s)"

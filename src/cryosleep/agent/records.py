"""Removing the records of jobs that have ended (`cryosleep jobs rm`, `cryosleep jobs prune`).

A job's directory (core/job.py) holds its record, its logs, its NCCL control blocks and a restore's work files;
none of its snapshots, which live in the stores and are never touched here. Only an ended job's directory goes:
exited, failed, or lost (its agent gone, and its sandbox with it). The others are refused, each with what to do:

- running (or starting): its agent writes its state, logs and control blocks there;
- still ending: its agent holds the job's lock while it finishes (the processes exiting, uploads, bookkeeping);
- suspended: the state says the job comes back (`cryosleep restore` of the stop snapshot, under the same name);
- lost, but its sandbox still runs (an agent SIGKILLed outside a snapshot leaves its workers training): they
  still write into the directory.

Safe against a job of the same name starting at that moment: the job's lock is taken (never waited for) as
`run` and `restore` take it, the record is judged under it, and the directory is renamed out of the job's path
before anything is deleted, so an agent starting meanwhile gets a fresh directory (``JobDir.take_lock`` only
keeps the lock of the file at the job's path). Nothing is followed out of the jobs directory: a job path that
is a symbolic link is refused, the lock file is opened without following one, and the tree is deleted by
shutil.rmtree's descriptor-based walk, which removes links without following them. One gap: a detached `run` or
`restore` opens its agent.log before it takes the lock, so one started in the very moment of the removal of its
name's record runs unharmed in a fresh directory but logs into the removed one's agent.log.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from cryosleep import paths
from cryosleep.core import proctree
from cryosleep.core.job import NAME_RE, JobDir, JobSpec, JobState
from cryosleep.errors import Busy, CryosleepError, NotEligible

ENDED = ("exited", "failed", "lost")
TRASH_PREFIX = ".removing-"  # a directory being deleted: not a job name (NAME_RE), so never listed as a job
INIT_COMM = "cryosleep-init"  # the sandbox's init (native/init), as /proc/PID/comm names it


@dataclass(frozen=True)
class Removed:
    """A job record that was removed."""

    job: str
    state: str  # exited | failed | lost
    ended_at: float | None  # when it ended (lost: when its record was last written)
    bytes: int  # what its directory held
    path: str

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Kept:
    """A job record that `prune` left, and why."""

    job: str
    state: str
    why: str

    def to_json(self) -> dict[str, object]:
        return asdict(self)


# -- the decisions (pure) -----------------------------------------------------------------------------------


def refusal(name: str, spec: JobSpec | None, st: JobState | None, *, locked: bool,
            sandbox_alive: bool) -> CryosleepError | None:
    """Why job ``name``'s record must stay (None: it may go). ``st``: its recorded state (None: unreadable);
    ``locked``: another process (its agent) holds the job's lock; ``sandbox_alive``: its sandbox's init still
    runs."""
    state = st.state if st is not None else "unknown"
    if st is not None and state == "suspended":
        snap = st.last_snapshot or "its stop snapshot"
        how = (f"`cryosleep restore {snap}`" if spec is None or spec.nnodes == 1 else
               "`cryosleep restore SNAPSHOT --nodes ...` (or `--node-rank I` on each host) with its coordinator's "
               "snapshot")
        return NotEligible(f"job {name!r} is suspended in snapshot {snap}: its record is kept",
                           "a suspended job is one that comes back: a stop snapshot holds it, to be restored here "
                           "under its name", f"bring it back with {how}; once it has ended (exited or failed), "
                           f"`cryosleep jobs rm {name}` removes its record (its snapshots stay in the store)",
                           job=name, state=state)
    if locked:
        pid = st.agent_pid if st is not None else 0
        agent = f" (agent {pid})" if pid else ""
        if st is not None and state in ("starting", "running") and st.ending_since is None and (
                st.init_pid <= 0 or sandbox_alive):
            return Busy(f"job {name!r} is running{agent}: its record is kept",
                        "a running job's directory is its agent's: it writes the job's state, logs and NCCL control "
                        "blocks there", f"end the job first (`kill {pid or 'AGENT'}` sends its agent SIGTERM, which "
                        f"ends it), then remove it; `cryosleep snapshot {name} --stop` would suspend it instead, "
                        "and a suspended job's record is kept", job=name, state=state)
        return Busy(f"job {name!r} is still ending{agent}: its record is kept for now",
                    "its agent holds the job's lock while it finishes (the job's processes exiting, uploads of its "
                    "snapshots, its bookkeeping)",
                    "wait until `cryosleep jobs` shows it exited or failed, then remove it", job=name, state=state)
    if st is None:
        return None  # nobody holds it and nothing readable says it is anyone's: the caller says what it is
    if state in ("starting", "running", "lost") and sandbox_alive:
        return Busy(f"job {name!r} has lost its agent but its sandbox still runs (init PID {st.init_pid}): its "
                    "record is kept", "its workers still write their logs and NCCL control blocks in its directory",
                    f"end the sandbox first (`kill -9 {st.init_pid}` ends every process in it), then remove it",
                    job=name, state="lost")
    if state not in (*ENDED, "starting", "running"):
        return NotEligible(f"job {name!r} is in a state this version does not know ({state!r}): its record is kept",
                           "a newer Cryosleep may have written it", "remove it with the Cryosleep that ran the job",
                           job=name, state=state)
    return None


def prune_why_kept(ended_at: float, now: float, older_than: float | None) -> str | None:
    """Why an ended job is not pruned yet (None: it is); ``older_than`` in seconds, None: any age."""
    if older_than is not None and now - ended_at < older_than:
        return f"ended {max(now - ended_at, 0):.0f} s ago, less than --older-than ({older_than:g} s)"
    return None


# -- the mechanism --------------------------------------------------------------------------------------------


@dataclass
class _Claim:
    """An ended job's record under its lock, ready to go."""

    job: JobDir
    fd: int
    state: JobState

    @property
    def ended_at(self) -> float:
        if self.state.ended_at is not None:
            return self.state.ended_at
        try:  # lost: its agent last wrote the record about when it was lost
            return self.job.spec_file.stat().st_mtime
        except OSError:
            return self.state.started_at


def sandbox_alive(init_pid: int) -> bool:
    """Whether the sandbox whose init had PID ``init_pid`` still runs (a recycled PID of another program is not)."""
    if init_pid <= 0 or not proctree.alive(init_pid):
        return False
    try:
        return Path(f"/proc/{init_pid}/comm").read_text().strip() == INIT_COMM
    except OSError:
        return False


def _claim(job: JobDir) -> _Claim:
    """Take the job's lock and check its record may go; raise the refusal otherwise (nothing held then)."""
    if job.path.is_symlink() or (job.path.exists() and not job.path.is_dir()):
        raise NotEligible(f"{job.path} is not a job directory Cryosleep made: it was not removed",
                          "it is a symbolic link or a file; `jobs rm` never follows anything out of the jobs "
                          "directory", f"look at what it is, and remove it by hand if it is no job's ({job.path})",
                          job=job.name)
    if not job.spec_file.exists():
        job.record()  # NotFound, with the right words
    try:
        fd = job.try_lock()
    except OSError as e:
        raise NotEligible(f"the lock of job {job.name!r} could not be taken: its record was not removed", str(e),
                          f"{job.lock_file} should be a plain file; look at it, and remove {job.path} by hand if it "
                          "is no job's", job=job.name) from None
    spec: JobSpec | None
    st: JobState | None
    try:
        spec, st = job.record()
    except (CryosleepError, OSError, ValueError, KeyError, TypeError):
        spec, st = None, None
    if fd is None:  # its agent is alive, and so is the PID it recorded as long as its sandbox runs
        err = refusal(job.name, spec, st, locked=True, sandbox_alive=st is not None and proctree.alive(st.init_pid))
        assert err is not None
        raise err
    try:
        if st is None:
            raise NotEligible(f"the record of job {job.name!r} cannot be read: it was not removed",
                              f"{job.spec_file} is not a record this version of Cryosleep wrote",
                              f"look at it, and remove {job.path} by hand if it is no job's", job=job.name)
        err = refusal(job.name, spec, st, locked=False, sandbox_alive=sandbox_alive(st.init_pid))
        if err is not None:
            raise err
        if st.state in ("starting", "running"):  # we hold its lock: its agent is gone
            st.state = "lost"
        return _Claim(job, fd, st)
    except BaseException:
        os.close(fd)
        raise


def _size(path: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(path):  # never follows links
        for f in (*files, *dirs):
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                continue
    return total


def _gone_is_fine(func: object, path: str, exc: tuple[type[BaseException], BaseException, object]) -> None:
    """rmtree's error handler: what is already gone (a concurrent prune took it) is no failure."""
    if not isinstance(exc[1], FileNotFoundError):
        raise exc[1]


def _delete(c: _Claim) -> Removed:
    """Move the directory off the job's path (a job starting now gets a fresh one), then delete it; its lock is
    let go last. The fast path's staging files of a lost job (on /dev/shm, named after its directory) go too."""
    job = c.job
    try:
        size = _size(job.path)
        devmem = job.devmem
        trash = job.path.with_name(f"{TRASH_PREFIX}{job.name}-{secrets.token_hex(4)}")
        os.rename(job.path, trash)
        try:
            shutil.rmtree(trash, onerror=_gone_is_fine)
        except OSError as e:
            raise CryosleepError(f"the record of job {job.name!r} was only partly removed", str(e),
                                 f"remove what is left by hand ({trash}); `cryosleep jobs prune` also does",
                                 job=job.name) from None
        if devmem.is_dir() and not devmem.is_symlink():
            shutil.rmtree(devmem, ignore_errors=True)
    finally:
        os.close(c.fd)
    return Removed(job.name, c.state.state, c.ended_at, size, str(job.path))


def remove(names: Iterable[str], root: Path | None = None) -> list[Removed]:
    """Remove these jobs' records, all or none: every refusal is raised (one error, each listed) before any
    record is touched."""
    base = root or paths.jobs_dir()
    claims: list[_Claim] = []
    refused: list[CryosleepError] = []
    try:
        for name in dict.fromkeys(names):
            try:
                claims.append(_claim(JobDir(name, base)))
            except CryosleepError as e:
                refused.append(e)
        if refused:
            raise _all_refused(refused, [c.job.name for c in claims])
        out = []
        while claims:
            out.append(_delete(claims.pop(0)))
        return out
    finally:
        for c in claims:
            os.close(c.fd)


def _all_refused(refused: list[CryosleepError], others: list[str]) -> CryosleepError:
    if len(refused) == 1 and not others:
        return refused[0]
    nothing = f"; nothing was removed (not {', '.join(others)} either)" if others else "; nothing was removed"
    return type(refused[0])(
        f"{len(refused)} of {len(refused) + len(others)} job records cannot be removed{nothing}",
        "; ".join(f"{e.what} ({e.why})" for e in refused),
        " ".join(dict.fromkeys(e.hint for e in refused)) + (" Or name only the others." if others else ""),
        refused=[e.to_json() for e in refused])


def _entries(base: Path) -> Iterator[Path]:
    try:
        yield from sorted(base.iterdir())
    except FileNotFoundError:
        return


def prune(older_than: float | None = None, root: Path | None = None,
          now: float | None = None) -> tuple[list[Removed], list[Kept]]:
    """Remove every ended job's record (that ended at least ``older_than`` seconds ago), and what an interrupted
    removal left; the others are kept, each with why."""
    base = root or paths.jobs_dir()
    now = time.time() if now is None else now
    removed: list[Removed] = []
    kept: list[Kept] = []
    for d in _entries(base):
        if d.name.startswith(TRASH_PREFIX) and d.is_dir() and not d.is_symlink():  # an interrupted removal's
            shutil.rmtree(d, ignore_errors=True)
            continue
        if not NAME_RE.match(d.name) or not (d / "job.json").exists():
            continue  # not a job record (`cryosleep jobs` does not list it either)
        try:
            c = _claim(JobDir(d.name, base))
        except CryosleepError as e:
            kept.append(Kept(d.name, str(e.details.get("state", "unknown")), e.what))
            continue
        why = prune_why_kept(c.ended_at, now, older_than)
        if why is not None:
            os.close(c.fd)
            kept.append(Kept(d.name, c.state.state, why))
            continue
        removed.append(_delete(c))
    return removed, kept

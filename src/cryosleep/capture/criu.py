"""Calling CRIU: dump a sandbox's process tree, restore it, and undo what a failed dump leaves behind.

One sandbox (a PID namespace whose init is ``cryosleep-init``) is one CRIU tree. Dumps always use
``--tcp-established`` with the nftables network lock (docs/facts.md: the iptables lock does not work here) and
either ``--leave-running`` (keep-running snapshots) or ``--leave-stopped`` (stop snapshots: the job is held
still until its image is verified, then killed, or resumed if anything failed).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryosleep import paths
from cryosleep.capture import criu_stats
from cryosleep.capture.criu_install import Criu
from cryosleep.core import oom, proctree
from cryosleep.errors import CaptureFailed, NetError, RestoreFailed
from cryosleep.net import host as net_host

# CRIU's log level in a dump and a pre-dump: info (3), not debug (4). At debug CRIU writes lines per VMA and page
# buffer while the job is frozen (megabytes of log): a quarter of a write-tracked dump's freeze at 1 GiB (median 72
# ms at debug, 54 at info: docs/benchmarks.md). Errors, the run id (the network lock's name) are at info.
DUMP_VERBOSITY = "-v3"
RUN_ID_RE = re.compile(r"CRIU run id = ([0-9a-f-]+)")
PR_SET_PDEATHSIG = 1
# CRIU prints this on every run here; it is harmless (docs/facts.md).
NOISE = ("Can't setup RLIMIT_NOFILE",)
GHOST_LIMIT = 64 * 1024 * 1024
# After its action script is ended, CRIU rolls back by itself within this time, or is killed.
ROLLBACK_GRACE_S = 15.0
TCP_REPAIR = 19


@dataclass
class DumpResult:
    seconds: float
    run_id: str | None
    log: Path
    criu_s: float = 0.0  # of ``seconds``, the CRIU process's own run (its start to its exit)
    held_s: float = 0.0  # the job's tasks held: from their SIGSTOP to their SIGCONT (a stop dump: to CRIU's exit)
    stopping_s: float = 0.0  # of that, until every task had stopped (before CRIU started)


def log_tail(log: Path, lines: int = 12) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no CRIU log)"
    errors = [ln for ln in text if ("Error" in ln or "error" in ln) and not any(n in ln for n in NOISE)]
    pick = errors[-lines:] if errors else text[-lines:]
    return "\n".join(pick)


def keep_log(log: Path) -> Path:
    """Copy a failed run's CRIU log out of the staging directory (which the rollback deletes)."""
    dest = paths.home() / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{log.name}"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(log.read_bytes())
    except OSError:
        return log
    return dest


def run_id(log: Path) -> str | None:
    try:
        with open(log, errors="replace") as f:
            for _, line in zip(range(50), f, strict=False):
                m = RUN_ID_RE.search(line)
                if m:
                    return m.group(1)
    except OSError:
        return None
    return None


def unlock_network(criu: Criu, rid: str | None, root_pid: int | None = None) -> None:
    """Delete the nftables table a dump left behind (after a killed or a leave-stopped dump). CRIU locks the
    network of the namespace the tree lives in: a sandbox on the job network (its own namespace) is unlocked
    there, through ``root_pid``."""
    if not rid or not criu.nft_argv:
        return
    prefix: list[str] = []
    if root_pid is not None:
        other = proctree.other_ns(root_pid)
        if other is None:
            return  # the tree is gone, and its namespace with its lock
        prefix = proctree.nsenter_net(root_pid) if other else []
    out = subprocess.run([*prefix, *criu.nft_argv, "list", "tables"], capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        parts = line.split()
        ours = len(parts) == 3 and parts[0] == "table" and parts[2].startswith("CRIU-")
        if ours and rid.startswith(parts[2][len("CRIU-"):]):  # CRIU cuts its run id to fit a table name
            subprocess.run([*prefix, *criu.nft_argv, "delete", "table", parts[1], parts[2]],
                           capture_output=True, check=False)


def action_script(name: str, text: str) -> str:
    """An executable script for CRIU's --action-script (CRIU execs the path as is), in $CRYOSLEEP_HOME/bin,
    rewritten atomically only when its text changed; returns its path."""
    script = paths.home() / "bin" / f"{name}-{os.getuid()}"
    if not script.exists() or script.read_text() != text:
        script.parent.mkdir(parents=True, exist_ok=True)
        tmp = script.with_suffix(f".{os.getpid()}")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, script)
    return str(script)


# CRIU runs its action script at every stage of a dump, the job frozen (stopped) for most of them; only post-dump
# has work (capture.hook). A Python started there costs ~0.25 s of imports inside the freeze (measured here), so the
# hook is started with the dump, before the freeze (``start_hook``), and the script hands it the stage through a
# FIFO pair (HOOK_FIFO.in, HOOK_FIFO.out) and exits with its verdict. Without the FIFO, the script runs the hook
# itself, as before.
HOOK_SCRIPT = """#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0
if [ -n "$CRYOSLEEP_HOOK_FIFO" ]; then
    echo go > "$CRYOSLEEP_HOOK_FIFO.in" || exit 1
    read -r rc < "$CRYOSLEEP_HOOK_FIFO.out" || exit 1
    exit "$rc"
fi
exec {python} -m cryosleep.capture.hook "$@"
"""


def hook_command(root_pid: int, stage_dir: Path) -> tuple[str, dict[str, str]]:
    """CRIU's --action-script (an executable path: CRIU execs it as is) and the environment it reads."""
    script = action_script("criu-hook", HOOK_SCRIPT.format(python=shlex.quote(sys.executable)))
    env = {
        "CRYOSLEEP_HOOK_ROOT_PID": str(root_pid),
        "CRYOSLEEP_HOOK_STAGE_DIR": str(stage_dir),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    return str(script), env


def start_hook(env: dict[str, str], timeout: float) -> tuple[subprocess.Popen[bytes], Path] | None:
    """The post-dump hook started now (its imports done before CRIU freezes the job), waiting on a FIFO pair in
    a directory of its own (never the node's: the image's checksum would open them); it serves one post-dump
    within ``timeout`` and exits. Sets ``CRYOSLEEP_HOOK_FIFO`` in ``env`` for the action script. None when it
    cannot be started: the script then runs the hook itself."""
    for stale in Path(tempfile.gettempdir()).glob("cryosleep-hook-*-*"):  # an agent that died mid-dump left them
        owner = stale.name.split("-")[2]
        if owner.isdigit() and not proctree.alive(int(owner)):
            shutil.rmtree(stale, ignore_errors=True)
    fifo_dir = Path(tempfile.mkdtemp(prefix=f"cryosleep-hook-{os.getpid()}-"))
    fifo = fifo_dir / "hook"
    try:
        os.mkfifo(f"{fifo}.in", 0o600)
        os.mkfifo(f"{fifo}.out", 0o600)
        argv = [sys.executable, "-m", "cryosleep.capture.hook", "--serve", str(fifo), f"{timeout:.3f}"]
        # out of the OOM killer's reach like CRIU (it ran as CRIU's child before), and it dies with the agent: a
        # dead agent's dump is ended by its watchdog, the job with it
        proc = subprocess.Popen(protected(argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
    except OSError:
        shutil.rmtree(fifo_dir, ignore_errors=True)
        return None
    env["CRYOSLEEP_HOOK_FIFO"] = str(fifo)
    return proc, fifo_dir


def stop_hook(hook: tuple[subprocess.Popen[bytes], Path] | None) -> None:
    """The hook process ended (it has served, or never will) and its FIFOs removed."""
    if hook is None:
        return
    proc, fifo_dir = hook
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()
    shutil.rmtree(fifo_dir, ignore_errors=True)


def external_mounts(pid: int) -> list[str]:
    """Mountpoints of the sandbox's mount namespace that CRIU should take from the host as they are.

    The sandbox is a copy of the host's mounts plus its own /proc (see cryosleep-init --mount-ns). Every
    mount but / and /proc is declared external: CRIU records it by path and bind-mounts the host's at
    restore, instead of dumping (say) the whole of /dev/shm or recreating /sys.
    """
    out: list[str] = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        mountpoint = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if mountpoint not in ("/", "/proc") and mountpoint not in out:
            out.append(mountpoint)
    return out


def _external_args(mounts: list[str]) -> list[str]:
    args: list[str] = []
    for m in mounts:
        args += ["--external", f"mnt[{m}]:{m}"]
    return args


def veth_externals(root_pid: int) -> list[str]:
    """``--external veth[IFNAME]:HOST_END`` for each veth of a sandbox with its own network namespace (the
    job network, docs/network.md): CRIU dumps the namespace, and records the pair's host end as external."""
    try:
        veths = net_host.Host().sandbox_veths(root_pid)
    except NetError as e:
        raise CaptureFailed("the sandbox's network interfaces could not be read", f"{e.what}: {e.why}",
                            e.hint) from None
    lost = [inside for inside, end in veths if end is None]
    if lost:
        raise CaptureFailed(f"the sandbox's interface {lost[0]} has no host end in this network namespace",
                            "CRIU can only dump a veth whose peer it can name",
                            "take the snapshot from the agent's own host network namespace")
    args: list[str] = []
    for inside, end in veths:
        args += ["--external", f"veth[{inside}]:{end}"]
    return args


def dump(criu: Criu, root_pid: int, node_dir: Path, *, leave: str, timeout: float,
         extra_env: dict[str, str] | None = None, mounts: list[str] | None = None,
         on_start: Callable[[int], None] | None = None, parent: str | None = None) -> DumpResult:
    """Dump the tree of ``root_pid`` into ``node_dir/criu``; stage its files into ``node_dir/files``. ``parent``:
    the pre-dump's images (relative to ``node_dir/criu``): only the pages written since are dumped (criu-uffd's
    ``--track-mem``, capture/precopy.py).

    On failure or timeout every task is left running (CRIU rolls back, or after a kill we remove the network
    lock and repair mode; then the stopped tasks are continued) and CaptureFailed is raised with CRIU's own
    words. A stop dump leaves the tasks stopped.
    """
    assert leave in ("running", "stopped")
    images = node_dir / "criu"
    images.mkdir(parents=True, exist_ok=True)
    log = node_dir / "dump.log"
    script, env = hook_command(root_pid, node_dir / "files")
    env["CRYOSLEEP_HOOK_ERR"] = str(node_dir / "hook.err")
    env["CRYOSLEEP_HOOK_TIMES"] = str(node_dir / criu_stats.HOOK_TIMES)
    cmd = criu.command(
        "dump", "-t", str(root_pid), "-D", str(images), "-W", str(node_dir), "-o", "dump.log", DUMP_VERBOSITY,
        "--tcp-established", "--network-lock", "nftables", "--file-locks",
        # Deleted files held open (PyTorch shares DataLoader batches through unlinked /dev/shm files) are
        # copied into the image as CRIU "ghost" files, up to this size each.
        "--ghost-limit", str(GHOST_LIMIT),
        "--leave-running" if leave == "running" else "--leave-stopped",
        "--action-script", script, *_external_args(mounts or []), *veth_externals(root_pid),
        *(["--track-mem", "--prev-images-dir", parent] if parent else []),
    )
    full_env = criu.env(dict(os.environ, **env, **(extra_env or {})))
    tree = proctree.tree(root_pid)  # CRIU freezes this tree: if CRIU dies, these are what to stop at once
    start = time.monotonic()
    # Every task is stopped (SIGSTOP) before CRIU seizes it: a task that was in a group stop when its tracer
    # attached goes back to it when the tracer detaches or dies. So a CRIU killed at any moment leaves the job
    # stopped, never running under its network lock with its sockets in TCP repair mode (a rank resumed inside
    # a read failed at once with EPERM); the tasks are continued here once the lock and repair mode are undone,
    # or once a keep-running dump succeeded. (The images record the tasks as stopped: restore() continues them.)
    if killed := [p for p in tree if proctree.killed_by(p)]:  # a worker killed, not yet reaped: a failing job
        raise CaptureFailed(
            f"processes of the job ({', '.join(map(str, killed))}) were killed and not yet reaped",
            "the job is failing (a rank or a DataLoader worker was ended by a signal): an image of it would "
            "restore a job that fails at once",
            "the job's last verified snapshot is still valid (`cryosleep ls`)")
    alive = [p for p in tree if proctree.state(p) not in ("Z", "X", "gone")]
    watch = proctree.Watch(alive)  # how those that end do: one that exits 0 before it is stopped is churn
    hook = start_hook(full_env, timeout)  # before the freeze: its imports are not the job's pause
    held = time.monotonic()
    stop_tasks(tree)
    stopping_s = time.monotonic() - held
    try:
        # CRIU's output goes to a file, never a pipe: a helper CRIU forked and left stopped would hold a pipe
        # open (and the wait with it) long after CRIU is gone; the wait is on CRIU's exit (a pidfd) instead.
        with open(node_dir / "criu.out", "wb") as out:
            started = time.monotonic()
            proc = subprocess.Popen(protected(cmd), env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    except BaseException:
        continue_tasks(proctree.tree(root_pid) or tree)
        watch.close()
        stop_hook(hook)
        raise
    if on_start is not None:
        on_start(proc.pid)
    try:
        if not wait_exit(proc, timeout):
            gentle = (extra_env or {}).get("CRYOSLEEP_FAULT") != "capture-hang-kill"
            how = _stop_dump(criu, proc, root_pid, log, gentle=gentle)
            kept = keep_log(log)
            raise CaptureFailed(
                f"CRIU did not finish the dump within {timeout:g} s",
                f"the dump was abandoned ({how}); every process of the job was released and goes on running",
                "retry with a longer --timeout; see the CRIU log " + str(kept),
                log=str(kept),
            )
        criu_s = time.monotonic() - started
        elapsed = time.monotonic() - start
        rid = run_id(log)
        if proc.returncode < 0:  # killed (the OOM killer, an operator): no rollback of its own ran
            raise _killed(criu, proc.returncode, root_pid, tree, rid, log)
        if proc.returncode != 0:  # CRIU failed and rolled back by itself (network unlocked, tasks resumed)
            release(criu, root_pid, rid)
            hook_err = node_dir / "hook.err"
            ours = hook_err.read_text().splitlines() if hook_err.exists() else []
            kept = keep_log(log)
            raise CaptureFailed(
                f"CRIU could not dump the job (exit code {proc.returncode})",
                "\n".join([*ours, log_tail(log)]) or (node_dir / "criu.out").read_text(errors="replace")[-2000:],
                f"the job was resumed and goes on running; `cryosleep check --job NAME` lists what blocks a dump; "
                f"CRIU's log: {kept}",
                log=str(kept),
            )
        # A task can only end while it is held (stopped, then seized) by a SIGKILL from outside (an operator,
        # the OOM killer): the image would hold a job with a process gone (a DataLoader worker dead, say), which
        # restores into a job that fails at once. Such an image is no snapshot of the job.
        # (A descendant that exited 0 did so before its SIGSTOP landed, as a short-lived helper does: the job's own
        # churn, which failed the many-snapshots test's --churn job once.)
        died = sorted(p for p, st in watch.ended().items() if st != 0)
        if died:
            release(criu, root_pid, rid)  # a stop dump's lock too: the job goes on (or ends) unlocked
            raise CaptureFailed(
                f"processes of the job ({', '.join(map(str, died))}) were killed while CRIU dumped it",
                "something outside Cryosleep ended them while the job was held; the image would restore a job "
                "without them, so it was discarded",
                "the job's last verified snapshot is still valid (`cryosleep ls`)")
    except BaseException:
        continue_tasks(proctree.tree(root_pid) or tree)  # after the rollback above: the lock and repair are gone
        stop_hook(hook)
        raise
    finally:
        watch.close()
        end_group(proc.pid)
    if leave == "running":
        continue_tasks(proctree.tree(root_pid) or tree)
    held_s = time.monotonic() - held
    # Only now, the job running again, and in the background: the hook process's end took 0.3-2.5 s here under
    # load (8 ranks, load 6), all of it inside the pause while it came before the tasks were continued.
    threading.Thread(target=stop_hook, args=(hook,), name="criu-hook-end", daemon=True).start()
    return DumpResult(elapsed, rid, log, criu_s, held_s, stopping_s)


def protected(cmd: list[str]) -> list[str]:
    """``cmd`` run out of the OOM killer's reach (the lowest oom_score_adj granted, inherited by what CRIU forks:
    ``core.oom``): a CRIU killed mid-dump or mid-restore is the one failure a snapshot cannot always undo
    (docs/reliability.md). CRIU runs from the agent, so the job's own rlimits never apply to it."""
    return ["/bin/sh", "-c", oom.SHELL, "criu", *cmd]


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait for CRIU itself to exit (not for its output to end); True when it did (and was reaped)."""
    fd = os.pidfd_open(proc.pid)
    try:
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        if not poll.poll(max(0.0, timeout) * 1000):
            return False
    finally:
        os.close(fd)
    proc.wait()
    return True


def end_group(pgid: int) -> None:
    """End every process CRIU forked (its process group: CRIU leads its own session), stopped ones included:
    a kerndat probe or the action script left behind by a killed CRIU would otherwise live on, stopped."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    # what CRIU forked was re-parented to this process (the agent is a subreaper): reap it, or it stays a zombie
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        try:
            if os.waitpid(-pgid, os.WNOHANG) == (0, 0):
                time.sleep(0.01)
        except ChildProcessError:
            return


def _killed(criu: Criu, code: int, root_pid: int, tree: list[int], rid: str | None, log: Path) -> CaptureFailed:
    """CRIU was killed during the dump: the kernel resumed the tasks it held, maybe with the network still
    locked and their sockets in TCP repair mode. Stop them first, undo both, then continue them; then say what
    became of the job (a task resumed inside a read on a socket in repair mode fails at once)."""
    stop_tasks(proctree.tree(root_pid) or tree)
    release(criu, root_pid, rid, repair=True)
    time.sleep(0.5)  # a task that met the repair mode before it was stopped exits now
    ended = [p for p in tree if proctree.state(p) in ("Z", "X", "gone")]
    sig = signal.Signals(-code).name if -code in set(signal.Signals) else str(-code)
    kept = keep_log(log)
    if ended:
        return CaptureFailed(
            f"CRIU was killed ({sig}) during the dump, and the job's process(es) {', '.join(map(str, ended))} "
            "exited",
            "something outside Cryosleep (the OOM killer, an operator) ended CRIU while it held the job; its "
            "network lock and TCP repair mode were undone, but the tasks had already met them",
            "restore the job's last verified snapshot (`cryosleep ls`); CRIU's log: " + str(kept), log=str(kept))
    return CaptureFailed(
        f"CRIU was killed ({sig}) during the dump",
        "something outside Cryosleep (the OOM killer, an operator) ended CRIU while it held the job; its network "
        "lock and TCP repair mode were undone and every process of the job was released: it goes on running",
        "take the snapshot again; CRIU's log: " + str(kept), log=str(kept))


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_tasks(pids: list[int]) -> None:
    """Queue a SIGSTOP to each task and wait (up to 2 s) until they have all stopped or gone."""
    _signal(pids, signal.SIGSTOP)
    end = time.monotonic() + 2.0
    while time.monotonic() < end and any(proctree.state(p) not in ("T", "t", "gone", "Z") for p in pids):
        time.sleep(0.01)


def continue_tasks(pids: list[int]) -> None:
    """SIGCONT each task (a no-op for a running one)."""
    _signal(pids, signal.SIGCONT)


def _stop_dump(criu: Criu, proc: subprocess.Popen[bytes], root_pid: int, log: Path, gentle: bool = True) -> str:
    """Abandon a dump that ran past its deadline, leaving the job as it was.

    First the gentle way: end CRIU's action script (our hook), so that CRIU itself rolls back (network
    unlocked, sockets out of repair mode, tasks resumed). Only if CRIU does not exit then is it killed, and
    its leftovers are undone here: network lock, TCP repair mode, stopped tasks. (``gentle=False`` skips
    the first step: fault injection uses it to exercise the second.)
    """
    if gentle:
        for child in proctree.tree(proc.pid)[1:]:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if wait_exit(proc, ROLLBACK_GRACE_S):
            return "CRIU rolled back"
    # The kernel resumes the tasks the moment their tracer dies, with the network still locked (a send
    # would fail with EPERM and break the job): queue a SIGSTOP first, so they stop until we are done.
    tree = proctree.tree(root_pid)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    end_group(proc.pid)
    proc.wait()
    stop_tasks(tree)
    release(criu, root_pid, run_id(log), repair=True)
    return "CRIU was killed and its leftovers undone"


def repair_off(root_pid: int) -> int:
    """Take every TCP socket of the tree out of repair mode (what a killed CRIU leaves); return how many."""
    fixed = 0
    for pid in proctree.tree(root_pid):
        for f in proctree.open_files(pid):
            if not f.target.startswith("socket:"):
                continue
            try:
                fd = proctree.pidfd_getfd(pid, f.fd)
            except OSError:
                continue
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                os.close(fd)
                continue
            try:
                tcp = sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6)
                if tcp and sock.getsockopt(socket.IPPROTO_TCP, TCP_REPAIR):
                    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 0)
                    fixed += 1
            except OSError:
                pass
            finally:
                sock.close()
    return fixed


def release(criu: Criu, root_pid: int, rid: str | None, repair: bool = False) -> None:
    """Undo what a failed or held dump leaves: the network lock, TCP repair mode, stopped tasks."""
    unlock_network(criu, rid, root_pid)
    if repair:
        repair_off(root_pid)
    continue_tasks(proctree.tree(root_pid))


def _die_with_parent() -> None:
    """In CRIU's child before exec: SIGKILL when the agent dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _end_orphans(before: set[int]) -> None:
    """End what a failed restore left: a tree CRIU had begun to restore comes to this process (a subreaper)
    when CRIU dies; killing its root (the sandbox's init) ends its PID namespace."""
    for pid in set(proctree.children(os.getpid())) - before:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def restore(criu: Criu, images: Path, work_dir: Path, *, timeout: float, mounts: list[str] | None = None,
            veths: list[tuple[str, str, str]] | None = None,
            actions: Sequence[tuple[str, dict[str, str]]] = ()) -> int:
    """Restore a sandbox detached (it is re-parented to the calling subreaper); return its init's PID.

    ``veths``: (name inside, new host end, bridge) for a sandbox with its own network namespace: CRIU
    recreates each pair with the new host end as a port of the bridge (the caller removes it on failure).
    ``actions``: ``--action-script``s and the environments they read (CRIU runs each at every stage, in order:
    capture.imagecheck's post-restore gate, capture.outbound's pre-resume reset)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    pidfile = work_dir / "restore.pid"
    pidfile.unlink(missing_ok=True)
    log = work_dir / "restore.log"
    cmd = criu.command(
        "restore", "-D", str(images), "-W", str(work_dir), "-o", "restore.log", "-v4",
        "--tcp-established", "--file-locks", "--restore-detached", "--pidfile", str(pidfile),
        *(["--root", "/", *_external_args(mounts)] if mounts else []),
        *[a for inside, end, bridge in (veths or []) for a in ("--external", f"veth[{inside}]:{end}@{bridge}")],
        *[a for script, _ in actions for a in ("--action-script", script)],
    )
    extra = {k: v for _, e in actions for k, v in e.items()}
    env = criu.env(dict(os.environ, **extra)) if extra else criu.env()
    before = set(proctree.children(os.getpid()))
    # As for a dump: output to a file and the wait on CRIU's exit, never on a pipe a helper it forked may hold.
    # CRIU dies with the agent (the parent death signal): a restore nobody will supervise does not finish.
    with open(work_dir / "criu.out", "wb") as out:
        proc = subprocess.Popen(protected(cmd), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        if not wait_exit(proc, timeout):
            raise RestoreFailed(
                f"CRIU did not finish the restore within {timeout:g} s",
                "the restore was killed, and what it had restored ended; the snapshot is untouched",
                f"see the CRIU log {log}; restore again",
            )
        if proc.returncode < 0:
            code = -proc.returncode
            sig = signal.Signals(code).name if code in set(signal.Signals) else str(code)
            raise RestoreFailed(
                f"CRIU was killed ({sig}) during the restore",
                "something outside Cryosleep (the OOM killer, an operator) ended CRIU; what it had restored "
                "was ended, the snapshot is untouched",
                f"restore again; CRIU's log: {log}", log=str(log))
        if proc.returncode != 0:
            raise RestoreFailed(
                f"CRIU could not restore the job (exit code {proc.returncode})",
                log_tail(log) or (work_dir / "criu.out").read_text(errors="replace")[-2000:],
                f"see the CRIU log {log}; `cryosleep check` shows whether this machine can restore",
                log=str(log),
            )
    except RestoreFailed:
        end_group(proc.pid)
        proc.wait()
        _end_orphans(before)
        raise
    init_pid = int(pidfile.read_text().strip())
    continue_tasks(proctree.tree(init_pid))  # dumped stopped (see dump()), CRIU restores them stopped
    return init_pid

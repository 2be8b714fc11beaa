"""The Linux capabilities each role needs, and which of them a process lacks (docs/security.md, "Least privilege").

Each role runs as root (uid 0) with these capabilities and no others (the rest dropped from the bounding set: a
container's ``cap_drop: [ALL]`` and ``cap_add``, systemd's ``CapabilityBoundingSet=``, ``setpriv
--bounding-set``). Found by running a job, stopping it by a snapshot and restoring it with one capability less
at a time (tests/jobs/test_privileges.py keeps the result true). What each one is for:

==================== ======================================================================================
CAP_SYS_ADMIN        the sandbox's PID and mount namespaces and its /proc; CRIU's namespaces, mounts,
                     /proc/PID/map_files, PR_SET_MM, the restored PIDs (it covers CAP_CHECKPOINT_RESTORE)
CAP_SYS_PTRACE       CRIU seizes the job's processes, reads and writes their memory (parasite)
CAP_NET_ADMIN        CRIU's TCP repair mode (gloo, TCPStore sockets), the nftables lock during a dump, the job
                     network's namespace and veth (``--net``)
CAP_SYS_TIME         (restore) CRIU sets the restored time namespace's clock offsets
CAP_SYS_CHROOT       (restore) CRIU enters the restored mount namespace and comes back (setns)
CAP_SETPCAP          (restore) CRIU restores each task's bounding set (without it CRIU's restorer hits a BUG and
                     the restore hangs: the up-front refusal matters)
CAP_SYS_RESOURCE     (workers of their own user, ``run --user``) CRIU reads each task's resource limits, which
                     the kernel allows for a task of another uid only with it (without: "Can't get rlimit")
==================== ======================================================================================

Not needed (each dropped alone, the cycle still passed): CAP_CHECKPOINT_RESTORE, CAP_KILL, CAP_DAC_OVERRIDE,
CAP_CHOWN, CAP_FOWNER, CAP_SETUID, CAP_SETGID (and CAP_SETPCAP at a snapshot): every process of the job and
every file is root's.
The coordinator needs none (it runs as any user).
"""

from __future__ import annotations

from pathlib import Path

from cryosleep.errors import NotEligible

__all__ = ["NAMES", "OWN_USER", "RESTORE", "SNAPSHOT", "effective", "for_job", "missing", "require"]

NAMES = ("chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
         "linux_immutable", "net_bind_service", "net_broadcast", "net_admin", "net_raw", "ipc_lock", "ipc_owner",
         "sys_module", "sys_rawio", "sys_chroot", "sys_ptrace", "sys_pacct", "sys_admin", "sys_boot", "sys_nice",
         "sys_resource", "sys_time", "sys_tty_config", "mknod", "lease", "audit_write", "audit_control", "setfcap",
         "mac_override", "mac_admin", "syslog", "wake_alarm", "block_suspend", "audit_read", "perfmon", "bpf",
         "checkpoint_restore")
"""Capability numbers, in order (linux/capability.h)."""

SNAPSHOT: frozenset[str] = frozenset({"sys_admin", "sys_ptrace", "net_admin"})
"""What the agent (``cryosleep run``: its sandbox, its snapshots) needs."""
RESTORE: frozenset[str] = SNAPSHOT | {"sys_time", "sys_chroot", "setpcap"}
"""What a restore (``cryosleep restore``, and the host daemon that starts restores) needs: the agent's set (the
restored job is run and snapshotted by the same agent), CRIU's time namespace offsets, its return to its own mount
namespace, and the restored tasks' bounding sets."""


OWN_USER: frozenset[str] = frozenset({"sys_resource"})
"""What a job whose workers run as a user of their own (``cryosleep run --user``) needs besides: CRIU reads the
resource limits of tasks of another uid."""


def for_job(base: frozenset[str], spec_user: dict[str, object]) -> frozenset[str]:
    """``base`` (SNAPSHOT, RESTORE) for a job whose spec's ``user`` is ``spec_user``."""
    return base | OWN_USER if spec_user else base


def effective(pid: int | str = "self") -> frozenset[str]:
    """The capabilities process ``pid`` has in effect (from /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            bits = int(line.split()[1], 16)
            return frozenset(n for i, n in enumerate(NAMES) if bits >> i & 1)
    return frozenset()


def missing(need: frozenset[str], pid: int | str = "self") -> list[str]:
    """The capabilities of ``need`` that ``pid`` lacks, as CAP_ names, sorted."""
    return sorted(f"CAP_{n.upper()}" for n in need - effective(pid))


def require(need: frozenset[str], what: str, pid: int | str = "self", whose: str = "this process") -> None:
    """Refuses ``what`` up front when ``pid`` lacks any of ``need``."""
    lacking = missing(need, pid)
    if lacking:
        raise NotEligible(f"{what} needs capabilities {whose} does not have",
                          f"missing {', '.join(lacking)}",
                          "grant them (a container's cap_add, systemd's AmbientCapabilities/CapabilityBoundingSet; "
                          "docs/security.md, \"Least privilege\"), then try again")

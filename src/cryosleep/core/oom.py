"""Out of the OOM killer's way: the agent, its watchdog and CRIU ask for the lowest ``oom_score_adj`` the kernel
grants; the job's processes keep the value they were started with (the job's own, e.g. a container's).

A CRIU or an agent killed mid-dump is the one failure a snapshot cannot always undo (docs/reliability.md), and
the job's ranks are where the memory is: when memory runs out, the kernel should pick a rank (the job ends, its
last verified snapshot intact) rather than what holds the job frozen. -1000 takes a process out of the OOM
killer's choice; some kernels refuse every negative value (EIO), and there the best granted is 0 (a job
started with a positive value, as a best-effort container's is, still gives its ranks that value)."""

from __future__ import annotations

PROTECTED = -1000


def read(pid: int | str = "self") -> int:
    """``pid``'s oom_score_adj (0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/oom_score_adj") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def write(value: int, pid: int | str = "self") -> bool:
    """Set ``pid``'s oom_score_adj; False where the kernel refuses it."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(value))
        return True
    except OSError:
        return False


def protect(pid: int | str = "self") -> int:
    """Lower ``pid``'s oom_score_adj as far as the kernel grants (-1000, else 0 where negative values are refused);
    return the value it had before (for a process about to start the job: the job's own, to give back to it)."""
    before = read(pid)
    for value in (PROTECTED, 0):
        if value >= before or write(value, pid):
            break
    return before


# the same, for a command started through a shell (CRIU): what it forks inherits it
SHELL = ('echo -1000 > /proc/self/oom_score_adj 2>/dev/null || { [ "$(cat /proc/self/oom_score_adj)" -gt 0 ] && '
         'echo 0 > /proc/self/oom_score_adj; } 2>/dev/null; exec "$@"')

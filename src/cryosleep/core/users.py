"""The user a job's workers run as (``cryosleep run --user``; docs/security.md, "Workers of their own user").

By default the workers run as the user who started the job, root, as torchrun's would under ``sudo``: two such
jobs on one host are not kept apart by file modes. With ``--user`` the sandbox's init starts each worker as that
user (its groups, no capabilities), the job's directory lets the workers reach only their own control
directory, and every file the agent reads from there is opened without following links and only when that user
owns it. The user is resolved once, at launch, and recorded by number in the job's spec: a restore or a resume
runs the workers as the same uid and gids, on any machine (as with NFS, the numbers are what must agree).
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryosleep.errors import CryosleepError, UsageError


@dataclass(frozen=True)
class WorkerUser:
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    name: str = ""  # empty for a uid without a passwd entry here
    home: str = ""

    @classmethod
    def resolve(cls, text: str) -> WorkerUser:
        """``NAME``, ``UID``, ``NAME:GROUP`` or ``UID:GID`` (a number needs no entry in /etc/passwd: its group is
        then the same number unless given)."""
        user, _, group = text.partition(":")
        if not user:
            raise UsageError(f"--user {text!r} names no user", "the form is USER[:GROUP]", "e.g. --user alice")
        try:
            entry: pwd.struct_passwd | None = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        except KeyError:
            if not user.isdigit():
                raise UsageError(f"--user {user!r}: no such user on this host", "it is not in the passwd database",
                                 "create the user, or give a numeric uid (and :gid)") from None
            entry = None
        uid = entry.pw_uid if entry else int(user)
        if group:
            try:
                gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
            except KeyError:
                raise UsageError(f"--user {text!r}: no such group {group!r} on this host",
                                 "it is not in the group database", "give an existing group or a numeric gid") from None
        else:
            gid = entry.pw_gid if entry else uid
        groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, gid)) - {gid})) if entry else ()
        if uid >= (1 << 32) - 1 or gid >= (1 << 32) - 1:
            raise UsageError(f"--user {text!r}: uid or gid out of range", "ids are below 2^32 - 1", "give a valid id")
        return cls(uid=uid, gid=gid, groups=groups, name=entry.pw_name if entry else "",
                   home=entry.pw_dir if entry else "")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerUser | None:
        """The spec's record (``{}``: the workers run as root)."""
        if not data:
            return None
        try:
            return cls(uid=int(data["uid"]), gid=int(data["gid"]), groups=tuple(int(g) for g in data["groups"]),
                       name=str(data.get("name", "")), home=str(data.get("home", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise CryosleepError("the job's record names its workers' user in a form this Cryosleep cannot read",
                                 f"{data!r:.120}: {e}", "start the job again with --user") from e

    def to_json(self) -> dict[str, Any]:
        return {"uid": self.uid, "gid": self.gid, "groups": list(self.groups), "name": self.name, "home": self.home}

    def env(self) -> dict[str, str]:
        """What a login as that user would set, for a user the passwd database knows (else nothing)."""
        if not self.name:
            return {}
        return {"USER": self.name, "LOGNAME": self.name, **({"HOME": self.home} if self.home else {})}

    def init_args(self) -> list[str]:
        """cryosleep-init's options: every worker started as this user."""
        return ["-u", str(self.uid), "-g", str(self.gid), "-G", ",".join(map(str, self.groups)) or "-"]

    def give(self, path: Path) -> None:
        """``path``, a directory the agent made, becomes this user's (0700): the workers write there."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchown(fd, self.uid, self.gid)
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def open_owned(path: Path, flags: int = os.O_RDONLY) -> int:
    """An fd of the regular file ``path``, opened without following a link, only when it belongs to the owner of
    its directory (root's own directories, or the directory a job's user was given): a file there that another
    user placed, a link or a hard link to a file elsewhere is refused with OSError, never read or written as
    root on their behalf."""
    dir_owner = os.stat(path.parent, follow_symlinks=False).st_uid
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != dir_owner or st.st_nlink != 1:
            raise OSError(f"{path} is not a regular file of its directory's owner (uid {dir_owner})")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _may(st: os.stat_result, user: WorkerUser, bits: int) -> bool:
    """Whether ``user`` has ``bits`` (r=4, w=2, x=1) on a file of ``st`` by its mode (no ACLs: their absence is
    the common case, and with them this errs toward a refusal the user can see)."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == user.uid:
        shift = 6
    elif st.st_gid == user.gid or st.st_gid in user.groups:
        shift = 3
    else:
        shift = 0
    return (mode >> shift) & bits == bits


def unreachable(path: Path, user: WorkerUser, bits: int = 3) -> str:
    """Why ``user`` cannot use the directory ``path`` (every directory above it searchable, ``bits`` on it:
    write and search by default), "" when they can."""
    path = path.absolute()
    for above in reversed(path.parents):
        st = os.stat(above)
        if not _may(st, user, 1):
            return (f"{above} (mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}) is not searchable by uid "
                    f"{user.uid}")
    st = os.stat(path)
    if not _may(st, user, bits):
        return f"{path} (mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}) is not open to uid {user.uid}"
    return ""


def cannot_run(program: str, path_env: str, user: WorkerUser) -> str:
    """Why ``user`` cannot execute ``program`` (found on ``path_env`` as execvp would), "" when they can: an
    interpreter under root's home (a pyenv, a virtualenv made by root) is a common one."""
    found = shutil.which(program, path=path_env) if "/" not in program else program
    if not found:
        return ""  # not found at all: the worker's own error says so, as under torchrun
    real = Path(os.path.realpath(found))
    why = unreachable(real.parent, user, 1)
    if not why and not _may(os.stat(real), user, 1):
        why = f"{real} is not executable by uid {user.uid}"
    return f"{found} ({real}): {why}" if why else ""

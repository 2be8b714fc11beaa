"""A real PostgreSQL server for tests, from Debian's packages (`make postgresql`), in a private directory:

    ROOT/data/             the cluster (initdb), owned by an unprivileged user: PostgreSQL refuses to run as root
    ROOT/.s.PGSQL.5432     its only socket (a unix socket; no TCP: listen_addresses is empty)
    ROOT/server.log        the server's log (a failure's post-mortem)

The server runs as ``nobody`` when the tests run as root (as the current user otherwise), with durability off
(fsync, synchronous_commit, full_page_writes: a test's data need not survive a crash of the host). One server per
test session; each test takes a fresh database of its own (``database()``), and ``stop`` leaves no process and no
file behind.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

USER = "cryosleep"  # the server's superuser (trust authentication on its private socket)


def bindir() -> Path | None:
    """The newest installed PostgreSQL's programs (Debian keeps them under /usr/lib/postgresql/VERSION/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    ctl = shutil.which("pg_ctl")
    return Path(ctl).parent if ctl else None


def installed() -> str | None:
    """None when PostgreSQL's server is installed, else what is missing."""
    b = bindir()
    return None if b is not None and (b / "initdb").exists() and (b / "postgres").exists() else \
        "PostgreSQL's server (initdb, pg_ctl, postgres): run `make postgresql`"


class PgServer:
    def __init__(self) -> None:
        b = bindir()
        assert b is not None, installed()
        self.bin = b
        self.root = Path(tempfile.mkdtemp(prefix="cryosleep-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.uid = self.gid = -1
        if os.geteuid() == 0:
            pw = pwd.getpwnam("nobody")
            self.uid, self.gid = pw.pw_uid, pw.pw_gid
            os.chown(self.root, self.uid, self.gid)
        self.root.chmod(0o755)

    def _run(self, *args: str, timeout: float = 120) -> None:
        who: dict[str, object] = {"user": self.uid, "group": self.gid, "extra_groups": []} if self.uid >= 0 else {}
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=self.root,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}, check=False,
                           **who)  # type: ignore[call-overload]
        if r.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}): {r.stdout}{r.stderr}{log[-2000:]}")

    def start(self) -> PgServer:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        opts = (f"-c listen_addresses='' -c unix_socket_directories={self.root} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "60",
                  "start")
        return self

    @property
    def admin_url(self) -> str:
        return f"postgresql://{USER}@/postgres?host={self.root}"

    def database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = "t_" + secrets.token_hex(6)
        with psycopg.connect(self.admin_url, autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        return f"postgresql://{USER}@/{name}?host={self.root}"

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "-t", "30",
                          "stop")
        finally:
            for _ in range(50):
                if not (self.data / "postmaster.pid").exists():
                    break
                time.sleep(0.1)
            shutil.rmtree(self.root, ignore_errors=True)

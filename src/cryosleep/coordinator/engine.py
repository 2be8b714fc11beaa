"""The catalog's database engines, and the one place that knows how their SQL differs.

* **SQLite** (a file path: the embedded default): one connection in WAL mode.
* **PostgreSQL** (a ``postgresql://`` URL): a server that outlives the coordinator's machine, shared by an active
  coordinator and its standbys (coordinator/lease.py), through psycopg 3 (the ``postgresql`` extra).

The catalog writes one SQL for both: ``?`` placeholders, TEXT/INTEGER/REAL columns, ``INSERT ... ON CONFLICT``,
and ``{now}`` where the engine's own clock is meant (the lease: the server's clock, not the coordinators', so that
two coordinator machines whose clocks differ still agree on when a lease ran out). What differs is here: the
placeholders, REAL (a double in SQLite, a float4 in PostgreSQL: DOUBLE PRECISION there), the auto-increment key,
how a table's columns are listed, how a write transaction begins, and the clock.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from cryosleep.errors import CryosleepError

SCHEMES = ("postgresql://", "postgres://")


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


def is_server(db: str | Path) -> bool:
    return str(db).startswith(SCHEMES)


def redact(url: str) -> str:
    """A URL fit for logs and messages: without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


class Engine:
    """One connection (the catalog serializes its use with a lock). Rows read as mappings (``row["col"]``,
    ``dict(row)``)."""

    name = ""
    now = ""  # an SQL expression: the engine's clock, in seconds since the epoch
    where = ""  # what the messages call it: a path, or a URL without its password

    def execute(self, q: str, args: Sequence[Any] = ()) -> Cursor:
        raise NotImplementedError

    def executemany(self, q: str, rows: Iterable[Sequence[Any]]) -> None:
        raise NotImplementedError

    def script(self, ddl: str) -> None:
        """Several DDL statements, inside the current transaction."""
        for stmt in ddl.split(";"):
            if stmt.strip():
                self.execute(self.ddl(stmt))

    def ddl(self, stmt: str) -> str:
        return stmt

    @property
    def in_transaction(self) -> bool:
        raise NotImplementedError

    def begin(self) -> None:
        raise NotImplementedError

    def columns(self, table: str) -> set[str]:
        raise NotImplementedError

    def lock_schema(self) -> None:
        """Inside a transaction: no other coordinator migrates the schema at the same time."""

    def close(self) -> None:
        raise NotImplementedError


class SqliteEngine(Engine):
    name = "sqlite"
    now = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, path: Path) -> None:
        self.where = str(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
        except (OSError, sqlite3.Error) as e:
            raise CryosleepError(f"the coordinator's catalog {path} cannot be opened", str(e),
                                 "check the path and its permissions (--db)") from e

    def execute(self, q: str, args: Sequence[Any] = ()) -> Cursor:
        return self.db.execute(q, args)

    def executemany(self, q: str, rows: Iterable[Sequence[Any]]) -> None:
        self.db.executemany(q, rows)

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction

    def begin(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")  # the write lock at once: no upgrade deadlock between writers

    def columns(self, table: str) -> set[str]:
        return {str(r["name"]) for r in self.db.execute(f"PRAGMA table_info({table})").fetchall()}

    def close(self) -> None:
        self.db.close()


_REAL = re.compile(r"\bREAL\b")
_AUTO = re.compile(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b")


class PostgresEngine(Engine):
    name = "postgresql"
    now = "(EXTRACT(EPOCH FROM clock_timestamp())::DOUBLE PRECISION)"

    def __init__(self, url: str) -> None:
        self.url = url
        self.where = redact(url)
        try:
            import psycopg
            from psycopg.rows import dict_row
        except ImportError as e:
            raise CryosleepError("the coordinator cannot use a PostgreSQL catalog", "psycopg is not installed",
                                 "pip install 'cryosleep[postgresql]' (psycopg 3)") from e
        self._psycopg = psycopg
        self._dict_row = dict_row
        self.db = self._connect()

    def _connect(self) -> Any:
        try:
            return self._psycopg.connect(self.url, autocommit=True, row_factory=self._dict_row, connect_timeout=10)
        except self._psycopg.Error as e:
            raise CryosleepError(f"the coordinator's catalog {self.where} cannot be opened", str(e).strip(),
                                 "check the URL (--db), that the PostgreSQL server runs, and the user's "
                                 "rights on the database") from e

    def _live(self) -> Any:
        """The connection, opened again if it was lost (the server restarted, a proxy dropped it): the statement
        that found it lost failed, the next one runs on a new connection."""
        if self.db.broken:
            self.db = self._connect()
        return self.db

    @staticmethod
    def _sql(q: str) -> str:
        return q.replace("?", "%s")  # the catalog's SQL holds no literal '?' and no '%'

    def execute(self, q: str, args: Sequence[Any] = ()) -> Cursor:
        cur: Cursor = self._live().execute(self._sql(q), tuple(args))
        return cur

    def executemany(self, q: str, rows: Iterable[Sequence[Any]]) -> None:
        with self._live().cursor() as cur:
            cur.executemany(self._sql(q), [tuple(r) for r in rows])

    def ddl(self, stmt: str) -> str:
        return _REAL.sub("DOUBLE PRECISION", _AUTO.sub("BIGSERIAL PRIMARY KEY", stmt))

    @property
    def in_transaction(self) -> bool:
        return bool(self.db.info.transaction_status != self._psycopg.pq.TransactionStatus.IDLE)

    def begin(self) -> None:
        self._live().execute("BEGIN")

    def columns(self, table: str) -> set[str]:
        rows = self._live().execute("SELECT column_name FROM information_schema.columns WHERE table_name = %s "
                               "AND table_schema = current_schema()", (table,)).fetchall()
        return {str(r["column_name"]) for r in rows}

    def lock_schema(self) -> None:
        self.db.execute("SELECT pg_advisory_xact_lock(7480)")  # released with the transaction

    def close(self) -> None:
        self.db.close()


def open_engine(db: str | Path) -> Engine:
    """``postgresql://...`` (or ``postgres://``): the server; anything else: an SQLite file."""
    if is_server(db):
        return PostgresEngine(str(db))
    return SqliteEngine(Path(db))

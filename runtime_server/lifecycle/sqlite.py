"""The Run store in SQLite: the embedded runtime's and ``fnkernel up``'s (``RunStore``).

One file in WAL mode, shared by the gateway process (which hosts the control plane) and every
runtimed process, so a restart of any of them loses no Run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any, Unpack

from fnkernel.runtime_server.errors import RunAlreadyExists, RunNotFound, StoreDamaged, no_room
from fnkernel.runtime_server.lifecycle.runs import (
    POD_GRACE_SECONDS,
    STATUS_FIELDS,
    Pod,
    Run,
    RunSpec,
    RunStatus,
    StatusChanges,
    files_digest,
)
from fnkernel.runtime_server.lifecycle.walindex import WAL_HEADER_BYTES, WAL_HEADERS
from fnkernel.runtime_server.wire import DELETED, FAILED
from fnkernel.system.private import tighten

STORE_FILE = "runs.db"  # in the state dir


# One row a Run: its spec's and status's fields as columns of their names. runs.working_dir:
# where an fnkernel before 0.4 kept a Run's files ('' since they are in run_files,
# _adopt_working_dirs); a store written before 0.6 also has the columns registration_digest and
# spec_digest, read by nothing since the digest is the spec's own (``RunSpec.digest``).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    uid TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    runtime TEXT NOT NULL,
    handler TEXT NOT NULL,
    source TEXT NOT NULL,
    working_dir TEXT NOT NULL DEFAULT '',
    env TEXT NOT NULL,
    idle_timeout_seconds INTEGER NOT NULL,
    phase TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    message TEXT NOT NULL DEFAULT '',
    outputs TEXT NOT NULL DEFAULT '{}',
    assigned_pod TEXT NOT NULL DEFAULT '',
    failed_at REAL NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    cancel_in_flight INTEGER NOT NULL DEFAULT 0,
    drain_timeout_millis INTEGER NOT NULL DEFAULT 0,
    uncharged_attempts INTEGER NOT NULL DEFAULT 0,
    server_deaths INTEGER NOT NULL DEFAULT 0,
    memory_mb INTEGER NOT NULL DEFAULT 0,
    delete_requested INTEGER NOT NULL DEFAULT 0,
    replicas INTEGER NOT NULL DEFAULT 1,
    replica_of TEXT NOT NULL DEFAULT '',
    traceparent TEXT NOT NULL DEFAULT '',
    files_sha256 TEXT NOT NULL DEFAULT '',
    requirements TEXT NOT NULL DEFAULT '[]',
    secrets TEXT NOT NULL DEFAULT '[]',
    secret_versions TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS run_files (
    uid TEXT PRIMARY KEY,
    files TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS pods (
    name TEXT PRIMARY KEY,
    runtime TEXT NOT NULL,
    address TEXT NOT NULL,
    healthy INTEGER NOT NULL,
    heartbeat REAL NOT NULL
);
"""


def _make_private(path: Path) -> None:
    """The store and its -wal and -shm files are 0600: they hold every Run's env (README,
    "Security"). SQLite gives the -wal and -shm files the database file's mode, so the database
    file is created 0600 before SQLite opens it; an older store's looser files are tightened.
    By path, never through a descriptor of our own: closing one would drop the locks SQLite holds
    on the file in this process (walindex.WalHeaders)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    for name in (str(path), f"{path}-wal", f"{path}-shm"):
        tighten(Path(name))


def _read_tree(root: Path) -> dict[str, str]:
    """Every text file under `root` by its relative path ({} if there is no such directory)."""
    files = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory, name)
            with contextlib.suppress(OSError, UnicodeDecodeError):
                files[path.relative_to(root).as_posix()] = path.read_text()
    return files


_SPEC_COLUMNS = tuple(f.name for f in fields(RunSpec))
_STATUS_COLUMNS = tuple(f.name for f in fields(RunStatus))
_JSON_COLUMNS = frozenset({"env", "outputs", "secret_versions"})
_LIST_COLUMNS = frozenset({"requirements", "secrets"})  # a tuple, as a JSON array


def _column(name: str, value: Any) -> Any:
    """A spec's or status's field as its column holds it."""
    if name in _JSON_COLUMNS:
        return json.dumps(dict(value), sort_keys=True, ensure_ascii=False)
    if name in _LIST_COLUMNS:
        return json.dumps(list(value), ensure_ascii=False)
    return int(value) if isinstance(value, bool) else value


def _run(row: sqlite3.Row) -> Run:
    def value(name: str) -> Any:
        if name in _LIST_COLUMNS:
            return tuple(json.loads(row[name]))
        return json.loads(row[name]) if name in _JSON_COLUMNS else row[name]

    status = {name: value(name) for name in _STATUS_COLUMNS}
    status["cancel_in_flight"] = bool(status["cancel_in_flight"])
    return Run(
        uid=row["uid"],
        name=row["name"],
        spec=RunSpec(**{name: value(name) for name in _SPEC_COLUMNS}),
        status=RunStatus(**status),
        created_at=row["created_at"],
        delete_requested=bool(row["delete_requested"]),
    )


class SqliteRunStore:
    """Runs and pods in one SQLite database (WAL); safe to share between threads and processes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        _make_private(path)
        try:
            db = self._connection()
            problems = self._problems(db)
            if not problems:
                db.executescript(_SCHEMA)  # idempotent; executescript commits by itself
                self._add_missing_columns(db)
                self._adopt_working_dirs(db)
                self._digest_files(db)
        except sqlite3.DatabaseError as exc:
            problems = [str(exc)]
        if problems:
            if getattr(self._local, "db", None) is not None:
                self._local.db.close()
            raise StoreDamaged(f"{path}: the Run store is damaged: {'; '.join(problems)} (SQLite)")
        # While a connection of ours is open, SQLite keeps the -shm file that _wal_header maps
        # (only the last connection to close removes it): this one stays open as long as we do.
        self._keeper = db
        # Only a store in WAL mode writes the header; a -shm file left by an earlier one would
        # never change again.
        in_wal = db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        mapped = WAL_HEADERS.map(path) if in_wal else None
        self._wal_header = mapped[1] if mapped else None
        # Given back when the store is closed (after its connection) or collected.
        self._unmap = weakref.finalize(self, WAL_HEADERS.give_back, mapped[0]) if mapped else None
        self._shared: tuple[bytes, dict[Any, Any]] = (b"", {})  # fresh's cache, with its header

    @staticmethod
    def _problems(db: sqlite3.Connection) -> list[str]:
        """What SQLite finds wrong with the file (``PRAGMA quick_check``: every page and index
        entry well formed; a few milliseconds for thousands of Runs), its first three findings;
        none if it is sound. A damaged store would otherwise start, list its Runs, and then fail
        every read that reaches a bad page."""
        problems = [str(row[0]) for row in db.execute("PRAGMA quick_check(3)")]
        if problems == ["ok"]:
            return []
        # One finding a line; a line such as "*** in database main ***" only heads them.
        lines = (line.strip() for problem in problems for line in problem.splitlines())
        return [line for line in lines if line and not line.startswith("***")][:3]

    @staticmethod
    def _add_missing_columns(db: sqlite3.Connection) -> None:
        """A store written by an older fnkernel lacks the newer columns; add them, with the
        schema's defaults, so no Run is lost to an upgrade."""
        have = {row["name"] for row in db.execute("PRAGMA table_info(runs)")}
        table = _SCHEMA.split("CREATE TABLE IF NOT EXISTS runs (", 1)[1].split(");", 1)[0]
        for line in table.strip().splitlines():
            column = line.strip().rstrip(",")
            if column.split()[0] not in have:
                db.execute(f"ALTER TABLE runs ADD COLUMN {column}")

    @staticmethod
    def _adopt_working_dirs(db: sqlite3.Connection) -> None:
        """A store written by an fnkernel before 0.4 has each Run's files in the directory its
        ``working_dir`` column names, not in run_files: read them in, once, so a pod's runtimed
        finds them in the store. A directory that is gone leaves the Run with no files (its
        registration fails, HandlerNotFound), as it would have before."""
        rows = db.execute(
            "SELECT uid, working_dir FROM runs WHERE working_dir != '' "
            "AND uid NOT IN (SELECT uid FROM run_files)"
        ).fetchall()
        for row in rows:
            files = _read_tree(Path(row["working_dir"]))
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "INSERT OR IGNORE INTO run_files (uid, files) VALUES (?, ?)",
                (row["uid"], json.dumps(files, sort_keys=True)),
            )
            db.execute("UPDATE runs SET working_dir = '' WHERE uid = ?", (row["uid"],))
            db.execute("COMMIT")
            shutil.rmtree(row["working_dir"], ignore_errors=True)  # the store holds them now

    @staticmethod
    def _digest_files(db: sqlite3.Connection) -> None:
        """A store written before 0.6 has no ``files_sha256``: compute each from its files."""
        rows = db.execute(
            "SELECT runs.uid, run_files.files FROM runs JOIN run_files USING (uid) "
            "WHERE runs.files_sha256 = ''"
        ).fetchall()
        for row in rows:
            digest = files_digest(json.loads(row["files"]))
            db.execute("UPDATE runs SET files_sha256 = ? WHERE uid = ?", (digest, row["uid"]))

    def _connection(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            # autocommit mode: every transaction is an explicit BEGIN IMMEDIATE (writers never
            # deadlock upgrading a read lock); busy_timeout covers the other processes' writes.
            db = sqlite3.connect(self.path, isolation_level=None, timeout=10)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return db

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write, whole or not at all; a disk too full for it is StorageFull."""
        db = self._connection()
        self._local.seen = None  # our writes do not change data_version (fresh's fallback)
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_FULL:
                raise
            # SQLite's name for a write the disk refused: the same ENOSPC (or EDQUOT) underneath.
            raise no_room(" writing the Run store", f"SQLITE_FULL, SQLite's ENOSPC: {exc}") from exc

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            if db is self._keeper:
                self._wal_header = None  # the file it maps may now go away
            db.close()
            self._local.db = None
            if db is self._keeper and self._unmap is not None and (kept := self._unmap.detach()):
                WAL_HEADERS.unmap(*kept[2])  # after the connection: see WalHeaders

    def version(self) -> int:
        """A number that changes whenever another connection (another thread or process) has
        committed a write since this thread last asked: a cheap "has anything changed?" for
        the loops that wake every tick (docs/architecture.md, "Idle").

        SQLite's data_version, asked only when the WAL-index header changed since this thread
        last asked: every commit changes the header, so an unchanged one means no commit at all.
        The statement costs ~5 us in a loop but ~110 us to a loop that wakes every few ms on
        this machine (cold caches); comparing the header, a few."""
        header = self._wal_header
        local = self._local
        if header is not None:
            stamp = header[:WAL_HEADER_BYTES]  # read before the statement: a commit in between
            if getattr(local, "version_stamp", None) == stamp:  # is seen on the next call
                return int(local.version)
        version = int(self._connection().execute("PRAGMA data_version").fetchone()[0])
        if header is not None:
            local.version_stamp, local.version = stamp, version
        return version

    # Runs

    def insert(self, run: Run, files: Mapping[str, str]) -> Run:
        values = {
            "uid": run.uid,
            "name": run.name,
            "created_at": run.created_at,
            "delete_requested": int(run.delete_requested),
            "working_dir": "",  # an older store's column has no default
            **{name: _column(name, getattr(run.spec, name)) for name in _SPEC_COLUMNS},
            **{name: _column(name, getattr(run.status, name)) for name in _STATUS_COLUMNS},
        }
        columns = ", ".join(values)
        marks = ", ".join(f":{key}" for key in values)
        try:
            with self._transaction() as db:
                db.execute(f"INSERT INTO runs ({columns}) VALUES ({marks})", values)
                db.execute(
                    "INSERT OR REPLACE INTO run_files (uid, files) VALUES (?, ?)",
                    (run.uid, json.dumps(dict(files), sort_keys=True, ensure_ascii=False)),
                )
        except sqlite3.IntegrityError:
            raise RunAlreadyExists(f"a run named {run.name!r} already exists") from None
        return run

    def files(self, uid: str) -> dict[str, str]:
        row = (
            self._connection()
            .execute("SELECT files FROM run_files WHERE uid = ?", (uid,))
            .fetchone()
        )
        if row is None:
            raise RunNotFound(f"no run has uid {uid}")
        files: dict[str, str] = json.loads(row["files"])
        return files

    def get(self, name: str) -> Run:
        row = self._connection().execute("SELECT * FROM runs WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise RunNotFound(f"no run named {name!r}")
        return _run(row)

    def get_uid(self, uid: str) -> Run | None:
        row = self._connection().execute("SELECT * FROM runs WHERE uid = ?", (uid,)).fetchone()
        return None if row is None else _run(row)

    def fresh(self) -> dict[Any, Any]:
        """A cache of rows, emptied whenever anything was written since it was last asked for
        (our own writes too): reads that must be current on every call — the proxy hop's
        fence, the gateway's route — read the row only when it may have changed.

        Whether anything was written is the WAL-index header, read from shared memory with no
        SQL statement and no system call (docs/architecture.md, "The proxy hop"). Every thread
        shares the one cache of the header it saw: a row read once after a write serves every
        thread until the next. Without the header, it is this thread's cache, emptied when its
        connection's ``version`` changes (a number only that connection can compare)."""
        header = self._wal_header
        if header is None:
            version = self.version()
            if getattr(self._local, "seen", None) != version:
                self._local.seen, self._local.cache = version, {}
            cache: dict[Any, Any] = self._local.cache
            return cache
        stamp = header[:WAL_HEADER_BYTES]
        seen, cache = self._shared
        if seen != stamp:
            # A thread that saw the older header keeps filling the older dict, which no later
            # call takes: a row read after a write is only ever kept for a header at least as new.
            cache = {}
            self._shared = (stamp, cache)
        return cache

    def _cached(self, key: tuple[str, str], read: Callable[[], Any]) -> Any:
        cache = self.fresh()
        if key not in cache:
            cache[key] = read()
        return cache[key]

    def get_uid_fresh(self, uid: str) -> Run | None:
        """``get_uid`` through ``fresh``."""
        run: Run | None = self._cached(("uid", uid), lambda: self.get_uid(uid))
        return run

    def get_fresh(self, name: str) -> Run:
        """``get`` through ``fresh`` (RunNotFound is not kept)."""
        run: Run = self._cached(("name", name), lambda: self.get(name))
        return run

    def pod_fresh(self, name: str) -> Pod | None:
        """``pod`` through ``fresh``; whether it is alive is the caller's to ask, now."""
        pod: Pod | None = self._cached(("pod", name), lambda: self.pod(name))
        return pod

    def runs(self, *, pod: str | None = None, phase: str | None = None) -> list[Run]:
        query, params = "SELECT * FROM runs WHERE 1=1", list[str]()
        if pod is not None:
            query += " AND assigned_pod = ?"
            params.append(pod)
        if phase is not None:
            query += " AND phase = ?"
            params.append(phase)
        rows = self._connection().execute(query + " ORDER BY created_at", params).fetchall()
        return [_run(row) for row in rows]

    def update(
        self, run: Run, *, expect_phase: str | None = None, **changes: Unpack[StatusChanges]
    ) -> Run | None:
        """Write `changes` to the status if the Run still has `run`'s attempt and assigned pod
        (and `expect_phase`, when given). Returns the updated Run, or None if it moved on."""
        unknown = set(changes) - STATUS_FIELDS
        if unknown:  # a column name is SQL text: only a status field's may become one
            raise TypeError(f"not fields of a Run's status: {', '.join(sorted(unknown))}")
        assignments = ", ".join(f"{key} = :{key}" for key in changes)
        fence = "uid = :_uid AND attempt = :_attempt AND assigned_pod = :_pod"
        params = {key: _column(key, value) for key, value in changes.items()}
        params |= {"_uid": run.uid, "_attempt": run.status.attempt, "_pod": run.status.assigned_pod}
        if expect_phase is not None:
            fence += " AND phase = :_phase"
            params["_phase"] = expect_phase
        with self._transaction() as db:
            cursor = db.execute(f"UPDATE runs SET {assignments} WHERE {fence}", params)
            if cursor.rowcount == 0:
                return None
            row = db.execute("SELECT * FROM runs WHERE uid = ?", (run.uid,)).fetchone()
        return _run(row)

    def delete(self, uid: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM runs WHERE uid = ?", (uid,))
            db.execute("DELETE FROM run_files WHERE uid = ?", (uid,))

    def load_by_pod(self) -> dict[str, int]:
        """How many live (not Failed/Deleted) Runs each pod holds: the scheduler's load."""
        rows = self._connection().execute(
            "SELECT assigned_pod, COUNT(*) FROM runs WHERE phase NOT IN (?, ?) "
            "GROUP BY assigned_pod",
            (FAILED, DELETED),
        )
        return {pod: count for pod, count in rows}

    # Pods

    def heartbeat(self, name: str, runtime: str, address: str, healthy: bool) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO pods (name, runtime, address, healthy, heartbeat) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET runtime = excluded.runtime, "
                "address = excluded.address, healthy = excluded.healthy, "
                "heartbeat = excluded.heartbeat",
                (name, runtime, address, int(healthy), time.time()),
            )

    def pods(self, runtime: str | None = None) -> list[Pod]:
        query, params = "SELECT * FROM pods", []
        if runtime is not None:
            query, params = query + " WHERE runtime = ?", [runtime]
        rows = self._connection().execute(query + " ORDER BY name", params).fetchall()
        return [
            Pod(
                row["name"],
                row["runtime"],
                row["address"],
                bool(row["healthy"]),
                row["heartbeat"] + POD_GRACE_SECONDS,
            )
            for row in rows
        ]

    def pod(self, name: str) -> Pod | None:
        return next((pod for pod in self.pods() if pod.name == name), None)

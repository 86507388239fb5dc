"""The video job store: one SQLite database (the standard library's :mod:`sqlite3`) in the server's
``--output-dir``, so that queued and finished video jobs survive a restart.

Each job is one row ``(id, status, record)`` where ``record`` is the job's JSON (its validated
request, status, error, output file relative to the output folder, ...).  Every status change is
written through at once (WAL journal, ``synchronous=FULL``), so even a hard exit loses no job: a
job that was running is found ``in_progress`` and re-queued by the next start.  One server at a
time owns a folder (an exclusive ``flock`` on ``serve.lock``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from typing import Optional

from ditattn.errors import AttentionConfigError

SCHEMA_VERSION = 1
DB_FILE = "jobs.sqlite"
LOCK_FILE = "serve.lock"


class JobStore:
    """Video job records on disk under ``folder`` (created if missing).

    Raises :class:`AttentionConfigError` when another server holds the folder, or when the file
    there is not a job store of this version (nothing is overwritten).
    """

    def __init__(self, folder: str):
        self.folder = folder
        self.path = os.path.join(folder, DB_FILE)
        self._lock = threading.Lock()
        self.bad_rows: list[str] = []
        self._rows: Optional[list] = None
        self._lock_fd = None
        self._lock_fd = _lock_folder(folder)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise AttentionConfigError(
                    f"--output-dir {folder}: {DB_FILE} has job store version {version}, this ditattn reads "
                    f"version {SCHEMA_VERSION}; use another --output-dir"
                )
            self._check_tables(version)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS videos (id TEXT PRIMARY KEY, status TEXT NOT NULL, record TEXT NOT NULL)"
            )
            if version != SCHEMA_VERSION:
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            # read every row now: a damaged file is refused here, with its reason, not at the restore
            self._rows = self._db.execute("SELECT id, record FROM videos ORDER BY rowid").fetchall()
        except sqlite3.DatabaseError as exc:
            self.close()
            raise AttentionConfigError(_open_error(folder, exc)) from None
        except OSError as exc:
            self.close()
            raise AttentionConfigError(_open_error(folder, exc)) from None
        except AttentionConfigError:
            self.close()
            raise

    def _check_tables(self, version: int) -> None:
        """Refuse a database that holds tables of something else: a ``videos`` table without this
        store's columns, or (a file not yet marked as a job store) any other table."""
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        foreign = sorted(t for t in tables if t != "videos" and not t.startswith("sqlite_"))
        if "videos" in tables:
            cols = {r[1] for r in self._db.execute("PRAGMA table_info(videos)")}
            if not {"id", "status", "record"} <= cols:
                foreign.insert(0, f"videos({', '.join(sorted(cols))[:120]})")
        if foreign and (version == 0 or foreign[0].startswith("videos(")):
            raise sqlite3.DatabaseError(f"it holds other tables: {', '.join(foreign)[:200]}")

    @property
    def closed(self) -> bool:
        return getattr(self, "_db", None) is None

    def save(self, record: dict) -> None:
        """Insert or update the job ``record`` (a JSON-safe dict with ``id`` and ``status``); a new
        job goes after the existing ones (the load order).  RuntimeError once closed."""
        body = json.dumps(record, sort_keys=True)
        with self._lock:
            self._rows = None  # the rows read at open are stale now
            self._live().execute(
                "INSERT INTO videos (id, status, record) VALUES (?, ?, ?) ON CONFLICT(id) DO UPDATE "
                "SET status = excluded.status, record = excluded.record",
                (record["id"], record["status"], body),
            )

    def delete(self, vid: str) -> None:
        with self._lock:
            self._rows = None
            self._live().execute("DELETE FROM videos WHERE id = ?", (vid,))

    def _live(self) -> sqlite3.Connection:
        if self.closed:
            raise RuntimeError(f"the job store {self.path} is closed (the server has shut down)")
        return self._db

    def load(self) -> list[dict]:
        """Every stored record, oldest first; a row that is not valid JSON is skipped (reported by
        ``bad_rows``)."""
        with self._lock:
            rows, self._rows = self._rows, None
            if rows is None:
                rows = self._live().execute("SELECT id, record FROM videos ORDER BY rowid").fetchall()
        out, self.bad_rows = checked_records(rows)
        return out

    def close(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            with self._lock:
                db.close()
            self._db = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None


def _open_error(folder: str, exc: BaseException) -> str:
    """The refusal of a job store that cannot be opened: a full disk (or another I/O or permission
    problem) says so and leaves the file alone; only a file that is not a job store is called one."""
    import errno

    text = str(exc)
    if "disk is full" in text or isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"--output-dir {folder}: the disk is full, so the job store {DB_FILE} cannot be opened; free some "
            "space and start again (the job store is intact: keep it, its jobs are restored then)"
        )
    if isinstance(exc, OSError) or isinstance(exc, sqlite3.OperationalError) and not text.startswith("it holds"):
        return (
            f"--output-dir {folder}: cannot open the job store {DB_FILE} ({text[:200]}); check the folder's "
            "permissions and free space (the file is left as it is)"
        )
    if "malformed" in text:
        return (
            f"--output-dir {folder}: the job store {DB_FILE} is damaged ({text[:200]}); keep a copy and move it "
            "away (its jobs cannot be restored), or use another --output-dir"
        )
    return (
        f"--output-dir {folder}: {DB_FILE} is not a ditattn job store ({text[:200]}); move it away or use "
        "another --output-dir"
    )


def _lock_folder(folder: str) -> Optional[int]:
    """Hold an exclusive lock on ``folder`` for this process (POSIX ``flock``; None elsewhere)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise AttentionConfigError(f"--output-dir {folder}: cannot use it ({exc.strerror or exc})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise AttentionConfigError(
            f"--output-dir {folder} is in use by another ditattn serve; stop it or choose another folder"
        ) from None
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def checked_records(rows) -> tuple[list[dict], list[str]]:
    """``(records, bad ids)`` of stored ``(id, record)`` rows, a record being JSON text or a mapping: a
    row whose record is not a JSON object carrying its own id is bad (reported, never restored)."""
    out, bad = [], []
    for vid, body in rows:
        try:
            rec = json.loads(body) if isinstance(body, (str, bytes)) else body
        except ValueError:
            rec = None
        if isinstance(rec, dict) and rec.get("id") == vid:
            out.append(rec)
        else:
            bad.append(vid)
    return out, bad

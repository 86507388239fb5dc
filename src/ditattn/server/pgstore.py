"""The shared video job store on PostgreSQL (psycopg 3), for replicas behind one endpoint.

One table ``ditattn_videos``: ``seq`` (submission order), ``id``, ``status``, ``record`` (the job's
JSON, as the SQLite store keeps it), ``owner`` (the replica that holds the job, or NULL),
``lease_until`` (database clock: no clock skew between hosts), ``attempts`` (how many times it
was claimed) and ``ran_on`` (the replica that claimed it last).  A replica takes a job with
:meth:`PgJobStore.claim` (``SELECT ... FOR UPDATE SKIP LOCKED``: two replicas never take the same
job) and renews its lease while it runs (:meth:`PgJobStore.renew`).  A job whose lease ran out (its
replica died or hangs) is claimable again; past ``max_attempts`` claims it is marked failed with the
reason instead.  Writes of a job's
result are guarded by ownership (:meth:`PgJobStore.update`), so a replica that lost its lease
cannot overwrite the result of the one that took the job over.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Iterable, Optional

from ditattn.errors import AttentionConfigError
from ditattn.server.jobstore import checked_records

log = logging.getLogger("ditattn.server")
TABLE = "ditattn_videos"
METRICS = "ditattn_replica_metrics"  # each replica's latest /metrics text, for the deployment view
UNFINISHED = ("queued", "in_progress")

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    seq BIGSERIAL,
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    record JSONB NOT NULL,
    owner TEXT,
    lease_until TIMESTAMPTZ,
    attempts INTEGER NOT NULL DEFAULT 0,
    ran_on TEXT
);
CREATE INDEX IF NOT EXISTS {TABLE}_claim ON {TABLE} (status, seq);
CREATE TABLE IF NOT EXISTS {METRICS} (
    owner TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    updated TIMESTAMPTZ NOT NULL DEFAULT now()
)
"""


def redact(url: str) -> str:
    """``url`` without its password (for log lines and errors)."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


class PgJobStore:
    """Video job records in the PostgreSQL database at ``url``; ``owner``: this replica's id (the
    lease holder name).  AttentionConfigError when psycopg is missing or the database cannot be
    reached."""

    def __init__(self, url: str, owner: Optional[str] = None, connect_timeout: float = 10.0):
        try:
            import psycopg
        except ImportError:
            raise AttentionConfigError(
                "--job-store postgresql://... needs psycopg 3: pip install 'ditattn[scale]' (or 'psycopg[binary]')"
            ) from None
        self._psycopg = psycopg
        self.url, self.path = url, redact(url)
        self.owner = owner or "ditattn"
        self.bad_rows: list = []
        self._lock = threading.Lock()
        self._timeout = connect_timeout
        self._db, self._ready = None, False
        try:
            self._db = self._connect()
            with self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(1684632673)")  # one schema creation at a time
                for stmt in _SCHEMA.split(";"):
                    self._db.execute(stmt)
            self._ready = True
        except psycopg.Error as exc:
            self.close()
            raise AttentionConfigError(
                f"--job-store {self.path}: cannot use the database "
                f"({str(exc).strip().splitlines()[0] if str(exc).strip() else exc})"
            ) from None

    def _connect(self):
        return self._psycopg.connect(self.url, autocommit=True, connect_timeout=max(1, int(self._timeout)))

    @property
    def closed(self) -> bool:
        return self._db is None

    def _run(self, fn):
        """``fn(connection)`` under the lock; one reconnect when the connection was lost."""
        with self._lock:
            if self._db is None:
                raise RuntimeError(f"the job store {self.path} is closed (the server has shut down)")
            try:
                return fn(self._db)
            except self._psycopg.OperationalError:
                if not self._db.closed:
                    raise
                log.warning("job store %s: connection lost; reconnecting", self.path)
                self._db = self._connect()
                return fn(self._db)

    # -- the JobStoreAPI of the single server ------------------------------------------------------
    def save(self, record: dict) -> None:
        """Insert or update ``record`` (its ownership and attempts are kept)."""
        body = json.dumps(record, sort_keys=True)
        self._run(
            lambda db: db.execute(
                f"INSERT INTO {TABLE} (id, status, record) VALUES (%s, %s, %s::jsonb) ON CONFLICT (id) DO UPDATE "
                "SET status = excluded.status, record = excluded.record",
                (record["id"], record["status"], body),
            )
        )

    def delete(self, vid: str) -> None:
        self._run(lambda db: db.execute(f"DELETE FROM {TABLE} WHERE id = %s", (vid,)))

    def load(self) -> list[dict]:
        rows = self._run(lambda db: db.execute(f"SELECT id, record FROM {TABLE} ORDER BY seq").fetchall())
        out, self.bad_rows = checked_records(rows)
        return out

    def close(self) -> None:
        """Give this owner's unfinished jobs back (queued, no owner: another replica takes them at
        once) and close the connection."""
        db, self._db = self._db, None
        if db is None:
            return
        if not self._ready:
            db.close()
            return
        try:
            with self._lock:
                db.execute(f"DELETE FROM {METRICS} WHERE owner = %s", (self.owner,))
                db.execute(
                    f"UPDATE {TABLE} SET owner = NULL, lease_until = NULL, status = 'queued', "
                    "record = jsonb_set(jsonb_set(record, '{status}', '\"queued\"'), '{progress}', '0') "
                    "WHERE owner = %s AND status IN ('queued', 'in_progress')",
                    (self.owner,),
                )
        except self._psycopg.Error as exc:
            log.warning("job store %s: could not hand back the jobs of %s: %s", self.path, self.owner, exc)
        finally:
            db.close()

    # -- shared use ----------------------------------------------------------------------------
    def get(self, vid: str) -> Optional[dict]:
        row = self._run(lambda db: db.execute(f"SELECT record FROM {TABLE} WHERE id = %s", (vid,)).fetchone())
        return row[0] if row else None

    def owner_of(self, vid: str) -> Optional[tuple]:
        """``(owner, attempts, status)`` of job ``vid`` (None if absent)."""
        return self._run(
            lambda db: db.execute(f"SELECT owner, attempts, status FROM {TABLE} WHERE id = %s", (vid,)).fetchone()
        )

    def update(self, record: dict) -> str:
        """Write ``record`` over the stored one if this owner holds it or nobody does; a finished
        record releases the lease.  ``"ok"``, ``"gone"`` (deleted) or ``"taken"`` (another owner)."""
        body = json.dumps(record, sort_keys=True)
        finished = record["status"] not in UNFINISHED

        def op(db):
            cur = db.execute(
                f"UPDATE {TABLE} SET status = %s, record = %s::jsonb, "
                "owner = CASE WHEN %s THEN NULL ELSE owner END, "
                "lease_until = CASE WHEN %s THEN NULL ELSE lease_until END "
                "WHERE id = %s AND (owner = %s OR owner IS NULL)",
                (record["status"], body, finished, finished, record["id"], self.owner),
            )
            if cur.rowcount:
                return "ok"
            row = db.execute(f"SELECT owner FROM {TABLE} WHERE id = %s", (record["id"],)).fetchone()
            return "gone" if row is None else "taken"

        return self._run(op)

    def claim(self, lease_s: float, max_attempts: int) -> tuple[Optional[dict], list[dict]]:
        """Take the oldest job that is queued with no live lease, or in progress with an expired one
        (its replica stopped renewing).  Each claim counts an attempt; a job claimed more than
        ``max_attempts`` times is marked failed (``lease_expired``, naming the last owner) and
        returned in the second list instead."""
        failed = []

        def op(db):
            with db.transaction():
                row = db.execute(
                    f"SELECT id, record, attempts, owner FROM {TABLE} WHERE status IN ('queued', 'in_progress') "
                    "AND (owner IS NULL OR lease_until IS NULL OR lease_until < now()) "
                    "ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED"
                ).fetchone()
                if row is None:
                    return None, False
                vid, rec, attempts, last = row
                if attempts >= max_attempts:
                    rec = dict(
                        rec,
                        status="failed",
                        completed_at=int(time.time()),
                        error={
                            "code": "lease_expired",
                            "message": f"the replica running it stopped ({attempts} attempt(s); "
                            f"the last on {last or 'an unknown replica'})",
                        },
                    )
                    db.execute(
                        f"UPDATE {TABLE} SET status = 'failed', record = %s::jsonb, owner = NULL, "
                        "lease_until = NULL WHERE id = %s",
                        (json.dumps(rec, sort_keys=True), vid),
                    )
                    return rec, True
                rec = dict(rec, status="queued", progress=0)
                db.execute(
                    f"UPDATE {TABLE} SET owner = %s, lease_until = now() + make_interval(secs => %s), "
                    "attempts = attempts + 1, ran_on = %s, status = 'queued', record = %s::jsonb WHERE id = %s",
                    (self.owner, float(lease_s), self.owner, json.dumps(rec, sort_keys=True), vid),
                )
                if last is not None:
                    log.warning(
                        "job store: video %s re-queued: the lease of %s ran out (attempt %d of %d)",
                        vid,
                        last,
                        attempts + 1,
                        max_attempts,
                    )
                return rec, False

        while True:
            rec, gave_up = self._run(op)
            if rec is None or not gave_up:
                return rec, failed
            log.error("job store: video %s failed: %s", rec["id"], rec["error"]["message"])
            failed.append(rec)

    def renew(self, ids: Iterable[str], lease_s: float, progress: dict) -> set:
        """Extend this owner's leases on ``ids`` (and store their ``progress``, id -> percent);
        returns the ids it no longer holds (deleted, or taken over after its lease ran out)."""
        ids = list(ids)
        if not ids:
            return set()

        def op(db):
            held = set()
            for vid in ids:
                cur = db.execute(
                    f"UPDATE {TABLE} SET lease_until = now() + make_interval(secs => %s), "
                    "record = jsonb_set(record, '{progress}', to_jsonb(%s::int)) WHERE id = %s AND owner = %s "
                    "RETURNING id",
                    (float(lease_s), int(progress.get(vid, 0)), vid, self.owner),
                )
                if cur.fetchone():
                    held.add(vid)
            return set(ids) - held

        return self._run(op)

    def waiting(self) -> int:
        return self._run(lambda db: db.execute(f"SELECT count(*) FROM {TABLE} WHERE status = 'queued'").fetchone()[0])

    def finished_beyond(self, keep: int) -> list[dict]:
        """Remove the oldest finished records beyond the newest ``keep`` finished ones; returns them
        (their files are the caller's to remove)."""

        def op(db):
            rows = db.execute(
                f"DELETE FROM {TABLE} WHERE id IN (SELECT id FROM {TABLE} WHERE status NOT IN ('queued', "
                "'in_progress') ORDER BY seq DESC OFFSET %s) RETURNING record",
                (int(keep),),
            ).fetchall()
            return [r[0] for r in rows]

        return self._run(op)

    # -- metrics of the replicas -----------------------------------------------------------------
    def publish_metrics(self, body: str) -> None:
        """Store this owner's current metrics exposition text (its heartbeat does, and each scrape)."""
        self._run(
            lambda db: db.execute(
                f"INSERT INTO {METRICS} (owner, body, updated) VALUES (%s, %s, now()) ON CONFLICT (owner) DO UPDATE "
                "SET body = excluded.body, updated = now()",
                (self.owner, body),
            )
        )

    def replica_metrics(self, max_age_s: float) -> dict:
        """``{owner: exposition text}`` of the replicas that published within ``max_age_s`` seconds
        (database clock); rows older than 100 × that (replicas long gone) are removed."""

        def op(db):
            db.execute(
                f"DELETE FROM {METRICS} WHERE updated < now() - make_interval(secs => %s)", (100.0 * max_age_s,)
            )
            return db.execute(
                f"SELECT owner, body FROM {METRICS} WHERE updated >= now() - make_interval(secs => %s) ORDER BY owner",
                (float(max_age_s),),
            ).fetchall()

        return dict(self._run(op))

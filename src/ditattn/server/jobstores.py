"""The job store interface the server uses, and the choice of implementation by URL.

:class:`JobStoreAPI` is what :class:`~ditattn.server.store.VideoStore` and the restore at start
call: the SQLite :class:`~ditattn.server.jobstore.JobStore` (one server per ``--output-dir``, the
default) implements it, and so does :class:`~ditattn.server.pgstore.PgJobStore` (``--job-store
postgresql://...``), which adds what replicas sharing one store need: claiming a queued job for
exactly one replica under a lease (:class:`SharedJobStoreAPI`).
"""

from __future__ import annotations

from typing import Iterable, Optional, Protocol

from ditattn.errors import AttentionConfigError
from ditattn.runconfig.checks import JOB_STORE_SCHEMES as PG_SCHEMES  # one list: the --job-store check


class JobStoreAPI(Protocol):
    """Video job records: JSON-safe dicts with at least ``id`` and ``status``."""

    path: str  # where it lives, for log lines (a file, or a database URL without its password)
    bad_rows: list

    @property
    def closed(self) -> bool: ...

    def save(self, record: dict) -> None:
        """Insert or update ``record`` (a new job goes after the existing ones)."""

    def delete(self, vid: str) -> None: ...

    def load(self) -> list[dict]:
        """Every record, oldest first (unreadable ones skipped, their ids in ``bad_rows``)."""

    def close(self) -> None: ...


class SharedJobStoreAPI(JobStoreAPI, Protocol):
    """A store several replicas use at once: each running job is leased to one owner."""

    owner: str

    def get(self, vid: str) -> Optional[dict]: ...

    def update(self, record: dict) -> str:
        """Write an existing record: ``"ok"``, ``"gone"`` (deleted) or ``"taken"`` (another owner
        holds it now; nothing written)."""

    def claim(self, lease_s: float, max_attempts: int) -> tuple[Optional[dict], list[dict]]:
        """Take the oldest claimable job for this owner: ``(record or None, records failed because
        their attempts ran out)``."""

    def renew(self, ids: Iterable[str], lease_s: float, progress: dict) -> set:
        """Extend the leases of ``ids``; returns the ids this owner no longer holds."""

    def waiting(self) -> int:
        """Jobs queued and not yet running."""


def is_postgres(url: Optional[str]) -> bool:
    return bool(url) and url.startswith(PG_SCHEMES)


def open_job_store(url: Optional[str], folder: str, *, owner: Optional[str] = None) -> JobStoreAPI:
    """The job store ``url`` names: None / ``sqlite`` → ``jobs.sqlite`` in ``folder``;
    ``postgresql://...`` → that database (``owner``: this replica's id).  AttentionConfigError for
    anything else or a store that cannot be opened."""
    if url is None or url == "sqlite":
        from ditattn.server.jobstore import JobStore

        return JobStore(folder)
    if is_postgres(url):
        from ditattn.server.pgstore import PgJobStore

        return PgJobStore(url, owner=owner)
    raise AttentionConfigError(
        f"--job-store {url[:60]!r} is not supported; accepted: sqlite (the default, in "
        "--output-dir) or postgresql://USER[:PASSWORD]@HOST[:PORT]/DBNAME"
    )


def check_shared(config, who: str = "--replicas needs") -> None:
    """Replicas share two things, so ``config`` (a ServerConfig) must name both: a PostgreSQL job store
    (``job_store``) and an output folder (``output_dir``); AttentionConfigError naming the one missing.
    ``who``: how the message starts ("--replicas needs" from the command line)."""
    if not is_postgres(config.job_store):
        raise AttentionConfigError(
            f"{who} a job store the replicas share: --job-store postgresql://USER@HOST:PORT/DB "
            "(SQLite serves one process; docs/serving.md, Scale-out)"
        )
    if not config.output_dir:
        raise AttentionConfigError(
            f"{who} an output folder the replicas share: --output-dir DIR (the same path on "
            "every node, a shared file system for several)"
        )

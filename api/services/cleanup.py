"""Periodic removal of what interrupted writes leave in the artifact store.

An object is written before its row is committed (uploads, checkpoints, result files), so a process killed between
the two leaves an object nothing points to; a process killed during the write leaves a temporary file (or an
unfinished multipart upload on S3). Neither is ever read. This removes them once they are older than a grace period,
which must exceed the longest time between an object's write and its row's commit (seconds in practice; an hour by
default). Objects of a job that a worker holds right now are left alone whatever their age, since a checkpoint's
files are uploaded one by one before its row.

Keys follow two layouts: ``files/{tenant}/{file}.{ext}`` (uploads and result files: one row each in ``files``) and
``jobs/{job}/checkpoints/step-NNNNNN/...`` (a checkpoint's folder: one row in ``checkpoints``). A key of any other
shape is left alone: the clean-up removes only what it can prove unreferenced.

Each pass first deletes the files whose ``expires_after`` has passed (:func:`delete_expired_files`): row marked
deleted, then bytes removed, as a user's delete does. The API answers 404 for such a file from the moment it expires.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from api.db import session_scope
from api.orm import now
from api.repositories import cleanup as repo
from api.repositories import files as files_repo
from api.storage import ArtifactStore, StoredObject

log = logging.getLogger(__name__)

DEFAULT_GRACE_SECONDS = 3600.0
EXPIRED_BATCH = 500  # expired files deleted per transaction


@dataclass(frozen=True)
class Cleaned:
    """What one pass removed."""

    files: int  # objects under files/ with no live file row
    checkpoint_objects: int  # objects of checkpoint folders with no checkpoint row
    temporaries: int  # temporary files / unfinished multipart uploads
    expired_files: int = 0  # files deleted because their expires_after passed

    @property
    def total(self) -> int:
        return self.files + self.checkpoint_objects + self.temporaries + self.expired_files


def _checkpoint_folder(key: str) -> tuple[str, str] | None:
    """(job id, folder) of a key inside a checkpoint folder, None for any other key."""
    parts = key.split("/")
    if len(parts) >= 5 and parts[0] == "jobs" and parts[2] == "checkpoints" and parts[3].startswith("step-"):
        return parts[1], "/".join(parts[:4])
    return None


def delete_expired_files(*, url: str, store: ArtifactStore, at: int | None = None) -> int:
    """Mark deleted every file whose expiry is at or before ``at`` (now) and remove its bytes; returns how many. The
    row is committed first: a crash in between leaves an orphan object, which the orphan pass removes later."""
    at = now() if at is None else at
    deleted = 0
    while True:
        with session_scope(url) as s:
            rows = files_repo.expired(s, at=at, limit=EXPIRED_BATCH)
            for row in rows:
                files_repo.mark_deleted(s, row=row)
            keys = [row.storage_key for row in rows]
        for key in keys:
            store.delete(key)
        deleted += len(keys)
        if len(keys) < EXPIRED_BATCH:
            return deleted


def clean_orphans(
    *, url: str, store: ArtifactStore, grace_seconds: float = DEFAULT_GRACE_SECONDS, at: float | None = None
) -> Cleaned:
    """Remove objects without rows and temporaries older than ``grace_seconds``; return what was removed.

    Safe to run from several workers at once: every removal is of an object already unreferenced, and deleting
    a missing object is not an error."""
    at = time.time() if at is None else at
    cutoff = at - grace_seconds
    expired = delete_expired_files(url=url, store=store, at=int(at))

    old_files: list[StoredObject] = [o for o in store.list_modified("files") if o.modified < cutoff]
    with session_scope(url) as s:
        live = repo.live_file_keys(s, keys=[o.key for o in old_files])
    orphan_files = [o.key for o in old_files if o.key not in live]

    by_folder: dict[str, list[str]] = defaultdict(list)
    job_of: dict[str, str] = {}
    for o in store.list_modified("jobs"):
        where = _checkpoint_folder(o.key)
        if where is not None and o.modified < cutoff:
            job_of[where[1]] = where[0]
            by_folder[where[1]].append(o.key)
    with session_scope(url) as s:
        recorded = repo.checkpoint_prefixes(s, prefixes=list(by_folder))
        busy = repo.leased_jobs(s, job_ids=set(job_of.values()), at=at)
    orphan_checkpoint_objects = [
        key
        for folder, keys in by_folder.items()
        if folder not in recorded and job_of[folder] not in busy
        for key in keys
    ]

    for key in orphan_files + orphan_checkpoint_objects:
        store.delete(key)
    temporaries = store.clean_temporaries(older_than=cutoff)
    cleaned = Cleaned(len(orphan_files), len(orphan_checkpoint_objects), temporaries, expired)
    if cleaned.total:
        log.info(
            "artifact clean-up removed %d orphan file objects, %d orphan checkpoint objects, %d temporaries, "
            "%d expired files",
            cleaned.files,
            cleaned.checkpoint_objects,
            cleaned.temporaries,
            cleaned.expired_files,
        )
    return cleaned

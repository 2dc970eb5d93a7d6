"""Files: uploads streamed to the artifact store as they arrive (``api.multipart``: nothing is spooled) while every
line is checked to be a JSON object whose values the service can store and send back (``trainer.spec.json_values``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from typing import BinaryIO, Literal

from sqlalchemy.orm import Session

from api import ids
from api.auth import Caller
from api.db import session_scope
from api.errors import InvalidRequest, NotFound, PayloadTooLarge, Unavailable
from api.line_check import CheckerUnavailable, LineError, UploadChecker
from api.multipart import MultipartError, MultipartUpload
from api.orm import File, now
from api.repositories import files as files_repo
from api.schemas import FILE_EXPIRY_MAX_SECONDS, FILE_EXPIRY_MIN_SECONDS, FILE_PURPOSES
from api.storage import ArtifactStore, TooLarge
from api.storage import NotFound as ArtifactNotFound
from trainer.spec import json_values

log = logging.getLogger("proxima.api.files")

MAX_LIST_LIMIT = 10_000
MAX_FILENAME_CHARS = 512  # files.filename


def storage_key(*, tenant_id: str, file_id: str) -> str:
    return f"files/{tenant_id}/{file_id}.jsonl"


def _checked(chunks: Iterable[bytes], checker: UploadChecker) -> Iterator[bytes]:
    for chunk in chunks:
        checker.feed(chunk)
        yield chunk
    checker.close()


def _check_purpose(purpose: str | None) -> str:
    if purpose is None:
        raise InvalidRequest("field required", param="purpose")
    if purpose not in FILE_PURPOSES:
        raise InvalidRequest(
            f"purpose {purpose!r} is not supported; valid: {', '.join(FILE_PURPOSES)}",
            param="purpose",
            code="invalid_purpose",
        )
    return purpose


# OpenAI's clients send `expires_after` as form fields in brackets (the SDK's multipart encoding of a nested object).
EXPIRES_ANCHOR, EXPIRES_SECONDS = "expires_after[anchor]", "expires_after[seconds]"


def _expiry_seconds(fields: dict[str, str]) -> int | None:
    """The seconds of ``expires_after`` after ``created_at``, None when the form has none; a 400 naming the field
    for a partial policy, an anchor other than ``created_at`` or seconds outside OpenAI's range."""
    anchor, seconds = fields.get(EXPIRES_ANCHOR), fields.get(EXPIRES_SECONDS)
    if "expires_after" in fields:  # one field holding the object as JSON (curl -F 'expires_after={...}')
        try:
            policy = json.loads(fields["expires_after"])
        except ValueError:
            policy = None
        if not isinstance(policy, dict) or set(policy) - {"anchor", "seconds"}:
            raise InvalidRequest("must be an object {anchor, seconds}", param="expires_after")
        anchor, seconds = policy.get("anchor", anchor), policy.get("seconds", seconds)
        anchor, seconds = (None if v is None else str(v) for v in (anchor, seconds))
    if anchor is None and seconds is None:
        return None
    if anchor is None or seconds is None:
        missing = "anchor" if anchor is None else "seconds"
        raise InvalidRequest("field required", param=f"expires_after.{missing}")
    if anchor != "created_at":
        raise InvalidRequest(f"anchor {anchor!r} is not supported; valid: 'created_at'", param="expires_after.anchor")
    lo, hi = FILE_EXPIRY_MIN_SECONDS, FILE_EXPIRY_MAX_SECONDS
    value = int(seconds) if seconds.strip().isdigit() and seconds.isascii() else None
    if value is None or not lo <= value <= hi:
        raise InvalidRequest(
            f"must be a whole number of seconds from {lo} (1 hour) to {hi} (30 days)", param="expires_after.seconds"
        )
    return value


def _check_filename(filename: str) -> None:
    if len(filename) > MAX_FILENAME_CHARS:
        raise InvalidRequest(
            f"the file name is longer than {MAX_FILENAME_CHARS} characters", param="file", code="invalid_file"
        )
    if problem := json_values.string_problem(filename):  # files.filename is text: PostgreSQL cannot hold a NUL
        raise InvalidRequest(f"the file name {problem}", param="file", code="invalid_file")


def upload(
    *,
    session: Session,
    store: ArtifactStore,
    tenant: Caller,
    form: MultipartUpload,
    max_bytes: int,
) -> File:
    """Store the JSONL dataset of a multipart upload and its row, the file's bytes checked and stored as they
    stream in. A bad line, an empty file, one over ``max_bytes``, a bad form, a missing or bad ``purpose``, or in a
    ``fine-tune`` file a message no method can keep whole (``api.line_check``) stores nothing. ``purpose`` is
    checked before the file's bytes when the client sends it first (as OpenAI's clients do), else once they are in."""
    try:
        form.open()
    except MultipartError as err:
        raise InvalidRequest(str(err), param=err.param) from None
    if "purpose" in form.fields:
        _check_purpose(form.fields["purpose"])
    _expiry_seconds(form.fields)  # the fields sent before the file: refused before its bytes are read
    filename = form.filename or ""
    _check_filename(filename)
    file_id = ids.file_id()
    key = storage_key(tenant_id=tenant.id, file_id=file_id)
    checker = UploadChecker()
    try:
        size = store.put_stream(key, _checked(form.file_chunks(), checker), max_bytes=max_bytes)
    except TooLarge:
        raise PayloadTooLarge(
            f"the file exceeds the upload limit of {max_bytes} bytes", param="file", code="file_too_large"
        ) from None
    except LineError as err:
        raise InvalidRequest(str(err), param="file", code="invalid_file") from None
    except MultipartError as err:
        raise InvalidRequest(str(err), param=err.param) from None
    except CheckerUnavailable as err:
        log.warning("upload not stored: %s", err)
        raise Unavailable("the file could not be checked right now: retry later", code="checker_unavailable") from None
    finally:
        checker.abort()  # a no-op once the checker has answered
    try:
        row = _row(form.fields, checker, file_id=file_id, tenant=tenant, filename=filename, size=size, key=key)
        return files_repo.add(session, row=row)
    except BaseException:
        store.delete(key)  # no row: leave no orphan object
        raise


def _row(
    fields: dict[str, str], checker: UploadChecker, *, file_id: str, tenant: Caller, filename: str, size: int, key: str
) -> File:
    """The stored file's row, from the form's fields (all read by now) and what the checker found."""
    purpose = _check_purpose(fields.get("purpose"))
    if purpose == "fine-tune" and checker.chat_problem is not None:  # a message no method can keep whole
        raise InvalidRequest(checker.chat_problem, param="file", code="invalid_file")
    expires_in = _expiry_seconds(fields)
    created_at = now()
    return File(
        id=file_id,
        tenant_id=tenant.id,
        filename=filename or "upload.jsonl",
        purpose=purpose,
        bytes=size,
        lines=checker.lines,
        storage_key=key,
        created_at=created_at,
        deleted=False,
        expires_at=None if expires_in is None else created_at + expires_in,
    )


def get(*, session: Session, tenant: Caller, file_id: str) -> File:
    row = files_repo.get(session, tenant_id=tenant.id, file_id=file_id)
    if row is None:
        raise NotFound("file", file_id, param="file_id")
    return row


def page(
    *,
    session: Session,
    tenant: Caller,
    purpose: str | None,
    after: str | None,
    limit: int,
    order: Literal["asc", "desc"],
) -> tuple[list[File], bool]:
    cursor = None
    if after is not None:
        cursor = files_repo.get(session, tenant_id=tenant.id, file_id=after)
        if cursor is None:
            raise InvalidRequest(f"no such file: {after!r}", param="after")
    return files_repo.page(session, tenant_id=tenant.id, purpose=purpose, after=cursor, limit=limit, order=order)


def delete(*, session: Session, store: ArtifactStore, tenant: Caller, file_id: str) -> File:
    """Mark the file deleted and remove its bytes (as with OpenAI, a queued job that needs it will fail)."""
    row = get(session=session, tenant=tenant, file_id=file_id)
    files_repo.mark_deleted(session, row=row)
    store.delete(row.storage_key)
    return row


def is_expired(url: str, *, file_id: str) -> bool:
    """Whether a job's dataset has expired (``expires_after``) though the sweeper has not deleted it yet: the
    worker reads no file that is already gone for its tenant."""
    with session_scope(url) as s:
        return files_repo.is_expired(s, file_id=file_id, at=now())


def open_content(*, session: Session, store: ArtifactStore, tenant: Caller, file_id: str) -> tuple[File, BinaryIO]:
    """The file's row and an open stream over its bytes (the caller closes it)."""
    row = get(session=session, tenant=tenant, file_id=file_id)
    try:
        return row, store.open(row.storage_key)
    except ArtifactNotFound:
        log.error("file %s has a row but no stored object at %s", row.id, row.storage_key)
        raise NotFound("file content", file_id, param="file_id") from None

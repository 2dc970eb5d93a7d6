"""Files: uploads streamed to the artifact store as they arrive (``api.multipart``: nothing is spooled) while every
line is checked to be a JSON object whose values the service can store and send back (``trainer.spec.json_values``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import BinaryIO, Literal

from sqlalchemy.orm import Session

from api import ids
from api.auth import Caller
from api.errors import InvalidRequest, NotFound, PayloadTooLarge, Unavailable
from api.line_check import CheckerUnavailable, LineError, UploadChecker
from api.multipart import MultipartError, MultipartUpload
from api.orm import File, now
from api.repositories import files as files_repo
from api.schemas import FILE_PURPOSES
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
    stream in. A bad line, an empty file, one over ``max_bytes``, a bad form or a missing or bad ``purpose`` stores
    nothing. ``purpose`` is checked before the file's bytes when the client sends it first (as OpenAI's clients do),
    else once they are in."""
    try:
        form.open()
    except MultipartError as err:
        raise InvalidRequest(str(err), param=err.param) from None
    if "purpose" in form.fields:
        _check_purpose(form.fields["purpose"])
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
        purpose = _check_purpose(form.fields.get("purpose"))
        row = File(
            id=file_id,
            tenant_id=tenant.id,
            filename=filename or "upload.jsonl",
            purpose=purpose,
            bytes=size,
            lines=checker.lines,
            storage_key=key,
            created_at=now(),
            deleted=False,
        )
        return files_repo.add(session, row=row)
    except BaseException:
        store.delete(key)  # no row: leave no orphan object
        raise


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


def open_content(*, session: Session, store: ArtifactStore, tenant: Caller, file_id: str) -> tuple[File, BinaryIO]:
    """The file's row and an open stream over its bytes (the caller closes it)."""
    row = get(session=session, tenant=tenant, file_id=file_id)
    try:
        return row, store.open(row.storage_key)
    except ArtifactNotFound:
        log.error("file %s has a row but no stored object at %s", row.id, row.storage_key)
        raise NotFound("file content", file_id, param="file_id") from None

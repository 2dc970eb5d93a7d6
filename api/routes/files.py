"""``/v1/files``: upload, list, retrieve, delete and download datasets (and the result files jobs write)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, BinaryIO, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from api.deps import SessionDep, SettingsDep, StoreDep, TenantDep
from api.errors import InvalidRequest, responses
from api.multipart import MultipartError, MultipartUpload, boundary_of, request_chunks
from api.schemas import (
    FILE_EXPIRY_MAX_SECONDS,
    FILE_EXPIRY_MIN_SECONDS,
    FILE_PURPOSES,
    CursorListObject,
    FileDeleted,
    FileObject,
    cursor_list,
)
from api.services import files as files_service

router = APIRouter(prefix="/v1/files", tags=["files"])

CHUNK_BYTES = 1 << 20

# A list's cursor: the id of the last object of the previous page (an empty one names no object: a 400).
AfterCursor = Annotated[str | None, Query(min_length=1, description="the id of the last object of the previous page")]


def stream(fh: BinaryIO) -> Iterator[bytes]:
    """Yield a stored object in chunks, closing it at the end (or when the client goes away)."""
    try:
        while chunk := fh.read(CHUNK_BYTES):
            yield chunk
    finally:
        fh.close()


def attachment(filename: str) -> str:
    """A Content-Disposition value safe for any file name (headers are latin-1; RFC 6266 ``filename*``)."""
    fallback = "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in filename)
    return f"attachment; filename=\"{fallback or 'download'}\"; filename*=UTF-8''{quote(filename, safe='')}"


# The form the upload takes, as OpenAI documents it; the route reads the body itself (api.multipart) so that the
# file streams to the store as it arrives, hence the schema is given here rather than derived from parameters.
UPLOAD_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "title": "FileUpload",
                "properties": {
                    "file": {"type": "string", "contentMediaType": "application/octet-stream", "title": "File"},
                    "purpose": {"type": "string", "enum": list(FILE_PURPOSES), "title": "Purpose"},
                    # OpenAI's `expires_after` {anchor, seconds}, in the brackets its clients send a nested field in
                    "expires_after[anchor]": {"type": "string", "enum": ["created_at"], "title": "Expiry anchor"},
                    "expires_after[seconds]": {
                        "type": "integer",
                        "minimum": FILE_EXPIRY_MIN_SECONDS,
                        "maximum": FILE_EXPIRY_MAX_SECONDS,
                        "title": "Seconds after the anchor when the file is deleted",
                    },
                },
                "required": ["file", "purpose"],
            }
        }
    },
}


@router.post(
    "",
    response_model=FileObject,
    responses=responses(507),
    summary="Upload a JSONL dataset",
    openapi_extra={"requestBody": UPLOAD_BODY},
)
def create_file(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    store: StoreDep,
    tenant: TenantDep,
) -> FileObject:
    try:
        form = MultipartUpload(request_chunks(request), boundary_of(request.headers.get("content-type")))
        row = files_service.upload(
            session=session, store=store, tenant=tenant, form=form, max_bytes=settings.max_upload_bytes
        )
    except MultipartError as err:
        raise InvalidRequest(str(err), param=err.param) from None
    except ClientDisconnect:  # nobody is left to answer (the guard's 413 for a body past the limit went out)
        raise InvalidRequest("the client went away before the upload ended", param="file") from None
    return FileObject.from_row(row)


@router.get("", response_model=CursorListObject[FileObject], summary="List files")
def list_files(
    session: SessionDep,
    tenant: TenantDep,
    after: AfterCursor = None,
    limit: Annotated[int, Query(ge=1, le=files_service.MAX_LIST_LIMIT)] = files_service.MAX_LIST_LIMIT,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> CursorListObject[FileObject]:
    rows, has_more = files_service.page(
        session=session, tenant=tenant, purpose=purpose, after=after, limit=limit, order=order
    )
    return CursorListObject[FileObject](**cursor_list([FileObject.from_row(r) for r in rows], has_more=has_more))


@router.get("/{file_id}", response_model=FileObject, summary="Retrieve a file")
def retrieve_file(file_id: str, session: SessionDep, tenant: TenantDep) -> FileObject:
    return FileObject.from_row(files_service.get(session=session, tenant=tenant, file_id=file_id))


@router.delete("/{file_id}", response_model=FileDeleted, summary="Delete a file")
def delete_file(file_id: str, session: SessionDep, store: StoreDep, tenant: TenantDep) -> FileDeleted:
    row = files_service.delete(session=session, store=store, tenant=tenant, file_id=file_id)
    return FileDeleted(id=row.id, deleted=True)


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
    summary="Download a file's bytes",
)
def file_content(file_id: str, session: SessionDep, store: StoreDep, tenant: TenantDep) -> StreamingResponse:
    row, fh = files_service.open_content(session=session, store=store, tenant=tenant, file_id=file_id)
    return StreamingResponse(
        stream(fh),
        media_type="application/octet-stream",
        headers={"content-disposition": attachment(row.filename)},
    )

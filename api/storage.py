"""The artifact store: datasets, checkpoints and adapters as objects under '/'-separated keys.

Two backends behind one interface: a local folder (the embedded default) and an S3-compatible bucket
(`PROXIMA_ARTIFACTS=s3://bucket/prefix`). Writes stream and are atomic in both: a reader sees the previous
object or the complete new one, never a partial one, and a failed or oversized write leaves nothing behind.

Keys are relative paths such as `files/file-abc.jsonl`. A *prefix* names a folder of keys: `list("jobs/x")`
returns the keys under `jobs/x/`, never `jobs/xy/...`, so deleting one job's artifacts cannot touch another's.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import io
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast
from urllib.parse import unquote, urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

DEFAULT_CHUNK_SIZE = 1 << 20
# S3 rejects parts under 5 MiB except the last one; 8 MiB parts allow objects up to 80 GB (10,000 parts).
MIN_PART_SIZE = 5 << 20
DEFAULT_PART_SIZE = 8 << 20


class StorageError(Exception):
    """Any failure of the artifact store."""


class NotFound(StorageError):
    """The key holds no object."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no artifact at {key!r}")
        self.key = key


class TooLarge(StorageError):
    """A write went past its `max_bytes`; nothing was stored."""

    def __init__(self, key: str, max_bytes: int) -> None:
        super().__init__(f"artifact {key!r} exceeds the limit of {max_bytes} bytes")
        self.key = key
        self.max_bytes = max_bytes


class StoreFull(StorageError):
    """The store has no room (ENOSPC, EDQUOT, or the backend's equivalent); nothing was stored."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the artifact store is full: {key!r} was not stored")
        self.key = key


# errno values of a file system with no room left for this write (ENOSPC: no space; EDQUOT: over a quota).
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT}
# S3 error codes meaning the same: MinIO's disk or bucket quota, and the generic quota names of other providers.
_S3_NO_ROOM = {"XMinioStorageFull", "XMinioAdminBucketQuotaExceeded", "StorageFull", "QuotaExceeded"}


@dataclass(frozen=True)
class StoredObject:
    """One object as a listing sees it: its key and when it was last written (unix seconds)."""

    key: str
    modified: float


def validate_key(key: str) -> str:
    """Return `key` if it is a safe relative '/'-separated path, else raise ValueError.

    Segments may not be empty, '.', '..' or start with '.', which is reserved for temporary files.
    """
    if not isinstance(key, str) or not key:
        raise ValueError("artifact key must be a non-empty string")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"artifact key must be a relative '/'-separated path: {key!r}")
    for part in key.split("/"):
        if not part or part.startswith("."):
            raise ValueError(f"artifact key has an empty, '.' or '..' segment or one starting with '.': {key!r}")
    return key


def _normalize_prefix(prefix: str) -> str:
    """'' for the whole store, else the folder prefix validated and without a trailing '/'."""
    stripped = prefix.rstrip("/")
    return validate_key(stripped) if stripped else ""


def _iter_source(chunks: Iterable[bytes] | BinaryIO, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Iterator[bytes]:
    # A file object is also an iterable of *lines*; read it in fixed-size blocks instead.
    if hasattr(chunks, "read"):
        reader = cast(BinaryIO, chunks)
        while block := reader.read(chunk_size):
            yield block
    else:
        for chunk in chunks:
            if chunk:
                yield bytes(chunk)  # no copy for bytes; accepts bytearray and memoryview


def _limited(chunks: Iterable[bytes] | BinaryIO, key: str, max_bytes: int | None) -> Iterator[bytes]:
    """Yield the source's chunks, raising TooLarge before yielding the one that passes `max_bytes`."""
    total = 0
    for chunk in _iter_source(chunks):
        total += len(chunk)
        if max_bytes is not None and total > max_bytes:
            raise TooLarge(key, max_bytes)
        yield chunk


def _write_atomically(path: Path, chunks: Iterable[bytes]) -> int:
    """Write `chunks` to a temporary file beside `path`, then rename it over `path`; return the byte count."""
    for attempt in range(3):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            break
        except FileNotFoundError:  # a concurrent delete_prefix pruned the folder between the two calls
            if attempt == 2:
                raise
    tmp = Path(tmp_name)
    written = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                written += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return written


class ArtifactStore(abc.ABC):
    """Objects under '/'-separated keys; see the module docstring for the guarantees."""

    @abc.abstractmethod
    def put_stream(self, key: str, chunks: Iterable[bytes] | BinaryIO, *, max_bytes: int | None = None) -> int:
        """Store the bytes of `chunks` (an iterable of bytes or a binary file) at `key`; return the byte count.

        Raises TooLarge as soon as more than `max_bytes` have been read, leaving nothing stored.
        """

    @abc.abstractmethod
    def open(self, key: str) -> BinaryIO:
        """A binary stream over the object; the caller closes it. Raises NotFound."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored at `key`."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes. Raises NotFound."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing one is not an error."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """The sorted keys under the folder `prefix` ('' for all)."""

    @abc.abstractmethod
    def list_modified(self, prefix: str = "") -> Sequence[StoredObject]:
        """The objects under the folder `prefix` with their last-write times, sorted by key."""

    @abc.abstractmethod
    def clean_temporaries(self, *, older_than: float) -> int:
        """Remove what writes that never finished left behind (a killed process's temporary files, unfinished
        multipart uploads) when it was started before `older_than` (unix seconds); return how many were removed.
        A write still in progress is younger than any sensible grace period, so it is never touched."""

    def put_bytes(self, key: str, data: bytes) -> int:
        """Store `data` at `key`."""
        return self.put_stream(key, [data])

    def put_file(self, key: str, path: Path) -> int:
        """Store the contents of the local file `path` at `key`."""
        with Path(path).open("rb") as f:
            return self.put_stream(key, f)

    def get_bytes(self, key: str) -> bytes:
        """The whole object in memory; for small objects only. Raises NotFound."""
        with self.open(key) as f:
            return f.read()

    def iter_chunks(self, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Iterator[bytes]:
        """Stream the object in blocks of at most `chunk_size` bytes. Raises NotFound on the first `next`."""
        with self.open(key) as f:
            while block := f.read(chunk_size):
                yield block

    def get_to_path(self, key: str, path: Path) -> int:
        """Copy the object to the local file `path` (atomically); return the byte count. Raises NotFound."""
        with self.open(key) as f:
            return _write_atomically(Path(path), _iter_source(f))

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under the folder `prefix`; return how many were removed."""
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)


class LocalStore(ArtifactStore):
    """Objects as files under `root`; writes go to a temporary file in the same folder, then `os.replace`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """The file that holds (or would hold) `key`."""
        return self.root.joinpath(*validate_key(key).split("/"))

    def put_stream(self, key: str, chunks: Iterable[bytes] | BinaryIO, *, max_bytes: int | None = None) -> int:
        target = self.path(key)
        try:
            return _write_atomically(target, _limited(chunks, key, max_bytes))
        except (NotADirectoryError, FileExistsError) as e:
            # A key's folder part is already an object (e.g. `a` then `a/b`): a conflict a folder cannot hold.
            raise StorageError(f"cannot store {key!r}: part of its path is an object") from e
        except OSError as e:
            if e.errno in _NO_ROOM:  # the temporary file is already gone (_write_atomically removes it)
                raise StoreFull(key) from e
            raise

    def open(self, key: str) -> BinaryIO:
        try:
            return self.path(key).open("rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(key) from None

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def size(self, key: str) -> int:
        path = self.path(key)
        if not path.is_file():
            raise NotFound(key)
        return path.stat().st_size

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self.path(key).unlink()

    def list(self, prefix: str = "") -> list[str]:
        folder_key = _normalize_prefix(prefix)
        folder = self.root.joinpath(*folder_key.split("/")) if folder_key else self.root
        if not folder.is_dir():
            return []
        keys = []
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root)
            for name in filenames:
                if not name.startswith("."):  # temporary files of writes in progress
                    keys.append((rel / name).as_posix())
        return sorted(keys)

    def list_modified(self, prefix: str = "") -> Sequence[StoredObject]:
        found = []
        for key in self.list(prefix):
            with contextlib.suppress(FileNotFoundError):  # deleted since the listing
                found.append(StoredObject(key, self.path(key).stat().st_mtime))
        return found

    def clean_temporaries(self, *, older_than: float) -> int:
        removed = 0
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                # _write_atomically's temporaries: ".{object name}.{random}.tmp" beside the object
                if name.startswith(".") and name.endswith(".tmp"):
                    path = Path(dirpath) / name
                    with contextlib.suppress(FileNotFoundError):
                        if path.stat().st_mtime < older_than:
                            path.unlink()
                            removed += 1
        return removed

    def delete_prefix(self, prefix: str) -> int:
        removed = super().delete_prefix(prefix)
        folder_key = _normalize_prefix(prefix)
        if folder_key:
            # Prune the folders left empty, deepest first; one that a concurrent write refilled stays.
            folder = self.root.joinpath(*folder_key.split("/"))
            for dirpath, _, _ in sorted(os.walk(folder), key=lambda entry: -len(entry[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
        return removed


class _BodyReader(io.RawIOBase):
    """Adapts botocore's StreamingBody to a raw stream, so callers get a real buffered file object."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


def _error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


class S3Store(ArtifactStore):
    """Objects in an S3-compatible bucket under `prefix`, uploaded in parts of `part_size` bytes.

    An object smaller than one part is sent with one PUT; a larger one with a multipart upload that is
    aborted on any failure (TooLarge included), so no object and no stray parts remain. S3 makes the object
    visible only when the upload completes, which gives the same atomicity as the local store.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        part_size: int = DEFAULT_PART_SIZE,
    ) -> None:
        if not bucket:
            raise ValueError("S3 bucket name is empty")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum part size)")
        self.bucket = bucket
        self.prefix = _normalize_prefix(prefix)
        self.part_size = part_size
        self.endpoint_url = endpoint_url
        # Without keys, boto3's usual chain applies (environment, config files, instance role).
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            # Path-style addressing is what MinIO, Ceph and moto expect behind a custom endpoint.
            config=Config(s3={"addressing_style": "path" if endpoint_url else "auto"}, retries={"mode": "standard"}),
        )

    def __repr__(self) -> str:
        return f"S3Store(bucket={self.bucket!r}, prefix={self.prefix!r}, endpoint_url={self.endpoint_url!r})"

    def _object_key(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """Turn botocore's errors into NotFound or StorageError."""
        try:
            yield
        except ClientError as e:
            if _error_code(e) in ("NoSuchKey", "404", "NotFound"):
                raise NotFound(key) from None
            if _error_code(e) in _S3_NO_ROOM:
                raise StoreFull(key) from e
            raise StorageError(f"S3 request for {key!r} in bucket {self.bucket!r} failed: {e}") from e
        except BotoCoreError as e:
            raise StorageError(f"S3 request for {key!r} in bucket {self.bucket!r} failed: {e}") from e

    def put_stream(self, key: str, chunks: Iterable[bytes] | BinaryIO, *, max_bytes: int | None = None) -> int:
        object_key = self._object_key(key)
        source = _limited(chunks, key, max_bytes)
        buffer = bytearray()
        written = 0
        # Read until one full part is buffered: a smaller object never starts a multipart upload.
        for chunk in source:
            buffer += chunk
            written += len(chunk)
            if len(buffer) >= self.part_size:
                break
        else:
            with self._errors(key):
                self.client.put_object(Bucket=self.bucket, Key=object_key, Body=bytes(buffer))
            return written

        with self._errors(key):
            upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=object_key)["UploadId"]
        parts: list[dict[str, Any]] = []

        def send(data: bytes) -> None:
            number = len(parts) + 1
            with self._errors(key):
                response = self.client.upload_part(
                    Bucket=self.bucket, Key=object_key, UploadId=upload_id, PartNumber=number, Body=data
                )
            parts.append({"PartNumber": number, "ETag": response["ETag"]})

        try:
            while True:
                while len(buffer) >= self.part_size:
                    send(bytes(buffer[: self.part_size]))
                    del buffer[: self.part_size]
                more = next(source, None)
                if more is None:
                    break
                buffer += more
                written += len(more)
            if buffer:
                send(bytes(buffer))
            with self._errors(key):
                self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=object_key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
        except BaseException:
            # Best effort: the original error matters more than a failed abort (a bucket lifecycle rule for
            # incomplete uploads is the backstop).
            with contextlib.suppress(ClientError, BotoCoreError):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=object_key, UploadId=upload_id)
            raise
        return written

    def open(self, key: str) -> BinaryIO:
        with self._errors(key):
            response = self.client.get_object(Bucket=self.bucket, Key=self._object_key(key))
        return io.BufferedReader(_BodyReader(response["Body"]), buffer_size=DEFAULT_CHUNK_SIZE)

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except NotFound:
            return False
        return True

    def size(self, key: str) -> int:
        with self._errors(key):
            response = self.client.head_object(Bucket=self.bucket, Key=self._object_key(key))
        return int(response["ContentLength"])

    def delete(self, key: str) -> None:
        with self._errors(key):
            self.client.delete_object(Bucket=self.bucket, Key=self._object_key(key))

    def _s3_prefix(self, prefix: str) -> str:
        folder_key = _normalize_prefix(prefix)
        full = "/".join(p for p in (self.prefix, folder_key) if p)
        return f"{full}/" if full else ""

    def _list_objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        paginator = self.client.get_paginator("list_objects_v2")
        with self._errors(prefix):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._s3_prefix(prefix)):
                yield from page.get("Contents", [])

    def _list_object_keys(self, prefix: str) -> Iterator[str]:
        return (item["Key"] for item in self._list_objects(prefix))

    def list(self, prefix: str = "") -> list[str]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        return sorted(object_key[strip:] for object_key in self._list_object_keys(prefix))

    def list_modified(self, prefix: str = "") -> Sequence[StoredObject]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        found = [
            StoredObject(item["Key"][strip:], item["LastModified"].timestamp()) for item in self._list_objects(prefix)
        ]
        return sorted(found, key=lambda o: o.key)

    def clean_temporaries(self, *, older_than: float) -> int:
        """Abort the unfinished multipart uploads under this store's prefix (their parts are billed and invisible)."""
        removed = 0
        paginator = self.client.get_paginator("list_multipart_uploads")
        with self._errors(self.prefix or "/"):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._s3_prefix("")):
                for upload in page.get("Uploads", []):
                    if upload["Initiated"].timestamp() < older_than:
                        with contextlib.suppress(ClientError):  # finished or aborted since the listing
                            self.client.abort_multipart_upload(
                                Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                            )
                            removed += 1
        return removed

    def delete_prefix(self, prefix: str) -> int:
        object_keys = list(self._list_object_keys(prefix))
        for start in range(0, len(object_keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in object_keys[start : start + 1000]]
            with self._errors(prefix):
                response = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if response.get("Errors"):
                first = response["Errors"][0]
                raise StorageError(f"S3 could not delete {first.get('Key')!r}: {first.get('Message')}")
        return len(object_keys)


def store_from_url(
    url: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
) -> ArtifactStore:
    """`s3://bucket/prefix` gives an S3Store; `file:///path` or a plain folder path gives a LocalStore."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"S3 artifact URL needs a bucket: {url!r} (expected s3://bucket/prefix)")
        return S3Store(
            parsed.netloc,
            parsed.path.strip("/"),
            endpoint_url=endpoint_url,
            region=region,
            access_key=access_key,
            secret_key=secret_key,
        )
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URL must name a local path: {url!r}")
        return LocalStore(Path(unquote(parsed.path)))
    if parsed.scheme and len(parsed.scheme) > 1:  # one letter is a Windows drive, not a scheme
        raise ValueError(f"unsupported artifact store URL scheme {parsed.scheme!r} in {url!r}")
    return LocalStore(Path(url))

"""The artifact store: LocalStore on a temporary folder and S3Store against moto's S3 server over real HTTP."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import pytest
from moto.server import ThreadedMotoServer

from api.storage import (
    DEFAULT_PART_SIZE,
    MIN_PART_SIZE,
    ArtifactStore,
    LocalStore,
    NotFound,
    S3Store,
    StorageError,
    StoreFull,
    TooLarge,
    store_from_url,
)

BUCKET = "proxima-test"
CREDENTIALS: dict[str, str | None] = {"region": "us-east-1", "access_key": "testing", "secret_key": "testing"}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on a free port of 127.0.0.1, with one bucket."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    raw_client(endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


def raw_client(endpoint: str) -> Any:
    """A plain boto3 client, to look at the bucket behind the store's back."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def make_s3(prefix: str, endpoint: str | None, part_size: int = DEFAULT_PART_SIZE, bucket: str = BUCKET) -> S3Store:
    return S3Store(
        bucket,
        prefix,
        endpoint_url=endpoint,
        region="us-east-1",
        access_key="testing",
        secret_key="testing",
        part_size=part_size,
    )


@pytest.fixture
def local_store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture
def s3_store(s3_endpoint: str) -> S3Store:
    # A fresh prefix per test keeps tests apart in the one bucket; the smallest part size keeps multipart cheap.
    return make_s3(f"tests/{uuid.uuid4().hex}", s3_endpoint, part_size=MIN_PART_SIZE)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest) -> ArtifactStore:
    return request.getfixturevalue(f"{request.param}_store")  # type: ignore[no-any-return]


def payload(n: int, seed: int = 0) -> bytes:
    """`n` deterministic pseudo-random bytes (incompressible, so no backend can cheat on size)."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


def in_chunks(data: bytes, size: int) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


class TestRoundTrip:
    def test_put_bytes_then_every_read_path_returns_the_same_bytes(self, store: ArtifactStore, tmp_path: Path) -> None:
        data = payload(3000)
        assert store.put_bytes("files/file-1.jsonl", data) == 3000

        assert store.exists("files/file-1.jsonl")
        assert store.size("files/file-1.jsonl") == 3000
        with store.open("files/file-1.jsonl") as f:
            assert f.read() == data
        assert store.get_bytes("files/file-1.jsonl") == data
        chunks = list(store.iter_chunks("files/file-1.jsonl", chunk_size=1024))
        assert [len(c) for c in chunks] == [1024, 1024, 952]
        assert b"".join(chunks) == data
        dest = tmp_path / "out" / "nested" / "copy.bin"
        assert store.get_to_path("files/file-1.jsonl", dest) == 3000
        assert dest.read_bytes() == data
        assert sorted(p.name for p in dest.parent.iterdir()) == ["copy.bin"]  # no temporary file left

    def test_put_stream_reads_a_file_object_in_blocks_not_lines(self, store: ArtifactStore) -> None:
        data = b"".join(b'{"prompt": "%d"}\n' % i for i in range(500))
        assert store.put_stream("files/lines.jsonl", io.BytesIO(data)) == len(data)
        assert store.get_bytes("files/lines.jsonl") == data

    def test_put_file_stores_the_file_contents(self, store: ArtifactStore, tmp_path: Path) -> None:
        src = tmp_path / "adapter.tar.gz"
        src.write_bytes(payload(10_000, seed=1))
        assert store.put_file("jobs/ftjob-1/adapter.tar.gz", src) == 10_000
        assert store.get_bytes("jobs/ftjob-1/adapter.tar.gz") == src.read_bytes()

    def test_empty_object_round_trips(self, store: ArtifactStore) -> None:
        assert store.put_stream("empty", iter([])) == 0
        assert store.exists("empty")
        assert store.size("empty") == 0
        assert store.get_bytes("empty") == b""

    def test_put_overwrites_an_existing_object(self, store: ArtifactStore) -> None:
        store.put_bytes("k", b"old contents")
        store.put_bytes("k", b"new")
        assert store.get_bytes("k") == b"new"
        assert store.size("k") == 3

    def test_large_stream_in_odd_chunks_round_trips(self, store: ArtifactStore) -> None:
        # Over two S3 parts of 5 MiB, so the S3 store really goes through a multipart upload with a short last part.
        data = payload(2 * MIN_PART_SIZE + 123_457, seed=2)
        assert store.put_stream("ckpt/big.bin", in_chunks(data, 700_001), max_bytes=len(data)) == len(data)
        assert store.size("ckpt/big.bin") == len(data)
        got = hashlib.sha256()
        for chunk in store.iter_chunks("ckpt/big.bin"):
            assert len(chunk) <= 1 << 20
            got.update(chunk)
        assert got.hexdigest() == hashlib.sha256(data).hexdigest()


class TestMissingAndBadKeys:
    def test_missing_key_raises_not_found_on_every_read(self, store: ArtifactStore, tmp_path: Path) -> None:
        assert not store.exists("no/such/key")
        with pytest.raises(NotFound):
            store.open("no/such/key")
        with pytest.raises(NotFound):
            store.size("no/such/key")
        with pytest.raises(NotFound):
            next(store.iter_chunks("no/such/key"))
        with pytest.raises(NotFound):
            store.get_to_path("no/such/key", tmp_path / "x")
        assert not (tmp_path / "x").exists()

    def test_a_folder_of_keys_is_not_an_object(self, store: ArtifactStore) -> None:
        store.put_bytes("jobs/ftjob-1/a", b"x")
        assert not store.exists("jobs/ftjob-1")
        with pytest.raises(NotFound):
            store.open("jobs/ftjob-1")

    def test_not_found_is_a_storage_error_naming_the_key(self, store: ArtifactStore) -> None:
        with pytest.raises(StorageError, match="missing-key"):
            store.size("missing-key")

    def test_delete_is_idempotent(self, store: ArtifactStore) -> None:
        store.put_bytes("a/b", b"1")
        store.delete("a/b")
        store.delete("a/b")
        store.delete("never/was")
        assert not store.exists("a/b")

    @pytest.mark.parametrize(
        "key", ["", "/etc/passwd", "../escape", "a/../../b", "a/./b", "a//b", "a/", ".hidden", "a/.b", "a\\b", "a\x00b"]
    )
    def test_unsafe_key_is_rejected_by_every_method(self, store: ArtifactStore, key: str, tmp_path: Path) -> None:
        for call in (
            lambda: store.put_bytes(key, b"x"),
            lambda: store.put_stream(key, [b"x"]),
            lambda: store.open(key),
            lambda: store.exists(key),
            lambda: store.size(key),
            lambda: store.delete(key),
            lambda: store.get_to_path(key, tmp_path / "out"),
        ):
            with pytest.raises(ValueError):
                call()
        assert store.list("") == []

    @pytest.mark.parametrize("prefix", ["../x", "/abs", "a//b"])
    def test_unsafe_prefix_is_rejected(self, store: ArtifactStore, prefix: str) -> None:
        with pytest.raises(ValueError):
            store.list(prefix)
        with pytest.raises(ValueError):
            store.delete_prefix(prefix)


class TestListAndDeletePrefix:
    KEYS = ("files/file-1.jsonl", "jobs/ftjob-1/adapter.tar.gz", "jobs/ftjob-1/ckpt/5/state.pt", "jobs/ftjob-10/x")

    def test_list_is_sorted_and_scoped_to_a_folder(self, store: ArtifactStore) -> None:
        for key in reversed(self.KEYS):
            store.put_bytes(key, b"x")
        assert store.list() == list(self.KEYS)
        assert store.list("") == list(self.KEYS)
        # `jobs/ftjob-1` is a folder: `jobs/ftjob-10/...` is not under it.
        assert store.list("jobs/ftjob-1") == ["jobs/ftjob-1/adapter.tar.gz", "jobs/ftjob-1/ckpt/5/state.pt"]
        assert store.list("jobs/ftjob-1/") == store.list("jobs/ftjob-1")
        assert store.list("jobs/ftjob-1/ckpt") == ["jobs/ftjob-1/ckpt/5/state.pt"]
        assert store.list("jobs/ftjob") == []
        assert store.list("nothing/here") == []

    def test_delete_prefix_removes_only_that_folder(self, store: ArtifactStore) -> None:
        for key in self.KEYS:
            store.put_bytes(key, b"x")
        assert store.delete_prefix("jobs/ftjob-1") == 2
        assert store.list() == ["files/file-1.jsonl", "jobs/ftjob-10/x"]
        assert store.delete_prefix("jobs/ftjob-1") == 0
        assert store.delete_prefix("") == 2
        assert store.list() == []


class TestLimitsAndFailures:
    def test_exactly_max_bytes_is_accepted(self, store: ArtifactStore) -> None:
        assert store.put_stream("k", [b"abcd", b"ef"], max_bytes=6) == 6
        assert store.get_bytes("k") == b"abcdef"

    def test_over_max_bytes_raises_too_large_and_stores_nothing(self, store: ArtifactStore) -> None:
        with pytest.raises(TooLarge) as info:
            store.put_stream("files/big.jsonl", [b"abcd", b"efg"], max_bytes=6)
        assert info.value.max_bytes == 6
        assert isinstance(info.value, StorageError)
        assert not store.exists("files/big.jsonl")
        assert store.list() == []

    def test_too_large_stops_reading_the_source_at_the_limit(self, store: ArtifactStore) -> None:
        consumed = 0

        def endless() -> Iterator[bytes]:
            nonlocal consumed
            while consumed < 1000:  # a bound so that a broken store fails the test instead of hanging it
                consumed += 1
                yield b"x" * 4

        with pytest.raises(TooLarge):
            store.put_stream("k", endless(), max_bytes=10)
        assert consumed == 3  # 12 bytes > 10: the third chunk is the last one read
        assert not store.exists("k")

    def test_too_large_keeps_the_previous_object(self, store: ArtifactStore) -> None:
        store.put_bytes("k", b"previous")
        with pytest.raises(TooLarge):
            store.put_stream("k", [b"0123456789"], max_bytes=5)
        assert store.get_bytes("k") == b"previous"

    def test_error_in_the_source_propagates_and_keeps_the_previous_object(self, store: ArtifactStore) -> None:
        store.put_bytes("k", b"previous")

        def broken() -> Iterator[bytes]:
            yield b"partial"
            raise RuntimeError("client disconnected")

        with pytest.raises(RuntimeError, match="client disconnected"):
            store.put_stream("k", broken())
        assert store.get_bytes("k") == b"previous"
        assert store.list() == ["k"]


class TestLocalStore:
    def test_objects_are_plain_files_under_the_root(self, local_store: LocalStore) -> None:
        local_store.put_bytes("jobs/ftjob-1/adapter.tar.gz", b"abc")
        assert (local_store.root / "jobs" / "ftjob-1" / "adapter.tar.gz").read_bytes() == b"abc"

    def test_final_path_appears_only_when_the_write_completes(self, local_store: LocalStore) -> None:
        final = local_store.root / "ckpt" / "state.pt"
        checks = 0

        def watched() -> Iterator[bytes]:
            nonlocal checks
            for i in range(5):
                yield b"%d" % i * 1000
                # Back here the store has written chunk i: it must sit in a temporary file beside the target.
                assert not final.exists()
                assert not local_store.exists("ckpt/state.pt")
                assert local_store.list() == []
                temps = [p.name for p in final.parent.iterdir()]
                assert len(temps) == 1 and temps[0].startswith(".state.pt."), temps
                checks += 1

        assert local_store.put_stream("ckpt/state.pt", watched()) == 5000
        assert checks == 5
        assert final.stat().st_size == 5000
        assert [p.name for p in final.parent.iterdir()] == ["state.pt"]

    def test_readers_see_the_old_object_until_an_overwrite_completes(self, local_store: LocalStore) -> None:
        old = payload(4096, seed=3)
        new = payload(8192, seed=4)
        local_store.put_bytes("k", old)

        def watched() -> Iterator[bytes]:
            for chunk in in_chunks(new, 1024):
                yield chunk
                assert local_store.get_bytes("k") == old

        local_store.put_stream("k", watched())
        assert local_store.get_bytes("k") == new

    def test_a_reader_opened_before_an_overwrite_keeps_reading_the_old_object(self, local_store: LocalStore) -> None:
        local_store.put_bytes("k", b"A" * 10_000)
        with local_store.open("k") as reader:
            first = reader.read(10)
            local_store.put_bytes("k", b"B" * 20_000)
            rest = reader.read()
        assert first + rest == b"A" * 10_000

    def test_failed_writes_leave_no_temporary_files(self, local_store: LocalStore) -> None:
        with pytest.raises(TooLarge):
            local_store.put_stream("a/b/too-large", in_chunks(b"x" * 100, 10), max_bytes=50)

        def broken() -> Iterator[bytes]:
            yield b"x"
            raise OSError("disk gone")

        with pytest.raises(OSError, match="disk gone"):
            local_store.put_stream("a/b/broken", broken())
        assert [p for p in local_store.root.rglob("*") if p.is_file()] == []

    def test_key_under_an_existing_object_is_a_storage_error(self, local_store: LocalStore) -> None:
        local_store.put_bytes("a", b"x")
        with pytest.raises(StorageError, match="a/b"):
            local_store.put_bytes("a/b", b"y")
        assert local_store.get_bytes("a") == b"x"

    def test_delete_prefix_prunes_empty_folders(self, local_store: LocalStore) -> None:
        local_store.put_bytes("jobs/ftjob-1/ckpt/5/state.pt", b"x")
        local_store.put_bytes("jobs/ftjob-2/a", b"x")
        local_store.delete_prefix("jobs/ftjob-1")
        assert sorted(p.name for p in (local_store.root / "jobs").iterdir()) == ["ftjob-2"]

    def test_list_ignores_temporary_files_of_writes_in_progress(self, local_store: LocalStore) -> None:
        local_store.put_bytes("files/a", b"x")
        (local_store.root / "files" / ".b.abc123.tmp").write_bytes(b"partial")
        assert local_store.list() == ["files/a"]


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root can mount one here): a real file system that runs out of room."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    assert done.returncode == 0, f"mounting a tmpfs needs root: {done.stderr!r}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        shutil.rmtree(mount, ignore_errors=True)


class TestFullStore:
    def test_a_write_that_finds_no_room_is_store_full_and_leaves_nothing(self, tiny_fs: Path) -> None:
        store = LocalStore(tiny_fs)
        store.put_bytes("files/kept", b"k" * 1000)
        with pytest.raises(StoreFull, match="files/big") as caught:
            store.put_stream("files/big", in_chunks(payload(2 << 20), 64 << 10))
        assert isinstance(caught.value, StorageError)
        assert [p.relative_to(tiny_fs).as_posix() for p in tiny_fs.rglob("*") if p.is_file()] == ["files/kept"]
        store.put_bytes("files/small", b"s")  # the room it freed is usable again
        assert store.get_bytes("files/kept") == b"k" * 1000

    def test_s3_no_room_answers_are_store_full(self, s3_store: S3Store) -> None:
        from botocore.stub import Stubber

        with Stubber(s3_store.client) as stub:
            for code in ("XMinioStorageFull", "QuotaExceeded"):
                stub.add_client_error("put_object", service_error_code=code, http_status_code=507)
                with pytest.raises(StoreFull):
                    s3_store.put_bytes("k", b"x")


class TestCleanupSupport:
    def test_list_modified_gives_each_object_its_write_time(self, store: ArtifactStore) -> None:
        before = time.time()
        store.put_bytes("jobs/a/1", b"x")
        store.put_bytes("jobs/a/2", b"y")
        store.put_bytes("other", b"z")
        listed = store.list_modified("jobs")
        assert [o.key for o in listed] == ["jobs/a/1", "jobs/a/2"]
        assert all(before - 5 <= o.modified <= time.time() + 5 for o in listed)  # S3 keeps whole seconds

    def test_local_temporaries_go_only_past_the_cutoff(self, local_store: LocalStore) -> None:
        local_store.put_bytes("files/a", b"x")
        old, young = local_store.root / "files" / ".b.x1.tmp", local_store.root / "files" / ".c.x2.tmp"
        old.write_bytes(b"partial")
        young.write_bytes(b"partial")
        os.utime(old, (time.time() - 100, time.time() - 100))
        assert local_store.clean_temporaries(older_than=time.time() - 50) == 1
        assert not old.exists() and young.exists()
        assert local_store.list() == ["files/a"]

    def test_s3_unfinished_multipart_uploads_are_aborted(self, s3_store: S3Store, s3_endpoint: str) -> None:
        client = raw_client(s3_endpoint)
        client.create_multipart_upload(Bucket=BUCKET, Key=f"{s3_store.prefix}/files/killed")
        # moto reports every upload as initiated on 2010-11-10, so "too young" is checked with a cutoff before that
        assert s3_store.clean_temporaries(older_than=1e9) == 0
        assert s3_store.clean_temporaries(older_than=time.time() + 5) == 1
        uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=s3_store.prefix).get("Uploads", [])
        assert uploads == []


class TestS3Store:
    def test_objects_live_under_the_prefix_in_the_bucket(self, s3_store: S3Store, s3_endpoint: str) -> None:
        s3_store.put_bytes("files/file-1.jsonl", b"{}\n")
        body = raw_client(s3_endpoint).get_object(Bucket=BUCKET, Key=f"{s3_store.prefix}/files/file-1.jsonl")["Body"]
        assert body.read() == b"{}\n"

    def test_stores_with_different_prefixes_do_not_see_each_other(self, s3_endpoint: str) -> None:
        run = uuid.uuid4().hex
        a = make_s3(f"{run}/a", s3_endpoint)
        ab = make_s3(f"{run}/ab", s3_endpoint)
        a.put_bytes("k", b"a")
        ab.put_bytes("k", b"ab")
        assert a.list() == ["k"]
        assert a.get_bytes("k") == b"a"
        a.delete_prefix("")
        assert ab.get_bytes("k") == b"ab"

    def test_large_upload_is_multipart_with_one_part_per_part_size(self, s3_store: S3Store, s3_endpoint: str) -> None:
        data = payload(2 * MIN_PART_SIZE + 10, seed=5)
        s3_store.put_stream("big", in_chunks(data, 1 << 20))
        head = raw_client(s3_endpoint).head_object(Bucket=BUCKET, Key=f"{s3_store.prefix}/big")
        assert head["ETag"].strip('"').endswith("-3")  # S3's ETag of a 3-part multipart upload
        assert s3_store.get_bytes("big") == data

    def test_small_upload_is_a_single_put(self, s3_store: S3Store, s3_endpoint: str) -> None:
        s3_store.put_bytes("small", payload(MIN_PART_SIZE - 1))
        head = raw_client(s3_endpoint).head_object(Bucket=BUCKET, Key=f"{s3_store.prefix}/small")
        assert "-" not in head["ETag"]

    def test_object_is_invisible_until_the_multipart_upload_completes(self, s3_store: S3Store) -> None:
        checks = 0

        def watched() -> Iterator[bytes]:
            nonlocal checks
            for chunk in in_chunks(payload(2 * MIN_PART_SIZE + 1, seed=6), 1 << 20):
                yield chunk
                assert not s3_store.exists("ckpt")
                checks += 1

        s3_store.put_stream("ckpt", watched())
        assert checks == 11
        assert s3_store.size("ckpt") == 2 * MIN_PART_SIZE + 1

    def test_too_large_after_parts_were_sent_aborts_the_upload(self, s3_store: S3Store, s3_endpoint: str) -> None:
        # 1 MiB chunks with a 5 MiB part: part 1 is uploaded before the 8th MiB passes the 7 MiB limit.
        with pytest.raises(TooLarge):
            s3_store.put_stream("big", in_chunks(payload(3 * MIN_PART_SIZE), 1 << 20), max_bytes=7 << 20)
        client = raw_client(s3_endpoint)
        uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=s3_store.prefix).get("Uploads", [])
        assert uploads == []
        assert not s3_store.exists("big")
        assert client.list_objects_v2(Bucket=BUCKET, Prefix=s3_store.prefix).get("KeyCount") == 0

    def test_source_error_during_multipart_aborts_the_upload(self, s3_store: S3Store, s3_endpoint: str) -> None:
        def broken() -> Iterator[bytes]:
            yield from in_chunks(payload(MIN_PART_SIZE + 1), 1 << 20)
            raise RuntimeError("client disconnected")

        with pytest.raises(RuntimeError, match="client disconnected"):
            s3_store.put_stream("big", broken())
        uploads = raw_client(s3_endpoint).list_multipart_uploads(Bucket=BUCKET, Prefix=s3_store.prefix)
        assert uploads.get("Uploads", []) == []
        assert not s3_store.exists("big")

    def test_open_returns_a_buffered_file_object(self, s3_store: S3Store) -> None:
        s3_store.put_bytes("k", b"line 1\nline 2\n")
        with s3_store.open("k") as f:
            assert isinstance(f, io.BufferedIOBase)
            assert f.readline() == b"line 1\n"
            assert f.read() == b"line 2\n"
        assert f.closed

    def test_missing_bucket_is_a_storage_error(self, s3_endpoint: str) -> None:
        store = make_s3("", s3_endpoint, bucket="no-such-bucket")
        with pytest.raises(StorageError, match="no-such-bucket") as info:
            store.put_bytes("k", b"x")
        assert not isinstance(info.value, NotFound)

    def test_part_size_under_the_s3_minimum_is_rejected(self, s3_endpoint: str) -> None:
        with pytest.raises(ValueError, match="part_size"):
            make_s3("", s3_endpoint, part_size=MIN_PART_SIZE - 1)


class TestStoreFromUrl:
    def test_s3_url_gives_an_s3_store_on_the_endpoint(self, s3_endpoint: str) -> None:
        store = store_from_url(f"s3://{BUCKET}/from-url/{uuid.uuid4().hex}/", endpoint_url=s3_endpoint, **CREDENTIALS)
        assert isinstance(store, S3Store)
        assert store.bucket == BUCKET
        assert store.prefix.startswith("from-url/") and not store.prefix.endswith("/")
        store.put_bytes("k", b"via url")
        assert store.get_bytes("k") == b"via url"

    def test_s3_url_without_a_path_uses_the_bucket_root(self) -> None:
        store = store_from_url("s3://bucket", **CREDENTIALS)
        assert isinstance(store, S3Store)
        assert (store.bucket, store.prefix) == ("bucket", "")

    @pytest.mark.parametrize("url", ["s3://", "s3:///prefix", "ftp://host/x", "s3://bucket/../x"])
    def test_bad_url_is_a_value_error(self, url: str) -> None:
        with pytest.raises(ValueError):
            store_from_url(url)

    def test_plain_path_and_file_url_give_a_local_store(self, tmp_path: Path) -> None:
        plain = store_from_url(str(tmp_path / "plain"))
        assert isinstance(plain, LocalStore) and plain.root == (tmp_path / "plain").resolve()
        via_file = store_from_url((tmp_path / "with space").as_uri())
        assert isinstance(via_file, LocalStore) and via_file.root == (tmp_path / "with space").resolve()
        assert via_file.root.is_dir()

    def test_relative_path_is_resolved_against_the_working_directory(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)
        store = store_from_url("artifacts")
        assert isinstance(store, LocalStore) and store.root == tmp_path.resolve() / "artifacts"
        assert os.path.isabs(store.root)

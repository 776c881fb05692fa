"""S3Storage against real S3 servers over HTTP (each test runs on moto and on versitygw): the
storage protocol's behaviour."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import tracemalloc
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from baton_testing.s3 import S3Bucket

from trainer_sdk.errors import StorageError
from trainer_sdk.storage import Storage, Writer, open_storage
from trainer_sdk.storage.s3 import (
    MAX_PART_SIZE,
    MAX_PARTS,
    MiB,
    S3Config,
    S3Storage,
    first_part_size,
    part_size,
)

# Small parts keep multipart tests fast; 5 MiB is S3's minimum.
SMALL = S3Config(part_size=5 * MiB, max_concurrency=4, read_chunk_size=1 * MiB)


def _payload(n: int) -> bytes:
    return os.urandom(n)


def test_open_storage_routes_s3_uri(s3_bucket: S3Bucket) -> None:
    st = open_storage(s3_bucket.uri("runs/a"))
    assert isinstance(st, S3Storage)
    assert isinstance(st, Storage)
    assert st.uri == f"s3://{s3_bucket.name}/runs/a"
    assert st.bucket == s3_bucket.name
    assert st.prefix == "runs/a"


def test_small_object_is_one_put(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri(), config=SMALL)
    w = st.open_writer("step-1/rank-0.json", size_hint=10)
    assert isinstance(w, Writer)
    w.write(b"hello ")
    w.write(memoryview(b"world"))
    assert not st.exists("step-1/rank-0.json")  # nothing visible before commit
    w.commit()
    assert s3_bucket.get("ckpt/step-1/rank-0.json") == b"hello world"
    assert s3_bucket.multipart_uploads() == []
    assert st.read_bytes("step-1/rank-0.json") == b"hello world"
    assert st.size("step-1/rank-0.json") == 11


def test_empty_object(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri(), config=SMALL)
    w = st.open_writer("empty")
    w.commit()
    assert st.exists("empty")
    assert st.size("empty") == 0
    assert st.read_bytes("empty") == b""


@pytest.mark.parametrize("size_hint", [None, 1, 23 * MiB])
def test_multipart_roundtrip_exact_bytes(s3_bucket: S3Bucket, size_hint: int | None) -> None:
    """Odd write sizes across part boundaries; a wrong or missing hint changes nothing."""
    st = S3Storage.from_uri(s3_bucket.uri(), config=SMALL)
    data = _payload(23 * MiB + 12345)
    w = st.open_writer("step-2/rank-00000-of-00001.safetensors", size_hint=size_hint)
    view = memoryview(data)
    pos = 0
    for i, step in enumerate([1, 777, 3 * MiB + 1, 5 * MiB, 8 * MiB - 3] * 4):
        w.write(view[pos : pos + step] if i % 2 else bytes(view[pos : pos + step]))
        pos += step
        if pos >= len(data):
            break
    w.write(view[pos:])
    assert st.list_dir("step-2") == []  # the upload is not an object yet
    assert len(s3_bucket.multipart_uploads()) == 1
    w.commit()
    got = s3_bucket.get("ckpt/step-2/rank-00000-of-00001.safetensors")
    assert len(got) == len(data)
    assert got == data
    assert s3_bucket.multipart_uploads() == []
    head = s3_bucket.client.head_object(
        Bucket=s3_bucket.name, Key="ckpt/step-2/rank-00000-of-00001.safetensors"
    )
    assert head["ETag"].endswith('-5"')  # 23 MiB in 5 MiB parts: a real multipart object


def test_abort_leaves_nothing(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri(), config=SMALL)
    w = st.open_writer("step-3/shard", size_hint=12 * MiB)
    w.write(_payload(12 * MiB))
    assert len(s3_bucket.multipart_uploads()) == 1
    w.abort()
    w.abort()  # idempotent
    assert s3_bucket.multipart_uploads() == []
    assert not st.exists("step-3/shard")
    with pytest.raises(StorageError, match="after the writer was aborted"):
        w.write(b"x")


def test_write_atomic_replaces_whole(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri(), config=SMALL)
    st.write_atomic("latest", b'{"step": 1}')
    st.write_atomic("latest", b'{"step": 2}')
    assert st.read_bytes("latest") == b'{"step": 2}'


def test_read_into_parallel_ranges_exact(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri(), config=SMALL)
    data = _payload(7 * MiB + 333)
    st.write_atomic("blob", data)
    # Whole object (8 ranged GETs of 1 MiB in parallel), an unaligned middle slice, one byte.
    for offset, length in [(0, len(data)), (12345, 3 * MiB + 17), (len(data) - 1, 1)]:
        out = bytearray(length)
        st.read_into("blob", offset, memoryview(out))
        assert out == data[offset : offset + length]
    # A view with another item size is filled byte-wise.
    words = memoryview(bytearray(4096)).cast("I")
    st.read_into("blob", 8, words)
    assert words.tobytes() == data[8 : 8 + 4096]


def test_read_past_end_is_eof(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri(), config=SMALL)
    st.write_atomic("short", b"0123456789")
    with pytest.raises(EOFError, match="shorter than 12 bytes"):
        st.read_into("short", 5, memoryview(bytearray(7)))
    with pytest.raises(EOFError):
        st.read_into("short", 10, memoryview(bytearray(1)))
    with pytest.raises(EOFError):  # beyond the end, split over parallel ranges
        st.read_into("short", 0, memoryview(bytearray(3 * MiB)))


def test_missing_objects(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri(), config=SMALL)
    assert not st.exists("nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        st.size("nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        st.read_bytes("nope")
    with pytest.raises(FileNotFoundError):
        st.read_into("nope", 0, memoryview(bytearray(4)))
    st.delete("nope")  # missing is fine
    st.delete_tree("nope")


def test_list_dir_paginates(s3_bucket: S3Bucket) -> None:
    """Small pages (3 keys) so that a handful of objects needs several ListObjectsV2 calls."""
    st = S3Storage.from_uri(s3_bucket.uri(), config=S3Config(list_page_size=3))
    names = [f"step-{i:012d}" for i in range(7)]
    for n in names:
        st.write_atomic(f"{n}/manifest.json", b"{}")
    st.write_atomic("latest", b"{}")
    st.write_atomic("step-000000000001/rank-0.json", b"{}")
    # a sibling outside the root must not show up
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="ckpt-other/x", Body=b"")
    assert st.list_dir("") == sorted([*names, "latest"])
    assert st.list_dir("step-000000000001") == ["manifest.json", "rank-0.json"]
    assert st.list_dir("step-000000000001/") == ["manifest.json", "rank-0.json"]
    assert st.list_dir("missing") == []


def test_list_dir_bucket_root(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri(""))
    st.write_atomic("a/b", b"1")
    st.write_atomic("c", b"2")
    assert st.uri == f"s3://{s3_bucket.name}"
    assert st.list_dir("") == ["a", "c"]


def test_delete_tree_batches_and_aborts_uploads(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri(), config=S3Config(part_size=5 * MiB, list_page_size=2))
    for i in range(5):
        st.write_atomic(f"step-7/f{i}", b"x")
    st.write_atomic("step-70/keep", b"x")  # same string prefix, different directory
    st.write_atomic("step-8/keep", b"x")
    # A crashed rank's dangling multipart upload under the tree (never committed).
    w = st.open_writer("step-7/rank-1.safetensors", size_hint=6 * MiB)
    w.write(_payload(6 * MiB))
    assert len(s3_bucket.multipart_uploads()) == 1
    st.delete_tree("step-7")
    assert s3_bucket.keys("ckpt/") == ["ckpt/step-70/keep", "ckpt/step-8/keep"]
    assert s3_bucket.multipart_uploads() == []
    with pytest.raises(ValueError, match="whole checkpoint root"):
        st.delete_tree("")


def test_delete_one(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri())
    st.write_atomic("x/y", b"1")
    st.delete("x/y")
    assert not st.exists("x/y")


def test_missing_bucket_names_the_fix(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(f"s3://{s3_bucket.name}-absent/run", config=SMALL)
    with pytest.raises(StorageError, match="create the bucket or fix BATON_CHECKPOINT_URI"):
        st.write_atomic("latest", b"{}")
    with pytest.raises(StorageError, match="does not exist") as info:
        st.list_dir("")
    assert info.value.__cause__ is not None  # the botocore error stays attached
    w = st.open_writer("big", size_hint=11 * MiB)
    with pytest.raises(StorageError, match="create the bucket"):
        w.write(_payload(6 * MiB))  # the first full part starts the multipart upload
    w.abort()


def test_bad_paths_rejected(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri())
    for bad in ["../x", "/abs", "a//b", "a/./b"]:
        with pytest.raises(ValueError, match="invalid storage path"):
            st.write_atomic(bad, b"")
    with pytest.raises(ValueError, match="not an S3 URI"):
        S3Storage.from_uri("file:///tmp/x")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=r"5 MiB\.\.5 GiB"):
        S3Config(part_size=1 * MiB)
    with pytest.raises(ValueError, match="max_concurrency"):
        S3Config(max_concurrency=0)
    with pytest.raises(ValueError, match="retry_rounds"):
        S3Config(retry_rounds=0)
    with pytest.raises(ValueError, match="list_page_size"):
        S3Config(list_page_size=1001)


def test_part_sizes_fit_s3_limits() -> None:
    cfg = S3Config()
    # Small and unknown sizes use the configured part size.
    assert first_part_size(cfg, None) == cfg.part_size
    assert first_part_size(cfg, 10 * MiB) == cfg.part_size
    for hint in [160 * 1024 * MiB, 1024 * 1024 * MiB, 5 * 1024 * 1024 * MiB]:
        first = first_part_size(cfg, hint)
        assert first % MiB == 0
        assert 5 * MiB <= first <= MAX_PART_SIZE
        covered = sum(part_size(first, n) for n in range(1, MAX_PARTS + 1))
        assert covered >= hint, hint
    # A stream with no hint still fits S3's 5 TiB object limit in 10,000 parts.
    assert sum(part_size(cfg.part_size, n) for n in range(1, MAX_PARTS + 1)) >= 5 * 1024**4
    assert all(part_size(cfg.part_size, n) <= MAX_PART_SIZE for n in range(1, MAX_PARTS + 1))


def test_writer_memory_is_bounded(s3_bucket: S3Bucket) -> None:
    """A 60 MiB stream with 5 MiB parts and 2 buffered parts holds at most 3 parts at once
    (2 in flight + 1 filling): no copy of the object, no copy of a part inside botocore."""
    cfg = S3Config(part_size=5 * MiB, max_concurrency=2)
    st = S3Storage.from_uri(s3_bucket.uri(), config=cfg)
    src = memoryview(_payload(60 * MiB))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        w = st.open_writer("big", size_hint=len(src))
        for pos in range(0, len(src), MiB):
            w.write(src[pos : pos + MiB])
        w.commit()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak <= 3 * 5 * MiB + 2 * MiB, f"peak {peak / MiB:.1f} MiB"
    assert st.size("big") == len(src)


def test_config_from_env() -> None:
    cfg = S3Config.from_env(
        {
            "BATON_S3_PART_SIZE_MIB": "64",
            "BATON_S3_MAX_CONCURRENCY": "4",
            "BATON_S3_READ_TIMEOUT": "2.5",
            "BATON_S3_RETRY_MODE": "adaptive",
            "BATON_S3_MAX_ATTEMPTS": "",  # empty means unset
        }
    )
    assert cfg.part_size == 64 * MiB
    assert cfg.max_concurrency == 4
    assert cfg.read_timeout == 2.5
    assert cfg.retry_mode == "adaptive"
    assert cfg.max_attempts == S3Config().max_attempts
    with pytest.raises(ValueError, match="BATON_S3_MAX_CONCURRENCY='many'"):
        S3Config.from_env({"BATON_S3_MAX_CONCURRENCY": "many"})
    with pytest.raises(ValueError, match="BATON_S3_"):
        S3Config.from_env({"BATON_S3_PART_SIZE_MIB": "1"})
    with pytest.raises(ValueError, match="retry_mode"):
        S3Config.from_env({"BATON_S3_RETRY_MODE": "legacy"})
    assert not S3Config.from_env({}).sign_payload
    assert S3Config.from_env({"BATON_S3_SIGN_PAYLOAD": "true"}).sign_payload
    with pytest.raises(ValueError, match=r"BATON_S3_SIGN_PAYLOAD='maybe' .* flag \(1 or 0\)"):
        S3Config.from_env({"BATON_S3_SIGN_PAYLOAD": "maybe"})


def test_open_storage_reads_env_config(
    s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_S3_PART_SIZE_MIB", "5")
    st = open_storage(s3_bucket.uri())
    assert isinstance(st, S3Storage)
    assert st.config.part_size == 5 * MiB
    w = st.open_writer("x", size_hint=11 * MiB)
    w.write(_payload(11 * MiB))
    w.commit()
    head = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key="ckpt/x")
    assert head["ETag"].endswith('-3"')


def test_multipart_without_checksums(s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """S3-compatible stores that reject CRC32 headers: AWS_REQUEST_CHECKSUM_CALCULATION=
    when_required turns the per-part checksums off, and uploads still work."""
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    st = S3Storage.from_uri(s3_bucket.uri(), config=SMALL)
    assert not st._part_checksums
    data = _payload(11 * MiB)
    w = st.open_writer("plain", size_hint=len(data))
    w.write(data)
    w.commit()
    assert s3_bucket.get("ckpt/plain") == data


@pytest.mark.parametrize(
    ("env", "signed", "crc"),
    [
        ({}, False, True),  # the default: each part's CRC32, in a signed header, no body hash
        ({"BATON_S3_SIGN_PAYLOAD": "1"}, True, True),
        ({"AWS_REQUEST_CHECKSUM_CALCULATION": "when_required"}, True, False),  # never bare
    ],
    ids=["crc-unsigned", "crc-signed", "no-crc-signed"],
)
def test_a_part_body_is_protected_by_its_crc32_or_by_the_signature(
    s3_bucket: S3Bucket,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    signed: bool,
    crc: bool,
) -> None:
    """What each UploadPart sends over http, seen by botocore's before-send hook, and the
    server (moto, versitygw) accepting it: the CRC32 is the SDK's own (ISA-L), the body's
    SHA-256 is in the signature only when asked for or when no CRC32 goes with the body."""
    for var, value in {"BATON_S3_PART_SIZE_MIB": "5", **env}.items():
        monkeypatch.setenv(var, value)
    st = S3Storage.from_uri(s3_bucket.uri(), config=S3Config.from_env())
    sent: dict[int, tuple[bytes, dict[str, str]]] = {}

    def seen(request: Any, **_: Any) -> None:
        number = int(parse_qs(urlsplit(request.url).query)["partNumber"][0])
        headers = {  # a prepared request's values: str, or bytes once signed
            k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()
        }
        sent[number] = bytes(request.body), headers

    st._client.meta.events.register("before-send.s3.UploadPart", seen)
    data = _payload(11 * MiB + 4321)  # three parts
    w = st.open_writer("guarded", size_hint=len(data))
    for off in range(0, len(data), 777_777):
        w.write(data[off : off + 777_777])
    w.commit()
    assert s3_bucket.get("ckpt/guarded") == data
    assert sorted(sent) == [1, 2, 3]  # parts go up in parallel: ordered by number here
    assert b"".join(sent[n][0] for n in sorted(sent)) == data
    for body, headers in sent.values():
        want_crc = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
        assert headers.get("x-amz-checksum-crc32") == (want_crc if crc else None)
        want_sha = hashlib.sha256(body).hexdigest() if signed else "UNSIGNED-PAYLOAD"
        assert headers["x-amz-content-sha256"] == want_sha


def test_abort_after_commit_keeps_the_object(s3_bucket: S3Bucket) -> None:
    st = S3Storage.from_uri(s3_bucket.uri(), config=SMALL)
    data = _payload(6 * MiB)
    w = st.open_writer("kept", size_hint=len(data))
    w.write(data)
    w.commit()
    w.abort()  # e.g. a cleanup path that always aborts
    assert s3_bucket.get("ckpt/kept") == data
    with pytest.raises(StorageError, match="after the writer was committed"):
        w.commit()


def test_parallel_writers_share_one_storage(s3_bucket: S3Bucket) -> None:
    """Several shards written at once from threads through one S3Storage (one client)."""
    st = S3Storage.from_uri(s3_bucket.uri(), config=SMALL)
    blobs = {f"step-1/rank-{i}.safetensors": _payload(7 * MiB + i) for i in range(3)}

    def put(path: str) -> None:
        w = st.open_writer(path, size_hint=len(blobs[path]))
        view = memoryview(blobs[path])
        for pos in range(0, len(view), 2 * MiB):
            w.write(view[pos : pos + 2 * MiB])
        w.commit()

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(put, blobs))
    for path, data in blobs.items():
        assert s3_bucket.get(f"ckpt/{path}") == data
    assert st.list_dir("step-1") == sorted(p.split("/")[1] for p in blobs)


def test_read_into_random_ranges_exact(s3_bucket: S3Bucket) -> None:
    """Random offsets and lengths, split into odd-sized parallel chunks: every byte lands in
    its place (a misplaced chunk of random data cannot compare equal)."""
    cfg = S3Config(read_chunk_size=100_003, max_concurrency=4)
    st = S3Storage.from_uri(s3_bucket.uri(), config=cfg)
    data = _payload(2 * MiB + 11)
    st.write_atomic("blob", data)
    rng = random.Random(4)
    for _ in range(25):
        offset = rng.randrange(len(data))
        length = rng.randrange(1, len(data) - offset + 1)
        out = bytearray(length)
        st.read_into("blob", offset, memoryview(out))
        assert out == data[offset : offset + length], (offset, length)


def test_wrong_secret_names_the_fix(
    versitygw_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real server checks the SigV4 signature (moto accepts any credentials): a wrong secret
    is refused, and the error says which variables to check."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    st = S3Storage.from_uri(versitygw_bucket.uri(), config=SMALL)
    with pytest.raises(StorageError, match="AWS_SECRET_ACCESS_KEY") as info:
        st.write_atomic("latest", b"{}")
    assert "not-the-secret" not in str(info.value)  # never echo credentials
    assert versitygw_bucket.keys() == []

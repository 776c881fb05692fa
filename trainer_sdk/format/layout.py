"""Checkpoint format v5 (v1-v4 still read): names, the manifest schema, and read validation.

Torch-free on purpose: the CLI and external tools can read and check a checkpoint without
torch. Everything a manifest (or a shard header) says is validated here before any byte it
names is read: file names must be plain names matching :data:`FILE_RE` (no ``..``, no ``/``,
no absolute paths), sizes and offsets must be consistent, and JSON and headers are bounded.
A manifest that fails any check raises :class:`~trainer_sdk.errors.ManifestError`.

Why one module of this size: the format's names, its schema and the checks that guard every
read must change together (a field added without its check is a hole), and the CLI needs all
of them without torch.

Layout (see ``docs/format.md``)::

    <uri>/step-000000001200/rank-00000-of-00004.safetensors   tensors this rank wrote
    <uri>/step-000000001200/rank-00000-of-00004.json          this rank's JSON tree
    <uri>/step-000000001200/manifest.json                     written last by rank 0: the commit
    <uri>/latest                                              {"step": 1200}, a hint
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from xxhash import xxh3_64_intdigest

from trainer_sdk._crc import crc32
from trainer_sdk.errors import ManifestError, UnsupportedFormatError

__all__ = [
    "BLOCK_HASH_VERSIONS",
    "BLOCK_SIZE",
    "DIGESTS",
    "DTYPE_SIZES",
    "FILE_RE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BYTES",
    "PLAIN_VERSION",
    "REFERENCES_VERSION",
    "REF_RE",
    "SHARD_DIGEST",
    "STEP_DIR_RE",
    "FileEntry",
    "Hasher",
    "Kind",
    "Manifest",
    "Piece",
    "SafetensorsHeader",
    "TensorEntry",
    "block_count",
    "block_sum",
    "block_sums_from_json",
    "block_sums_to_json",
    "check_header_matches",
    "check_name",
    "file_path",
    "header_length",
    "json_name",
    "lowest_version",
    "new_hasher",
    "parse_latest",
    "parse_safetensors_header",
    "parse_step_dir",
    "ref_key",
    "shard_name",
    "step_dir",
]

FORMAT_NAME: Final = "baton-checkpoint"
FORMAT_VERSION: Final = 5
"""The newest format version, which this Baton writes and reads (with every older one); a
newer one is an UnsupportedFormatError. v2 recorded a shard's whole-file digest as BLAKE3
(``blake3``) instead of sha256: about a quarter of sha256's CPU time; v1 checkpoints (sha256
for every file) are still read. v3 = v2 + references: a ``files`` entry may name a shard
committed by an earlier step of the same root (``"step": S``, key
``step-SSSSSSSSSSSS/rank-…safetensors``) instead of a file of this step. v4 = v3 + the
``xxh3_128`` digest (XXH3-128, 32 hex digits), which this Baton records for every shard: a
sixth of BLAKE3's CPU time, so that hashing no longer caps a save to fast media (tmpfs,
NVMe; see ``_safetensors_io``). A v3 reader refuses a v4 manifest as a newer version, never
as a bad checkpoint. v5 = v4 + the ``xxh3_64`` block checksum of a piece (XXH3-64, 16 hex
digits a block) in place of ``crc32``: a quarter of ISA-L crc32's CPU time on bytes already in
cache, and it misses a corrupt block with probability 2**-64 instead of 2**-32. A v5 manifest
may still list ``crc32`` pieces (a reference to a shard an older Baton wrote)."""
DIGEST_VERSIONS: Final = {"sha256": 1, "blake3": 2, "xxh3_128": 4}
"""Whole-file digests a manifest may record, by key, and the first format version with each."""
DIGESTS: Final = tuple(DIGEST_VERSIONS)
_DIGEST_HEX: Final = {"sha256": 64, "blake3": 64, "xxh3_128": 32}
"""Lowercase hex digits of each digest."""
SHARD_DIGEST: Final = "xxh3_128"
"""The digest this Baton records for the shards it writes (the small JSON files: sha256)."""
PLAIN_VERSION: Final = 2
"""The version of a manifest without references whose files have sha256 or BLAKE3 digests
(what Baton wrote before v4), so that a v2 reader still reads it."""
REFERENCES_VERSION: Final = 3
"""The first version whose ``files`` may reference earlier steps' shards."""
MANIFEST: Final = "manifest.json"
LATEST: Final = "latest"
MAX_HEADER_BYTES: Final = 100 * 1024 * 1024
"""A safetensors header larger than this is refused (safetensors itself caps it at 100 MB)."""
MAX_JSON_BYTES: Final = 256 * 1024 * 1024
"""Manifests and per-rank JSON files larger than this are refused before they are read."""
BLOCK_SIZE: Final = 8 * 1024 * 1024
"""Default checksum block (bytes): every piece has a checksum per block, so a ranged read (a
resharded load) can verify exactly the blocks it touches, with at most two blocks of scratch."""
BLOCK_HASH_VERSIONS: Final = {"crc32": 1, "xxh3_64": 5}
"""Block checksums a piece may record, by key, and the first format version with each. A
``crc32`` list holds ints (zlib's crc32), an ``xxh3_64`` list 16-hex-digit strings (64-bit ints
do not survive JSON readers that hold numbers as doubles)."""

STEP_DIR_RE: Final = re.compile(r"step-(\d{12})")
FILE_RE: Final = re.compile(r"rank-(\d{5})-of-(\d{5})\.(safetensors|json)")
REF_RE: Final = re.compile(r"step-(\d{12})/(rank-(\d{5})-of-(\d{5})\.safetensors)")
"""The ``files`` key of a referenced shard (v3): exactly an earlier step directory of the same
root and a shard name in it; nothing else (no ``..``, nothing absolute, never a JSON file)."""
_HEX_RE: Final = re.compile(r"[0-9a-f]+")
_MAX_KEY_LEN: Final = 4096
_MAX_DIMS: Final = 64

Kind = Literal["replicated", "sharded", "rank_local"]
_KINDS: Final = ("replicated", "sharded", "rank_local")

DTYPE_SIZES: Final[Mapping[str, int]] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
"""safetensors dtype codes and their item sizes in bytes."""


def step_dir(step: int) -> str:
    """``step-000000001200`` for step 1200."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**12:
        raise ValueError(f"step must be an int in [0, 10**12), got {step!r}")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None if it is not a step directory."""
    m = STEP_DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def json_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.json"


def file_path(step: int, name: str) -> str:
    """Storage key of a file inside a step directory; ``name`` is checked first."""
    return f"{step_dir(step)}/{check_name(name)}"


def ref_key(step: int, name: str) -> str:
    """The ``files`` key under which a v3 manifest references shard ``name`` of ``step``."""
    return f"{step_dir(step)}/{check_name(name)}"


def check_name(name: object) -> str:
    """Return ``name`` if it is a plain file name a manifest may refer to, else ManifestError.

    The regex admits only ``rank-NNNNN-of-NNNNN.(safetensors|json)``: no separators, no
    ``..``, nothing absolute, no NUL bytes.
    """
    if not isinstance(name, str) or not FILE_RE.fullmatch(name):
        raise ManifestError(
            f"file name {name!r} is not a plain checkpoint file name "
            "(rank-NNNNN-of-NNNNN.safetensors|json); refusing to read it"
        )
    return name


def block_count(nbytes: int, block_size: int) -> int:
    """How many checksum blocks cover ``nbytes`` (0 for an empty piece)."""
    return -(-nbytes // block_size)


def parse_latest(data: bytes) -> int | None:
    """The step in a ``latest`` file, or None if it is unreadable (it is only a hint)."""
    try:
        obj = json.loads(data[:4096])
    except ValueError:
        return None
    step = obj.get("step") if isinstance(obj, dict) else None
    if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 10**12:
        return step
    return None


# --------------------------------------------------------------------------------- schema


@dataclass(frozen=True, kw_only=True, slots=True)
class FileEntry:
    """One file of a step, as committed."""

    size: int
    """Size in bytes."""
    sha256: str | None = None
    """Hex sha256 of the whole file, computed while it was written (every v1 file, and the
    small JSON files of v2: any tool can check them with ``sha256sum``)."""
    blake3: str | None = None
    """Hex BLAKE3 of the whole file (v2-v3 shards), computed while it was written."""
    xxh3_128: str | None = None
    """Hex XXH3-128 of the whole file (v4 shards), computed while it was written."""
    data_start: int | None = None
    """For shards: offset of the safetensors data section (8 + header length)."""
    step: int | None = None
    """v3: the earlier step whose directory holds the file (a reference); None for a file of
    the manifest's own step. The entry (size, digest, data_start) is the one that step
    committed, so a reference is verified exactly like an own file."""

    def __post_init__(self) -> None:
        if self.sha256 is None and self.blake3 is None and self.xxh3_128 is None:
            raise ValueError("a FileEntry needs a sha256, blake3 or xxh3_128 digest")

    @property
    def digest(self) -> tuple[str, str]:
        """``(algorithm, hex digest)`` to check the file against (a file has one digest; a
        hand-made entry with several is checked against the newest kind)."""
        if self.xxh3_128 is not None:
            return "xxh3_128", self.xxh3_128
        if self.blake3 is not None:
            return "blake3", self.blake3
        assert self.sha256 is not None
        return "sha256", self.sha256

    @classmethod
    def from_json(cls, f: Mapping[str, Any]) -> FileEntry:
        """Back from :meth:`to_json` (a rank's record; manifests are validated elsewhere)."""
        return cls(
            size=f["size"],
            sha256=f.get("sha256"),
            blake3=f.get("blake3"),
            xxh3_128=f.get("xxh3_128"),
            data_start=f.get("data_start"),
            step=f.get("step"),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        if self.blake3 is not None:
            out["blake3"] = self.blake3
        if self.xxh3_128 is not None:
            out["xxh3_128"] = self.xxh3_128
        if self.data_start is not None:
            out["data_start"] = self.data_start
        if self.step is not None:
            out["step"] = self.step
        return out


class Hasher(Protocol):
    """What ``hashlib.sha256()``, ``blake3.blake3()`` and ``xxhash.xxh3_128()`` have in common."""

    def update(self, data: memoryview | bytes, /) -> Any: ...

    def hexdigest(self) -> str: ...


def lowest_version(files: Mapping[str, FileEntry], tensors: Mapping[str, TensorEntry]) -> int:
    """The lowest format version that has everything in ``files`` (their digests, references)
    and ``tensors`` (their pieces' block checksums), so that a manifest is readable by as many
    Baton versions as can read it."""
    version = PLAIN_VERSION
    for f in files.values():
        if f.step is not None:
            version = max(version, REFERENCES_VERSION)
        version = max(version, DIGEST_VERSIONS[f.digest[0]])
    for t in tensors.values():
        for p in t.pieces:
            version = max(version, BLOCK_HASH_VERSIONS[p.block_hash])
    return version


def new_hasher(algorithm: str) -> Hasher:
    """A streaming hasher for one of :data:`DIGESTS`."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        from blake3 import blake3

        return blake3()
    if algorithm == "xxh3_128":
        from xxhash import xxh3_128

        return xxh3_128()
    raise ValueError(f"unknown digest {algorithm!r}: use one of {DIGESTS}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """A box of a tensor stored contiguously (row-major) in one shard file."""

    file: str
    """The shard file (a plain name in the step directory)."""
    name: str
    """The tensor's name inside that safetensors file."""
    dtype: str
    """safetensors dtype code; equal to the tensor's except for rank-local tensors."""
    offsets: tuple[int, ...]
    """Where the box starts in the global tensor (all zeros for whole tensors)."""
    shape: tuple[int, ...]
    """The box's shape."""
    begin: int
    """Absolute byte offset of the piece in the file."""
    end: int
    """Absolute end offset (exclusive)."""
    block_hash: str
    """The checksum in ``sums``: one of :data:`BLOCK_HASH_VERSIONS` (``crc32`` or ``xxh3_64``)."""
    sums: tuple[int, ...]
    """The checksum of each ``block_size`` block of the piece's bytes, in order."""
    rank: int | None = None
    """For rank-local tensors: the rank the value belongs to."""

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "file": self.file,
            "name": self.name,
            "dtype": self.dtype,
            "offsets": list(self.offsets),
            "shape": list(self.shape),
            "begin": self.begin,
            "end": self.end,
            self.block_hash: block_sums_to_json(self.block_hash, self.sums),
        }
        if self.rank is not None:
            out["rank"] = self.rank
        return out

    @classmethod
    def from_record(cls, pj: Mapping[str, Any]) -> Piece:
        """A piece from its :meth:`to_json` form in a rank's own record (trusted: this Baton
        wrote it in this save; a manifest's pieces are checked by :meth:`Manifest.parse`)."""
        block_hash = next(k for k in BLOCK_HASH_VERSIONS if k in pj)
        return cls(
            file=pj["file"],
            name=pj["name"],
            dtype=pj["dtype"],
            offsets=tuple(pj["offsets"]),
            shape=tuple(pj["shape"]),
            begin=pj["begin"],
            end=pj["end"],
            block_hash=block_hash,
            sums=block_sums_from_json(block_hash, pj[block_hash]),
            rank=pj.get("rank"),
        )


def block_sum(block_hash: str, view: memoryview | bytes | bytearray) -> int:
    """The ``block_hash`` checksum (one of :data:`BLOCK_HASH_VERSIONS`) of one block."""
    if block_hash == "xxh3_64":
        return xxh3_64_intdigest(view)
    if block_hash == "crc32":
        return crc32(view)
    known = tuple(BLOCK_HASH_VERSIONS)
    raise ValueError(f"unknown block checksum {block_hash!r}: use one of {known}")


def block_sums_to_json(block_hash: str, sums: Sequence[int]) -> list[int] | list[str]:
    """``sums`` as a manifest lists them: crc32 as ints, XXH3-64 as 16 hex digits each."""
    if block_hash == "xxh3_64":
        return [f"{s:016x}" for s in sums]
    return list(sums)


def block_sums_from_json(block_hash: str, items: Any) -> tuple[int, ...]:
    """The inverse of :func:`block_sums_to_json`; ValueError if ``items`` is not that form."""
    if not isinstance(items, list):
        raise ValueError("not a list")
    if block_hash == "xxh3_64":
        if not all(isinstance(s, str) and len(s) == 16 and _HEX_RE.fullmatch(s) for s in items):
            raise ValueError("not 16 lowercase hex digits each")
        return tuple(int(s, 16) for s in items)
    if not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**32 for c in items):
        raise ValueError("not a 32-bit int each")
    return tuple(items)


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorEntry:
    """A tensor of the state: its kind, dtype, global shape and the pieces that tile it."""

    kind: Kind
    """``replicated`` (same on every rank, written once), ``sharded`` (DTensor: each owner
    wrote its shard) or ``rank_local`` (one whole value per rank; ``shape`` is rank 0's)."""
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "pieces": [p.to_json() for p in self.pieces],
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """The commit record of one step. Written last, by rank 0."""

    step: int
    world_size: int
    trigger: str
    time: str
    """RFC 3339 UTC time of the commit."""
    torch_version: str
    baton_version: str
    block_size: int
    files: Mapping[str, FileEntry]
    tensors: Mapping[str, TensorEntry]
    version: int = FORMAT_VERSION
    """The lowest version that has everything the manifest records (see
    :func:`lowest_version`), so that older readers read what they can."""
    attempt: int = 0
    """The writer's attempt (``BATON_ATTEMPT``, or a generation derived outside Kubernetes);
    0 for manifests written before attempts were recorded. A writer whose attempt is older
    than the newest committed one refuses to commit (fencing, see ``docs/format.md``)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Free-form JSON for tools (never interpreted by the loader)."""

    @property
    def total_bytes(self) -> int:
        """Bytes of the step's own files (what its save wrote; references excluded)."""
        return sum(f.size for f in self.files.values() if f.step is None)

    @property
    def referenced_bytes(self) -> int:
        """Bytes of the earlier steps' shards this step references (v3)."""
        return sum(f.size for f in self.files.values() if f.step is not None)

    def path_of(self, key: str) -> str:
        """Storage key of the file that ``files[key]`` describes: a file of this step, or,
        for a reference, the shard of the earlier step that holds it."""
        entry = self.files[key]
        if entry.step is None:
            return file_path(self.step, key)
        m = REF_RE.fullmatch(key)
        assert m is not None  # validated by parse
        return file_path(entry.step, m.group(2))

    def referenced_steps(self) -> set[int]:
        """The earlier steps whose files this step references."""
        return {f.step for f in self.files.values() if f.step is not None}

    def to_json_bytes(self, *, indent: int | None = 1) -> bytes:
        """The manifest as written; ``indent=None`` is the compact form (the same JSON, which
        the C encoder writes several times faster: the memory tier writes one every step)."""
        obj = {
            "format": FORMAT_NAME,
            "version": self.version,
            "step": self.step,
            "world_size": self.world_size,
            "trigger": self.trigger,
            "time": self.time,
            "torch_version": self.torch_version,
            "baton_version": self.baton_version,
            "block_size": self.block_size,
            "attempt": self.attempt,
            "files": {n: f.to_json() for n, f in self.files.items()},
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "extra": dict(self.extra),
        }
        if indent is None:
            return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
        return json.dumps(obj, indent=indent, allow_nan=False).encode()

    @classmethod
    def parse(cls, data: bytes, *, step: int | None = None, path: str = MANIFEST) -> Manifest:
        """Parse and fully validate a manifest; any inconsistency raises ManifestError."""
        if len(data) > MAX_JSON_BYTES:
            raise ManifestError(f"manifest is {len(data)} bytes, over the limit", path=path)
        try:
            obj = json.loads(data)
        except ValueError as e:
            raise ManifestError(f"not valid JSON ({e})", path=path) from e
        try:
            return _parse_manifest(obj, step)
        except ManifestError as e:
            raise ManifestError(str(e), path=path) from None
        except UnsupportedFormatError as e:
            raise UnsupportedFormatError(str(e), step=step, path=path) from None
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            raise ManifestError(f"malformed manifest ({type(e).__name__}: {e})", path=path) from e


def _int(obj: Mapping[str, Any], key: str, *, lo: int = 0, hi: int = 2**62) -> int:
    v = obj[key]
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ManifestError(f"{key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def _str(obj: Mapping[str, Any], key: str, *, max_len: int = 256) -> str:
    v = obj[key]
    if not isinstance(v, str) or len(v) > max_len:
        raise ManifestError(f"{key!r} must be a string of at most {max_len} chars")
    return v


def _dims(v: object, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > _MAX_DIMS:
        raise ManifestError(f"{what} must be a list of at most {_MAX_DIMS} ints")
    for d in v:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < 2**62:
            raise ManifestError(f"{what} has an invalid entry {d!r}")
    return tuple(v)


def _parse_manifest(obj: Any, step: int | None) -> Manifest:
    if not isinstance(obj, dict):
        raise ManifestError("manifest must be a JSON object")
    if obj.get("format") != FORMAT_NAME:
        raise ManifestError(f"not a {FORMAT_NAME} manifest (format={obj.get('format')!r})")
    version = _int(obj, "version", lo=1)
    if version > FORMAT_VERSION:
        # Not a bad checkpoint: a newer writer's. Never fall back past it or delete it.
        raise UnsupportedFormatError(
            f"format version {version} is not supported by this Baton (reads v{FORMAT_VERSION}); "
            "upgrade trainer_sdk to the version that wrote it"
        )
    mstep = _int(obj, "step", hi=10**12 - 1)
    if step is not None and mstep != step:
        raise ManifestError(f"manifest says step {mstep} but lives in {step_dir(step)}")
    world = _int(obj, "world_size", lo=1, hi=99999)
    block_size = _int(obj, "block_size", lo=4096, hi=2**40)
    files_obj = obj["files"]
    if not isinstance(files_obj, dict):
        raise ManifestError("'files' must be an object")
    files: dict[str, FileEntry] = {}
    for name, f in files_obj.items():
        if not isinstance(f, dict):
            raise ManifestError(f"files[{name!r}] must be an object")
        ref_step = _ref_step(name, f, version, mstep)
        if ref_step is None:
            check_name(name)
            m = FILE_RE.fullmatch(name)
            assert m is not None
            if int(m.group(2)) != world or int(m.group(1)) >= world:
                raise ManifestError(f"file {name!r} does not belong to a world of size {world}")
        else:
            m = REF_RE.fullmatch(name)
            assert m is not None
            m = FILE_RE.fullmatch(m.group(2))
            assert m is not None
            if int(m.group(1)) >= int(m.group(2)):
                raise ManifestError(f"file {name!r}: its rank is outside its world")
        size = _int(f, "size")
        # v1 has sha256 for every file; v2 one digest per file, sha256 or blake3; v4 adds
        # xxh3_128.
        allowed = tuple(k for k, v in DIGEST_VERSIONS.items() if v <= version)
        digests = {k: f[k] for k in allowed if k in f}
        if not digests:
            raise ManifestError(f"files[{name!r}] has no {' or '.join(allowed)} digest")
        for key, value in digests.items():
            n = _DIGEST_HEX[key]
            if not isinstance(value, str) or len(value) != n or not _HEX_RE.fullmatch(value):
                raise ManifestError(f"files[{name!r}].{key} must be {n} lowercase hex digits")
        data_start = None
        if m.group(3) == "safetensors":
            data_start = _int(f, "data_start", lo=8, hi=8 + MAX_HEADER_BYTES)
            if data_start > size:
                raise ManifestError(f"files[{name!r}].data_start is past the end of the file")
        elif size > MAX_JSON_BYTES:
            raise ManifestError(f"files[{name!r}] is {size} bytes, over the JSON limit")
        files[name] = FileEntry(
            size=size,
            sha256=digests.get("sha256"),
            blake3=digests.get("blake3"),
            xxh3_128=digests.get("xxh3_128"),
            data_start=data_start,
            step=ref_step,
        )
    for r in range(world):
        if json_name(r, world) not in files:
            raise ManifestError(f"rank {r}'s JSON file {json_name(r, world)!r} is missing")
    tensors_obj = obj["tensors"]
    if not isinstance(tensors_obj, dict):
        raise ManifestError("'tensors' must be an object")
    tensors: dict[str, TensorEntry] = {}
    for key, t in tensors_obj.items():
        if not isinstance(key, str) or len(key) > _MAX_KEY_LEN:
            raise ManifestError(f"tensor key {key!r} is not a string of at most {_MAX_KEY_LEN}")
        tensors[key] = _parse_tensor(
            key, t, files, world=world, block_size=block_size, version=version
        )
    extra = obj.get("extra", {})
    if not isinstance(extra, dict):
        raise ManifestError("'extra' must be an object")
    attempt = _int(obj, "attempt") if "attempt" in obj else 0
    return Manifest(
        version=version,
        step=mstep,
        world_size=world,
        trigger=_str(obj, "trigger"),
        time=_str(obj, "time"),
        torch_version=_str(obj, "torch_version"),
        baton_version=_str(obj, "baton_version"),
        block_size=block_size,
        files=files,
        tensors=tensors,
        attempt=attempt,
        extra=extra,
    )


def _ref_step(name: object, f: Mapping[str, Any], version: int, mstep: int) -> int | None:
    """The step a ``files`` entry references (v3), or None for a file of the step itself."""
    if "step" not in f:
        if isinstance(name, str) and REF_RE.fullmatch(name):
            raise ManifestError(f"files[{name!r}] names another step's file but has no 'step'")
        return None
    if version < REFERENCES_VERSION:
        raise ManifestError(
            f"files[{name!r}] has a 'step' (a reference), which format v{version} does not have"
        )
    ref = _int(f, "step", hi=10**12 - 1)
    m = REF_RE.fullmatch(name) if isinstance(name, str) else None
    if m is None or int(m.group(1)) != ref:
        raise ManifestError(
            f"files[{name!r}] references step {ref}: its key must be exactly "
            f"'{step_dir(ref)}/rank-NNNNN-of-NNNNN.safetensors'"
        )
    if ref >= mstep:
        raise ManifestError(
            f"files[{name!r}] references step {ref}, which is not older than step {mstep}"
        )
    return ref


def _block_sums(
    p: Mapping[str, Any], version: int, blocks: int, what: str
) -> tuple[str, tuple[int, ...]]:
    """A piece's block checksum and its ``blocks`` values: exactly one of the checksums that
    ``version`` has."""
    allowed = [k for k, v in BLOCK_HASH_VERSIONS.items() if v <= version]
    present = [k for k in allowed if k in p]
    if len(present) != 1:
        raise ManifestError(f"{what}: needs exactly one block checksum of {' or '.join(allowed)}")
    block_hash = present[0]
    try:
        sums = block_sums_from_json(block_hash, p[block_hash])
    except ValueError as e:
        raise ManifestError(f"{what}: {block_hash} must list one checksum per block ({e})") from e
    if len(sums) != blocks:
        raise ManifestError(
            f"{what}: {block_hash} must list one checksum per block ({blocks}, not {len(sums)})"
        )
    return block_hash, sums


def _parse_tensor(
    key: str,
    t: Any,
    files: Mapping[str, FileEntry],
    *,
    world: int,
    block_size: int,
    version: int,
) -> TensorEntry:
    if not isinstance(t, dict):
        raise ManifestError(f"tensor {key!r} must be an object")
    kind = t["kind"]
    if kind not in _KINDS:
        raise ManifestError(f"tensor {key!r} has unknown kind {kind!r}")
    dtype = t["dtype"]
    if not isinstance(dtype, str) or len(dtype) > 32:
        raise ManifestError(f"tensor {key!r} has an invalid dtype {dtype!r}")
    if dtype not in DTYPE_SIZES:
        raise UnsupportedFormatError(
            f"tensor {key!r} has dtype {dtype!r}, which this Baton does not know; upgrade "
            "trainer_sdk to the version that wrote the checkpoint"
        )
    shape = _dims(t["shape"], f"tensor {key!r} shape")
    pieces_obj = t["pieces"]
    if not isinstance(pieces_obj, list):
        raise ManifestError(f"tensor {key!r}: 'pieces' must be a list")
    pieces: list[Piece] = []
    seen_ranks: set[int] = set()
    for i, p in enumerate(pieces_obj):
        what = f"tensor {key!r} piece {i}"
        if not isinstance(p, dict):
            raise ManifestError(f"{what} must be an object")
        fname = p["file"]
        if not isinstance(fname, str):
            raise ManifestError(f"{what} has a file name that is not a string")
        if fname not in files:
            check_name(fname)  # a name that is not even a plain file name says so
        fentry = files.get(fname)
        if fentry is None or fentry.data_start is None:
            raise ManifestError(f"{what} names {fname!r}, which is not a shard of this step")
        pdtype = p["dtype"]
        if isinstance(pdtype, str) and len(pdtype) <= 32 and pdtype not in DTYPE_SIZES:
            raise UnsupportedFormatError(
                f"{what} has dtype {pdtype!r}, which this Baton does not know; upgrade "
                "trainer_sdk to the version that wrote the checkpoint"
            )
        if pdtype not in DTYPE_SIZES or (kind != "rank_local" and pdtype != dtype):
            raise ManifestError(f"{what} has dtype {pdtype!r}, the tensor has {dtype!r}")
        offsets = _dims(p["offsets"], f"{what} offsets")
        pshape = _dims(p["shape"], f"{what} shape")
        begin = _int(p, "begin")
        end = _int(p, "end")
        if not fentry.data_start <= begin <= end <= fentry.size:
            raise ManifestError(
                f"{what} bytes [{begin}, {end}) lie outside the data of {fname!r} "
                f"[{fentry.data_start}, {fentry.size})"
            )
        if (end - begin) != math.prod(pshape) * DTYPE_SIZES[pdtype]:
            raise ManifestError(f"{what}: byte length does not match its shape and dtype")
        block_hash, sums = _block_sums(p, version, block_count(end - begin, block_size), what)
        name = p["name"]
        if not isinstance(name, str) or len(name) > _MAX_KEY_LEN + 64:
            raise ManifestError(f"{what}: bad name")
        prank: int | None = None
        if kind == "rank_local":
            prank = _int(p, "rank", hi=world - 1)
            if prank in seen_ranks:
                raise ManifestError(f"{what}: rank {prank} has two values")
            seen_ranks.add(prank)
            if any(offsets):
                raise ManifestError(f"{what}: rank-local values have zero offsets")
        else:
            if len(offsets) != len(shape) or len(pshape) != len(shape):
                raise ManifestError(f"{what}: offsets/shape rank differs from the tensor's")
            if any(o + s > g for o, s, g in zip(offsets, pshape, shape, strict=True)):
                raise ManifestError(f"{what}: box lies outside the global shape {list(shape)}")
        pieces.append(
            Piece(
                file=fname,
                name=name,
                dtype=pdtype,
                offsets=offsets,
                shape=pshape,
                begin=begin,
                end=end,
                block_hash=block_hash,
                sums=sums,
                rank=prank,
            )
        )
    if kind != "rank_local":
        _check_tiling(key, shape, pieces)
    return TensorEntry(kind=kind, dtype=dtype, shape=shape, pieces=tuple(pieces))


def _check_tiling(key: str, shape: tuple[int, ...], pieces: list[Piece]) -> None:
    """Pieces must not overlap and must cover the tensor exactly (so every read is defined)."""
    nonempty = [p for p in pieces if math.prod(p.shape) > 0]
    total = sum(math.prod(p.shape) for p in nonempty)
    if total != math.prod(shape):
        raise ManifestError(
            f"tensor {key!r}: pieces hold {total} elements, the shape needs {math.prod(shape)}"
        )
    if all(p.offsets[1:] == (0,) * (len(shape) - 1) and p.shape[1:] == shape[1:] for p in nonempty):
        # row slabs (replicated splits, Shard(0)): sorted by first row they must not overlap;
        # with the volume check above that means they tile the tensor. O(n log n).
        rows = sorted((p.offsets[0], p.offsets[0] + p.shape[0]) for p in nonempty if shape)
        for (_, end), (start, _) in itertools.pairwise(rows):
            if start < end:
                raise ManifestError(f"tensor {key!r}: pieces overlap")
        return
    if len(nonempty) > 1024:
        raise ManifestError(f"tensor {key!r}: too many non-row pieces ({len(nonempty)}) to check")
    for i, a in enumerate(nonempty):
        for b in nonempty[i + 1 :]:
            if all(
                ao < bo + bs and bo < ao + as_
                for ao, as_, bo, bs in zip(a.offsets, a.shape, b.offsets, b.shape, strict=True)
            ):
                raise ManifestError(f"tensor {key!r}: pieces overlap")


# ------------------------------------------------------------------------ safetensors header


@dataclass(frozen=True, kw_only=True, slots=True)
class SafetensorsHeader:
    """A parsed, bounds-checked safetensors header."""

    data_start: int
    """8 + header length: where the data section starts in the file."""
    tensors: Mapping[str, tuple[str, tuple[int, ...], int, int]]
    """name -> (dtype, shape, begin, end), with absolute file offsets."""
    metadata: Mapping[str, str]


def parse_safetensors_header(head: bytes, file_size: int, *, path: str) -> SafetensorsHeader:
    """Parse the header at the start of a safetensors file (``head`` = its first bytes).

    ``head`` must hold at least ``8 + header length`` bytes; read the 8-byte length first and
    check it with :func:`header_length`.
    """
    n = header_length(head[:8], file_size, path=path)
    if len(head) < 8 + n:
        raise ManifestError("header truncated", path=path)
    try:
        obj = json.loads(head[8 : 8 + n])
    except ValueError as e:
        raise ManifestError(f"header is not valid JSON ({e})", path=path) from e
    if not isinstance(obj, dict):
        raise ManifestError("header must be a JSON object", path=path)
    meta = obj.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ManifestError("__metadata__ must map strings to strings", path=path)
    data_start = 8 + n
    tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for name, info in obj.items():
        if not isinstance(info, dict):
            raise ManifestError(f"header entry {name!r} must be an object", path=path)
        dtype = info.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise ManifestError(f"header entry {name!r} has unknown dtype {dtype!r}", path=path)
        shape = _dims(info.get("shape"), f"header entry {name!r} shape")
        offs = info.get("data_offsets")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        ):
            raise ManifestError(f"header entry {name!r}: bad data_offsets", path=path)
        begin, end = data_start + offs[0], data_start + offs[1]
        if not data_start <= begin <= end <= file_size:
            raise ManifestError(
                f"header entry {name!r}: data [{begin}, {end}) is outside the file "
                f"(size {file_size})",
                path=path,
            )
        if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise ManifestError(f"header entry {name!r}: size does not match shape", path=path)
        tensors[name] = (dtype, shape, begin, end)
    return SafetensorsHeader(data_start=data_start, tensors=tensors, metadata=meta)


def header_length(prefix: bytes, file_size: int, *, path: str) -> int:
    """Validate the 8-byte little-endian header length of a safetensors file."""
    if len(prefix) < 8 or file_size < 8:
        raise ManifestError("file is shorter than a safetensors header", path=path)
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise ManifestError(f"header of {n} bytes is over the {MAX_HEADER_BYTES} limit", path=path)
    if 8 + n > file_size:
        raise ManifestError(f"header of {n} bytes runs past the end of the file", path=path)
    return int(n)


def check_header_matches(
    header: SafetensorsHeader, pieces: Iterable[Piece], entry: FileEntry, *, path: str
) -> None:
    """Check that the pieces the manifest places in a file agree with the file's own header."""
    if header.data_start != entry.data_start:
        raise ManifestError("header length differs from the manifest's data_start", path=path)
    for p in pieces:
        got = header.tensors.get(p.name)
        if got is None or got != (p.dtype, p.shape, p.begin, p.end):
            raise ManifestError(f"piece {p.name!r} differs from the file's header", path=path)

"""A load: read a committed step's verified byte ranges straight into the live state.

A load reads the manifest of a complete step, then, for every tensor in the state, only the
byte ranges that overlap what this rank holds (which is what makes a change of world size
work), straight into the destination tensors, verifying a checksum per block as it goes. In a
cooperative load (on S3 by default), the tensors every rank needs whole (a DDP state) are first
read once between the ranks and broadcast (:mod:`trainer_sdk.saveload._coop`, steps 1-4 there, run
from here before the tree is decoded). The JSON tree is decoded by
:class:`~trainer_sdk.format._tree.TreeDecoder`; this module resolves its tensor references. The
public entry points are :func:`trainer_sdk.api.load` and :func:`trainer_sdk.api.iter_tensors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer_sdk.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    StorageError,
    UnreadableCheckpointError,
    UnsupportedFormatError,
)
from trainer_sdk.format import _catalog
from trainer_sdk.format._safetensors_io import ST_TO_TORCH, byte_view
from trainer_sdk.format._tree import TreeDecoder, as_any, dtensor_box, dtensor_type, tensor_slots
from trainer_sdk.format.layout import (
    DTYPE_SIZES,
    MANIFEST,
    Manifest,
    Piece,
    TensorEntry,
    block_count,
    block_sum,
    file_path,
    json_name,
    new_hasher,
)
from trainer_sdk.format.planning import intersect, row_range
from trainer_sdk.saveload import _coop
from trainer_sdk.saveload._collectives import all_gather_json
from trainer_sdk.storage import Storage

__all__ = ["LoadInfo", "Reader", "classify_load_error", "load_step", "torch_dtype"]


@dataclass(frozen=True, kw_only=True)
class LoadInfo:
    """What a load did on this rank."""

    step: int
    uri: str
    seconds: float
    saved_world_size: int
    resharded: bool
    """The world size differs from the saved one."""
    missing_rank_local: list[str] = field(default_factory=list)
    """Paths of RankLocal values this rank did not get (its rank did not exist at save time);
    they were left as they were."""
    saved_torch_version: str = ""
    """The torch version that wrote the step (the manifest's ``torch_version``)."""
    saved_attempt: int = 0
    """The attempt that committed the step (the manifest's ``attempt``)."""
    bytes_read: int = 0
    """Bytes of tensor data this rank read from storage (whole checksum blocks)."""
    cooperative_bytes: int = 0
    """Bytes of the tensors that the ranks read once between them and broadcast (see
    ``cooperative`` in :func:`trainer_sdk.api.load`); 0 for a plain load."""


def classify_load_error(e: BaseException) -> str:
    """Which kind a load failure is: ``incomplete`` (no manifest: the step never committed),
    ``bad`` (the checkpoint is corrupt or invalid: fall back to an older step), ``unreadable``
    (it cannot be read now or by this version: raise, never fall back) or ``other`` (it does
    not fit the live state). The list is in ``docs/format.md``."""
    if isinstance(e, IncompleteCheckpointError):
        return "incomplete"
    if isinstance(e, UnreadableCheckpointError):
        return "unreadable"
    if isinstance(e, CorruptCheckpointError | ManifestError | EOFError):
        return "bad"
    if isinstance(e, OSError | StorageError):
        return "unreadable"
    return "other"


# ------------------------------------------------------------------------------- read


class Reader:
    """Reads verified byte ranges of one committed step."""

    def __init__(self, storage: Storage, manifest: Manifest, *, read_run: int) -> None:
        self.storage = storage
        self.m = manifest
        self.read_run = read_run
        """Bytes of whole blocks fetched by one ``read_into`` (``api._READ_RUN``)."""
        self._sizes_ok: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-verify")
        self._checks: list[Future[None]] = []
        self.bytes_read = 0

    def _path(self, name: str) -> str:
        """Where ``files[name]`` lives: this step's directory, or the earlier step's that a
        reference (v3) names; such a path says which step references it."""
        if name in self.m.files:
            path = self.m.path_of(name)
            if self.m.files[name].step is not None:
                return f"{path} (referenced by step {self.m.step})"
            return path
        return file_path(self.m.step, name)

    def _key(self, name: str) -> str:
        return self.m.path_of(name)

    def check_size(self, name: str) -> None:
        if name in self._sizes_ok:
            return
        path = self._path(name)
        try:
            size = self.storage.size(self._key(name))
        except FileNotFoundError as e:
            raise CorruptCheckpointError("missing, but the manifest lists it", path=path) from e
        want = self.m.files[name].size
        if size != want:
            raise CorruptCheckpointError(
                f"is {size} bytes, the manifest says {want} (truncated or overwritten); load "
                "an older step",
                path=path,
            )
        self._sizes_ok.add(name)

    def read_json(self, rank: int) -> Any:
        name = json_name(rank, self.m.world_size)
        self.check_size(name)
        data = self.storage.read_bytes(self._key(name))
        algorithm, want = self.m.files[name].digest
        h = new_hasher(algorithm)
        h.update(data)
        if h.hexdigest() != want:
            raise CorruptCheckpointError(
                f"{algorithm} differs from the manifest", path=self._path(name)
            )
        try:
            return json.loads(data)
        except ValueError as e:
            raise ManifestError(f"not valid JSON ({e})", path=self._path(name)) from e

    def _verify(self, view: memoryview | bytearray, p: Piece, path: str, key: str, k: int) -> None:
        if block_sum(p.block_hash, view) != p.sums[k]:
            raise CorruptCheckpointError(
                f"checksum mismatch in tensor {key!r}, block {k}: the file is corrupt; load an "
                "older step",
                path=path,
            )

    def read_range(self, key: str, p: Piece, start: int, end: int, out: memoryview) -> None:
        """Bytes [start, end) of piece ``p`` into ``out``, verifying every block touched."""
        self.check_size(p.file)
        path = self._path(p.file)
        key_path = self._key(p.file)
        bs = self.m.block_size
        # Whole blocks are read in runs of up to read_run bytes per read_into call: on S3 one
        # call fans out into parallel ranged GETs, and the checksums of a run are verified in
        # the background while the next run is read.
        run_blocks = max(1, self.read_run // bs)
        try:
            blocks = range(start // bs, block_count(end, bs))
            whole = [k for k in blocks if start <= k * bs and min((k + 1) * bs, p.nbytes) <= end]
            for i in range(0, len(whole), run_blocks):
                run = whole[i : i + run_blocks]
                r0, r1 = run[0] * bs, min((run[-1] + 1) * bs, p.nbytes)
                self.storage.read_into(key_path, p.begin + r0, out[r0 - start : r1 - start])
                for k in run:
                    view = out[k * bs - start : min((k + 1) * bs, p.nbytes) - start]
                    self._checks.append(self._pool.submit(self._verify, view, p, path, key, k))
                self.bytes_read += r1 - r0
            for k in blocks:
                b0, b1 = k * bs, min((k + 1) * bs, p.nbytes)
                if start <= b0 and b1 <= end:
                    continue  # read above
                # an edge block: read it whole into scratch so it can be verified
                tmp = bytearray(b1 - b0)
                self.storage.read_into(key_path, p.begin + b0, memoryview(tmp))
                self._verify(tmp, p, path, key, k)
                lo, hi = max(start, b0), min(end, b1)
                out[lo - start : hi - start] = memoryview(tmp)[lo - b0 : hi - b0]
                self.bytes_read += b1 - b0
        except EOFError as e:
            raise CorruptCheckpointError(
                f"ends early while reading tensor {key!r}: {e}", path=path
            ) from e

    def check(self) -> None:
        """Wait for the checksums of everything read so far; raise on the first mismatch."""
        checks, self._checks = self._checks, []
        for f in checks:
            f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def read_box(
        self,
        key: str,
        entry: TensorEntry,
        dest: torch.Tensor,
        dest_off: tuple[int, ...],
        dest_shape: tuple[int, ...],
    ) -> None:
        """Fill ``dest`` (holding box ``dest_off``/``dest_shape`` of the tensor) from pieces."""
        item = DTYPE_SIZES[entry.dtype]
        covered = 0
        direct = dest.device.type == "cpu" and dest.is_contiguous()
        dview = byte_view(dest) if direct else None
        dest_row = math.prod(dest_shape[1:]) * item
        for p in entry.pieces:
            ov = intersect(p.offsets, p.shape, dest_off, dest_shape)
            if ov is None:
                continue
            ov_off, ov_shape = ov
            covered += math.prod(ov_shape)
            if math.prod(ov_shape) == 0:
                continue
            src_rel = tuple(a - b for a, b in zip(ov_off, p.offsets, strict=True))
            dst_rel = tuple(a - b for a, b in zip(ov_off, dest_off, strict=True))
            src_rows = row_range(src_rel, ov_shape, p.shape)
            dst_rows = row_range(dst_rel, ov_shape, dest_shape)
            src_row = math.prod(p.shape[1:]) * item
            if dview is not None and src_rows is not None and dst_rows is not None:
                n = math.prod(ov_shape) * item
                s = src_rows[0] * src_row
                d = dst_rows[0] * dest_row
                self.read_range(key, p, s, s + n, dview[d : d + n])
                continue
            # general case (non-row boxes, CUDA or strided destinations): read the covering
            # rows of the piece into scratch, then copy the box
            r0 = src_rel[0] if p.shape else 0
            r1 = r0 + ov_shape[0] if p.shape else 1
            scratch = torch.empty((r1 - r0, *p.shape[1:]), dtype=ST_TO_TORCH[entry.dtype])
            self.read_range(key, p, r0 * src_row, r1 * src_row, byte_view(scratch))
            src = (
                scratch[
                    (
                        slice(None),
                        *(slice(a, a + n) for a, n in zip(src_rel[1:], ov_shape[1:], strict=True)),
                    )
                ]
                if p.shape
                else scratch.reshape(())
            )
            dst = dest[tuple(slice(a, a + n) for a, n in zip(dst_rel, ov_shape, strict=True))]
            dst.copy_(src)
        if covered != math.prod(dest_shape):
            raise CorruptCheckpointError(
                f"the pieces of tensor {key!r} cover {covered} of the {math.prod(dest_shape)} "
                "elements this rank needs",
                path=self._path(MANIFEST),
            )

    def read_piece(self, key: str, p: Piece, dest: torch.Tensor) -> None:
        if dest.device.type == "cpu" and dest.is_contiguous():
            self.read_range(key, p, 0, p.nbytes, byte_view(dest))
            return
        tmp = torch.empty(p.shape, dtype=ST_TO_TORCH[p.dtype])
        self.read_range(key, p, 0, p.nbytes, byte_view(tmp))
        dest.copy_(tmp)


def _touched(t: torch.Tensor) -> None:
    """Bump ``t``'s version counter: the bytes were written around autograd (straight into its
    memory), and incremental saves (``_reuse``) trust the counter to see every change."""
    with contextlib.suppress(RuntimeError):  # inference tensors have no version counter
        torch.autograd.graph.increment_version(t)


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code."""
    return ST_TO_TORCH[code]


class _TensorRestorer:
    """Fills the tensors a :class:`~trainer_sdk.format._tree.TreeDecoder` meets, from the shards."""

    def __init__(
        self,
        reader: Reader,
        rank: int,
        strict: bool,
        filled: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.r = reader
        self.m = reader.m
        self.rank = rank
        self.strict = strict
        self.dtensor = dtensor_type()
        self.filled = filled or {}
        """Tensors a cooperative load already filled (``_coop.run``), by key."""

    def _mismatch(self, key: str, want: str, got: torch.Tensor) -> CheckpointError:
        return CheckpointError(
            f"tensor {key!r}: the checkpoint holds {want}, the destination is "
            f"{got.dtype} {list(got.shape)}. Build the model/optimizer with the same "
            "configuration as the saved run, or load into a fresh value (strict=False)."
        )

    def _from_filled(self, key: str, want: str, done: torch.Tensor, cur: Any) -> Any:
        """``cur`` from a tensor the cooperative phase filled: the same memory in the usual
        case; a copy when ``state_dict()`` handed the decoder another tensor than it handed
        :func:`~trainer_sdk.format._tree.tensor_slots`; ``done`` itself where ``cur`` is no tensor
        of the saved shape (as the plain path returns a fresh one)."""
        if isinstance(cur, torch.Tensor):
            if cur is done or (
                cur.data_ptr() == done.data_ptr()
                and cur.device == done.device
                and cur.dtype == done.dtype
                and cur.shape == done.shape
                and cur.stride() == done.stride()
            ):
                _touched(cur)
                return cur
            if cur.shape == done.shape and cur.dtype == done.dtype:
                with torch.no_grad():
                    cur.copy_(done)
                _touched(cur)
                return cur
            if self.strict:
                raise self._mismatch(key, want, cur)
        return done

    def tensor(self, key: str, cur: Any) -> Any:
        entry = self.m.tensors.get(key)
        if entry is None:
            raise ManifestError(f"tensor {key!r} is in the JSON tree but not in the manifest")
        if entry.kind == "rank_local":
            piece = next((p for p in entry.pieces if p.rank == self.rank), None)
            if piece is None:
                raise CorruptCheckpointError(
                    f"rank {self.rank}'s value of {key!r} is missing", path=MANIFEST
                )
            want = f"{piece.dtype} {list(piece.shape)}"
            dt = torch_dtype(piece.dtype)
            if isinstance(cur, torch.Tensor):
                if tuple(cur.shape) != piece.shape or cur.dtype != dt:
                    if self.strict:
                        raise self._mismatch(key, want, cur)
                    cur = None
                else:
                    self.r.read_piece(key, piece, cur)
                    _touched(cur)
                    return cur
            out = torch.empty(piece.shape, dtype=dt)
            self.r.read_piece(key, piece, out)
            return out
        dt = torch_dtype(entry.dtype)
        want = f"{entry.dtype} {list(entry.shape)}"
        done = self.filled.get(key)
        if done is not None and not (self.dtensor is not None and isinstance(cur, self.dtensor)):
            return self._from_filled(key, want, done, cur)
        if self.dtensor is not None and isinstance(cur, self.dtensor):
            cur = as_any(cur)
            if tuple(cur.shape) != entry.shape or cur.dtype != dt:
                raise self._mismatch(key, want, cur)
            off, local_shape, _ = dtensor_box(cur)
            local = cur.to_local()
            if tuple(local.shape) != local_shape:
                local = local[tuple(slice(0, s) for s in local_shape)]
            with torch.no_grad():
                self.r.read_box(key, entry, local, off, local_shape)
            _touched(local)
            return cur
        if isinstance(cur, torch.Tensor):
            if tuple(cur.shape) != entry.shape or cur.dtype != dt:
                if self.strict:
                    raise self._mismatch(key, want, cur)
            else:
                with torch.no_grad():
                    self.r.read_box(key, entry, cur, (0,) * len(entry.shape), entry.shape)
                _touched(cur)
                return cur
        out = torch.empty(entry.shape, dtype=dt)
        self.r.read_box(key, entry, out, (0,) * len(entry.shape), entry.shape)
        return out


class _PeerFailedError(CheckpointError):
    """Another rank failed before the cooperative reads began; its error is the one raised
    (this rank only stops early and takes part in the outcome exchange)."""


def load_step(
    state: dict[str, Any],
    storage: Storage,
    step: int,
    *,
    process_group: Any,
    rank: int,
    world: int,
    strict: bool,
    timeout: float,
    started: float,
    read_run: int,
    cooperative: bool = False,
) -> LoadInfo:
    """Restore ``state`` from ``step`` on this rank; under a process group, every rank learns
    whether every other one succeeded, and raises the first failing rank's error if not (so
    that all of them can fall back to an older step together). ``started`` is the
    ``time.perf_counter()`` at which the load began. ``cooperative``: read what every rank
    needs whole once between the ranks and broadcast it (:mod:`trainer_sdk.saveload._coop`); only
    with a group of more than one rank that can broadcast CPU tensors."""
    err: BaseException | None = None
    info: LoadInfo | None = None
    coop_group: Any = None
    if cooperative and world > 1 and _coop.supported(process_group):
        import torch.distributed as dist

        coop_group = dist.group.WORLD if process_group is None else process_group
    try:
        try:
            info = _load_step(
                state, storage, step, rank=rank, world=world, strict=strict, read_run=read_run,
                group=coop_group, timeout=timeout,
            )  # fmt: skip
        except (OSError, StorageError) as e:  # I/O, permissions, throttling after every retry
            raise _catalog.unreadable(e, step, "loading it") from e
    except Exception as e:
        if world == 1:
            raise
        err = e
    if world > 1:
        own = (
            {"ok": True}
            if err is None
            else {"ok": False, "follow": True}
            if isinstance(err, _PeerFailedError)
            else {
                "ok": False,
                "type": type(err).__name__,
                "kind": classify_load_error(err),
                "msg": str(err),
                "path": getattr(err, "path", None),
            }
        )
        outcomes = all_gather_json(
            own, group=process_group, timeout=timeout, what=f"load of step {step}"
        )
        bad = [(r, o) for r, o in enumerate(outcomes) if not o.get("ok") and not o.get("follow")]
        if not bad and err is not None:
            raise CheckpointError(f"load of step {step}: a peer failed; see its log") from err
        if bad:
            r, o = bad[0]
            if err is not None and r == rank:
                raise err
            msg = f"rank {r} failed to load step {step}: {o['msg']}"
            if o["type"] == "CorruptCheckpointError" and o.get("path"):
                raise CorruptCheckpointError(msg, path=str(o["path"])) from err
            if o["type"] == "IncompleteCheckpointError":
                raise IncompleteCheckpointError(msg) from err
            if o["type"] == "ManifestError":
                raise ManifestError(msg) from err
            if o.get("kind") == "unreadable":
                cls = (
                    UnsupportedFormatError
                    if o["type"] == "UnsupportedFormatError"
                    else UnreadableCheckpointError
                )
                raise cls(msg, step=step) from err
            raise CheckpointError(msg) from err
    assert info is not None
    return dataclasses.replace(info, seconds=time.perf_counter() - started)


def _load_step(
    state: dict[str, Any],
    storage: Storage,
    step: int,
    *,
    rank: int,
    world: int,
    strict: bool,
    read_run: int,
    group: Any,
    timeout: float,
) -> LoadInfo:
    """One rank's load; cooperative when ``group`` is given (then every rank runs the
    agreement of :func:`_coop.agree` whatever happened before it, so none waits alone)."""
    reader: Reader | None = None
    try:
        try:
            manifest = _catalog.read_manifest(storage, step)
            reader = Reader(storage, manifest, read_run=read_run)
            global_tree = reader.read_json(0)
            own_tree = (
                global_tree
                if rank == 0
                else reader.read_json(rank)
                if rank < manifest.world_size
                else None
            )
            if not isinstance(global_tree, dict):
                raise ManifestError("rank 0's JSON tree is not an object")
            if strict:
                lost = [k for k in state if k not in global_tree]
                if lost:
                    raise CheckpointError(
                        f"the checkpoint of step {step} has no {lost}; pass strict=False to "
                        "keep their current values"
                    )
            mine = (
                _coop.candidates(tensor_slots(state, global_tree), manifest, strict=strict)
                if group is not None
                else None
            )
        except Exception:
            if group is not None:
                # Take part in the agreement (saying this rank failed), then raise this
                # rank's error, even if the agreement itself failed (a peer died).
                with contextlib.suppress(Exception):
                    _coop.agree(None, None, step=step, group=group, timeout=timeout)
            raise
        filled: dict[str, torch.Tensor] = {}
        shared = 0
        if group is not None:
            assert mine is not None
            keys = _coop.agree(mine, manifest, step=step, group=group, timeout=timeout)
            if keys is None:
                raise _PeerFailedError(f"another rank failed to prepare the load of step {step}")
            units = _coop.plan_units(manifest, keys, world)
            filled = _coop.run(
                reader, units, mine, rank=rank, world=world, group=group, timeout=timeout
            )
            shared = sum(u.end - u.start for u in units)
        decoder = TreeDecoder(_TensorRestorer(reader, rank, strict, filled).tensor, strict=strict)
        for key, g in global_tree.items():
            own = own_tree.get(key) if isinstance(own_tree, dict) else None
            state[key] = decoder.node(state.get(key), g, own, key)
        reader.check()
    finally:
        if reader is not None:
            reader.close()
    return LoadInfo(
        step=step,
        uri=storage.uri,
        seconds=0.0,
        saved_world_size=manifest.world_size,
        resharded=manifest.world_size != world,
        missing_rank_local=decoder.missing_rank_local,
        saved_torch_version=manifest.torch_version,
        saved_attempt=manifest.attempt,
        bytes_read=reader.bytes_read,
        cooperative_bytes=shared,
    )

"""Every collective the SDK runs: bounded ones that carry JSON, and the numeric agreements.

The save/load protocol and the Checkpointer's restore exchange JSON (below); the notice
agreement and the deadline check reduce a few numbers with MAX (at the end). No other SDK
module calls ``torch.distributed`` collectives itself.

Why not ``all_gather_object``: it pickles. Here objects travel as UTF-8 JSON in uint8
tensors (sizes first, then the padded payloads), so nothing received is ever unpickled.

Why not a plain ``work.wait()``: a dead or stuck peer would block forever (or for the process
group's timeout, often 30 minutes). Every collective here is started asynchronously and
polled against a deadline; past it, :class:`~trainer_sdk.errors.CollectiveTimeoutError` is
raised naming the ranks that never arrived. Arrival is recorded in the process group's
key-value store before each collective, so the missing ranks can be named even though the
collective itself cannot say. After such an error the process group may be unusable
(the collective is still pending in the backend): destroy it and restart the job.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer_sdk.errors import CollectiveTimeoutError

__all__ = [
    "Broadcasts",
    "all_gather_json",
    "all_reduce_max",
    "all_reduce_max_",
    "backend_timeout",
    "broadcast_json",
    "group_rank_world",
    "is_distributed",
    "mark_failed",
    "release_group",
    "start_all_reduce_max_",
]

log = logging.getLogger("trainer_sdk.collectives")

_counters: dict[str, itertools.count[int]] = {}

_failed: set[str] = set()
"""Names of the groups on which a collective failed or ran past its deadline."""


def backend_timeout(timeout: timedelta) -> timedelta:
    """The gloo timer for a group whose collectives the SDK bounds with ``timeout`` itself:
    ``timeout`` plus as much again, at most a minute more.

    Why longer than the SDK's own deadline: a rank whose gloo timer fires closes its
    connections, and a peer that reaches the same collective after that fails at once with
    "Connection closed by peer" instead of waiting out its own deadline and naming the rank
    that never arrived. That happened on a loaded machine when rank 0 was more than
    ``timeout`` late to a collective (it registers the attempt in storage first): the early
    rank's gloo gave up on the missing rank, and rank 0 was told "a peer failed". With the
    longer timer every rank that arrives within the margin meets an open collective and its
    own deadline decides. The few blocking agreements (:func:`all_reduce_max`) are bounded by
    this timer.
    """
    return timeout + min(timeout, timedelta(minutes=1))


def _group_name(group: dist.ProcessGroup | None) -> str:
    return str(getattr(group or dist.group.WORLD, "group_name", "world"))


def mark_failed(group: dist.ProcessGroup | None) -> None:
    """Record that a collective on ``group`` failed or is still pending past its deadline: the
    group's worker may be blocked on a dead peer, so :func:`release_group` leaves it alone."""
    if group is not None:
        _failed.add(_group_name(group))


def release_group(group: dist.ProcessGroup | None) -> None:
    """Destroy a gloo group the SDK created, once nothing will use it again (its owner's
    ``close()``), while the interpreter is still fully alive.

    Why: a gloo group still alive at interpreter exit can abort the process ("terminate called
    without an active exception", SIGABRT, pytorch#190489): its C++ worker threads still hold
    finished works whose tensors are freed during the interpreter's finalization. A resumed
    BatonTrainer run died so at exit in about 1 of 10 runs (the restore runs more collectives
    on the SDK's groups) and turned a finished job into a failed one.

    A group on which a collective failed or timed out (:func:`mark_failed`) is left as it is:
    its worker may still wait on a dead peer, and destroying the group would wait for that
    (up to the group's timeout) in a run that is ending with that error anyway.
    """
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    name = _group_name(group)
    if name in _failed:
        log.info("process group %s is not destroyed: a collective on it failed", name)
        return
    dist.destroy_process_group(group)


def _next_seq(group: dist.ProcessGroup | None) -> str:
    """A key prefix that is the same on every rank for the same collective of the same group.

    Counted per group, because the async writer runs its collectives on a group of its own, in
    another thread, interleaved differently on different ranks.
    """
    name = _group_name(group)
    counter = _counters.setdefault(name, itertools.count())
    return f"baton/collective/{name}/{next(counter)}"


def is_distributed(group: dist.ProcessGroup | None) -> bool:
    """Whether a multi-process save is in effect (an explicit group, or an initialised one)."""
    if group is not None:
        return True
    return dist.is_available() and dist.is_initialized()


def group_rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank in the group, group size); (0, 1) without torch.distributed."""
    if not is_distributed(group):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _arrive(what: str, seq: str, rank: int) -> None:
    store = _store()
    if store is None:
        return
    with contextlib.suppress(RuntimeError, OSError):  # the store lives on rank 0; may be gone
        store.set(f"{seq}/{rank}", what)


def _missing(seq: str, world: int) -> list[int] | None:
    store = _store()
    if store is None:
        return None
    try:
        store.set_timeout(timedelta(seconds=2))
        return [r for r in range(world) if not store.check([f"{seq}/{r}"])]
    except (RuntimeError, OSError):
        return None


def _wait(
    work: Any,
    *,
    group: dist.ProcessGroup | None,
    deadline: float,
    what: str,
    seq: str,
    world: int,
    timeout: float,
) -> None:
    try:
        _wait_for(work, deadline=deadline, what=what, seq=seq, world=world, timeout=timeout)
    except CollectiveTimeoutError:
        mark_failed(group)
        raise


def _wait_for(
    work: Any, *, deadline: float, what: str, seq: str, world: int, timeout: float
) -> None:
    delay = 0.0005
    while not work.is_completed():
        if time.monotonic() > deadline:
            missing = _missing(seq, world)
            who = (
                f"rank(s) {', '.join(map(str, missing))} never arrived"
                if missing
                else "every rank arrived but the collective did not finish"
                if missing == []
                else "the missing ranks could not be determined (the store is unreachable)"
            )
            raise CollectiveTimeoutError(
                f"{what}: no answer within {timeout:.0f} s; {who}. A rank probably died or is "
                "stuck; restart the job (the previous complete step is intact).",
                ranks=missing or (),
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    try:
        work.wait()
    except RuntimeError as e:
        missing = _missing(seq, world)
        if missing and "timed out" in str(e).lower():
            # The backend's own timer (gloo's, see backend_timeout) fired before ours: the
            # same fault as above, reported the same way.
            raise CollectiveTimeoutError(
                f"{what}: no answer within {timeout:.0f} s; rank(s) "
                f"{', '.join(map(str, missing))} never arrived ({e}). A rank probably died or "
                "is stuck; restart the job (the previous complete step is intact).",
                ranks=missing,
            ) from e
        who = f" (rank(s) {', '.join(map(str, missing))} never arrived)" if missing else ""
        raise CollectiveTimeoutError(
            f"{what}: a peer failed during the collective{who}: {e}. A rank probably died; "
            "restart the job (the previous complete step is intact).",
            ranks=missing or (),
        ) from e


def all_gather_json(
    obj: Any, *, group: dist.ProcessGroup | None, timeout: float, what: str
) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in rank order, on every rank. Bounded by ``timeout``."""
    rank, world = group_rank_world(group)
    if world == 1:
        return [json.loads(json.dumps(obj))]
    deadline = time.monotonic() + timeout
    seq = _next_seq(group)
    _arrive(what, seq, rank)
    dev = _device(group)
    payload = json.dumps(obj, separators=(",", ":")).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    work = dist.all_gather(sizes, size, group=group, async_op=True)
    _wait(work, group=group, deadline=deadline, what=what, seq=seq, world=world, timeout=timeout)
    lens = [int(s.item()) for s in sizes]
    width = max(lens)
    mine = torch.zeros(width, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    mine = mine.to(dev)
    bufs = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(world)]
    work = dist.all_gather(bufs, mine, group=group, async_op=True)
    _wait(work, group=group, deadline=deadline, what=what, seq=seq, world=world, timeout=timeout)
    return [
        json.loads(bytes(b[:n].cpu().numpy().tobytes())) for b, n in zip(bufs, lens, strict=True)
    ]


def broadcast_json(obj: Any, *, group: dist.ProcessGroup | None, timeout: float, what: str) -> Any:
    """Group rank 0's ``obj`` on every rank (others pass anything). Bounded by ``timeout``."""
    rank, world = group_rank_world(group)
    if world == 1:
        return json.loads(json.dumps(obj))
    deadline = time.monotonic() + timeout
    seq = _next_seq(group)
    _arrive(what, seq, rank)
    dev = _device(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    payload = json.dumps(obj, separators=(",", ":")).encode() if rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    work = dist.broadcast(size, src=src, group=group, async_op=True)
    _wait(work, group=group, deadline=deadline, what=what, seq=seq, world=world, timeout=timeout)
    n = int(size.item())
    buf = torch.zeros(n, dtype=torch.uint8)
    if rank == 0 and payload:
        buf[:] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buf = buf.to(dev)
    work = dist.broadcast(buf, src=src, group=group, async_op=True)
    _wait(work, group=group, deadline=deadline, what=what, seq=seq, world=world, timeout=timeout)
    return json.loads(bytes(buf.cpu().numpy().tobytes()))


class Broadcasts:
    """A batch of in-place tensor broadcasts, each from its own source rank, started one by one
    (so that a source can start its broadcast as soon as its bytes are ready) and finished
    together by :meth:`wait`, bounded by ``timeout`` from the batch's creation.

    Every rank must start the same broadcasts in the same order (same sizes, same sources).
    Arrival is recorded once for the batch, so a rank that never came is named. The tensors
    must be contiguous and on the group's device (CPU for the SDK's gloo groups).
    """

    def __init__(self, *, group: dist.ProcessGroup | None, timeout: float, what: str) -> None:
        self.group = group
        self.timeout = timeout
        self.what = what
        self.rank, self.world = group_rank_world(group)
        self._deadline = time.monotonic() + timeout
        self._seq = _next_seq(group)
        self._works: list[Any] = []
        _arrive(what, self._seq, self.rank)

    def start(self, tensor: torch.Tensor, src: int) -> None:
        """Start broadcasting ``tensor`` from group rank ``src`` into every rank's ``tensor``."""
        glob = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._works.append(dist.broadcast(tensor, src=glob, group=self.group, async_op=True))

    def wait(self) -> None:
        """Wait for every broadcast started; raise :class:`CollectiveTimeoutError` past the
        deadline or when a peer failed."""
        works, self._works = self._works, []
        for work in works:
            _wait(
                work, group=self.group, deadline=self._deadline, what=self.what,
                seq=self._seq, world=self.world, timeout=self.timeout,
            )  # fmt: skip


# ---------------------------------------------------- numeric agreements (no payload to parse)


def all_reduce_max(values: list[float], *, group: dist.ProcessGroup | None) -> list[float]:
    """Element-wise maximum of ``values`` over ``group`` (float64); ``values`` alone without one.

    Blocking: bounded by the group's own timer (the Checkpointer creates its groups with
    :func:`backend_timeout` of its ``timeout``).
    """
    if group is None:
        return list(values)
    vec = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    return [float(x) for x in vec.tolist()]


def all_reduce_max_(vec: torch.Tensor, *, group: dist.ProcessGroup) -> None:
    """In-place element-wise maximum of ``vec`` over ``group`` (blocking, like
    :func:`all_reduce_max`)."""
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)


def start_all_reduce_max_(vec: torch.Tensor, *, group: dist.ProcessGroup) -> Any:
    """Start an in-place element-wise maximum of ``vec`` over ``group``; returns the work
    (``work.wait(timeout)`` finishes it, ``vec`` holds the result after).

    The process group's own call: ``dist.all_reduce``'s checks cost more than the
    collective's start on a short step (tens of microseconds).
    """
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
    return group.allreduce([vec], opts)

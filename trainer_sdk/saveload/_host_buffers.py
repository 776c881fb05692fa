"""The host copies of an async save: one reusable buffer per tensor, allocated on the first
save and reused by every later one.

Pinned when the source is on a GPU, so that the device-to-host copies run as DMA on a side
stream; in memfds that a writer process maps too when the saver has one
(``writer_process=True``, :mod:`trainer_sdk.saveload._writer_process`). Once a copy is done
the caller may change its tensors freely; the background write reads only the buffers.
Used by :mod:`trainer_sdk.staging` (which re-exports :class:`HostBuffers`).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from trainer_sdk.errors import CheckpointError
from trainer_sdk.saveload._writer_process import WriterProcess

__all__ = ["HostBuffers", "mark_streams"]


class HostBuffers:
    """One reusable host copy of a set of named tensors.

    Buffers are keyed by name and (re)allocated only when a name is new or its shape or dtype
    changed; in a training loop that happens on the first save only.
    """

    def __init__(self, *, writer: WriterProcess | None = None) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}
        self.allocations = 0
        """How many buffers were ever allocated (tests check reuse with it)."""
        self.writer = writer
        """With a writer process, the buffers live in memfds that it maps too (:meth:`locate`):
        one memfd (an *arena*) for all the buffers one :meth:`reserve` call allocates, so the
        first save of a model of thousands of tensors holds one descriptor, not thousands."""
        self._where: dict[str, tuple[int, int]] = {}
        """Name -> (arena id, byte offset) of the buffers in shared memory."""
        self._by_ptr: dict[int, tuple[int, int]] = {}
        """A shared buffer's data pointer -> (arena id, byte offset)."""
        self._live: dict[int, int] = {}
        """Arena id -> how many of its buffers are in use; at 0 the writer forgets it."""
        self._next_id = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into the buffers; return the buffers, under the same names.

        When this returns, every copy has completed: the sources may be modified at once.
        """
        pairs = self.reserve(tensors)
        self.copy(list(pairs.values()))
        return {name: dst for name, (dst, _) in pairs.items()}

    def reserve(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The buffer of each of ``tensors`` (allocated if new or reshaped), nothing copied:
        ``{name: (buffer, source)}``, for :meth:`copy`, now or on another thread."""
        # Buffers of names that left the state would pin memory for nothing.
        for gone in set(self._bufs) - set(tensors):
            self._free(gone)
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        new: list[tuple[str, torch.Tensor]] = []
        for name, src in tensors.items():
            if not isinstance(src, torch.Tensor):
                raise CheckpointError(
                    f"staging {name!r}: expected a tensor, got {type(src).__name__}; "
                    "only tensors are staged (JSON values are copied as they are)"
                )
            buf = self._bufs.get(name)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                self._free(name)
                if self.writer is not None:
                    new.append((name, src))
                    continue
                buf = torch.empty(
                    src.shape, dtype=src.dtype, device="cpu", pin_memory=_can_pin(src)
                )
                self._bufs[name] = buf
                self.allocations += 1
            pairs[name] = (buf, src)
        if new:
            for name, buf in self._shared(new).items():
                self._bufs[name] = buf
                self.allocations += 1
            pairs = {name: (self._bufs[name], src) for name, src in tensors.items()}
        return pairs

    _ALIGN = 64
    """Each buffer in an arena starts on a cache line."""

    def _shared(self, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Buffers for ``tensors`` in one new memfd, registered with the writer process.
        (Not pinned: a GPU state's copies then go through pageable memory.)"""
        assert self.writer is not None
        offsets: list[int] = []
        size = 0
        for _, src in tensors:
            offsets.append(size)
            # at least one line each, so that no two buffers share a first byte (:meth:`locate`)
            size += max(1, -(-src.numel() * src.element_size() // self._ALIGN)) * self._ALIGN
        fd = os.memfd_create("baton-stage", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            arena = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        arena_id, self._next_id = self._next_id, self._next_id + 1
        self.writer.add_arena(arena_id, fd, size)
        self._live[arena_id] = len(tensors)
        out: dict[str, torch.Tensor] = {}
        for (name, src), off in zip(tensors, offsets, strict=True):
            nbytes = src.numel() * src.element_size()
            buf = arena[off : off + nbytes].view(src.dtype).view(src.shape)
            self._where[name] = (arena_id, off)
            self._by_ptr[buf.data_ptr()] = (arena_id, off)
            out[name] = buf
        return out

    def _free(self, name: str) -> None:
        """Drop ``name``'s buffer; the writer forgets its arena once no buffer in it is used
        (the memory goes with the last tensor viewing it)."""
        buf = self._bufs.pop(name, None)
        where = self._where.pop(name, None)
        if buf is None or where is None:
            return
        if self._by_ptr.get(buf.data_ptr()) == where:
            del self._by_ptr[buf.data_ptr()]
        arena_id = where[0]
        self._live[arena_id] -= 1
        if self._live[arena_id] == 0:
            del self._live[arena_id]
            assert self.writer is not None
            self.writer.drop_arena(arena_id)

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """Where the shared buffer ``t`` is (the whole buffer, from its first byte): the writer
        process's id of its arena and its byte offset there; None if ``t`` is not one."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        return self._by_ptr.get(t.data_ptr())

    def copy(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        after: Mapping[torch.device, Any] | None = None,
    ) -> None:
        """Copy each ``(buffer, source)`` pair; return when every copy is complete.

        A device copy waits for the kernels queued on the device's current stream, or, from
        another thread than the one that queued them, for the event in ``after`` that the
        queuing thread recorded (:func:`mark_streams`)."""
        self._copy(pairs, after or {})

    def _copy(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        after: Mapping[torch.device, Any],
    ) -> None:
        events = []
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        host: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in pairs:
            if src.device.type == "cuda":
                by_device.setdefault(src.device, []).append((dst, src))
            else:
                host.append((dst, src))
        for device, group in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
                self._streams[device] = stream
            # The side stream must see every kernel already queued on the training stream
            # that writes these tensors; then the copies run as DMA into pinned memory.
            mark = after.get(device)
            if mark is not None:
                stream.wait_event(mark)
            else:
                stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for dst, src in group:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
            events.append(event)
        # Host-to-host copies overlap with the device copies above.
        for dst, src in host:
            dst.copy_(src)
        # Wait for the DMA before returning: after this the caller may overwrite the sources
        # (and the caching allocator may reuse their memory) without touching the copy.
        for event in events:
            event.synchronize()


def _can_pin(src: torch.Tensor) -> bool:
    return src.device.type == "cuda" and torch.cuda.is_available()


def mark_streams(tensors: Iterable[torch.Tensor]) -> dict[torch.device, Any]:
    """An event recorded on the calling thread's current stream of each GPU that holds one of
    ``tensors``: a copy on another thread waits for it, so it sees every kernel that this
    thread queued before (the current stream is per thread where the training loop uses its
    own streams)."""
    marks: dict[torch.device, Any] = {}
    for t in tensors:
        if t.device.type == "cuda" and t.device not in marks:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(t.device))
            marks[t.device] = event
    return marks

"""The notice agreement at each step boundary, overlapped with the next step when steps are short.

Every rank must take the same decision at the same step (save for a notice, save by the
seconds policy, raise a background save's failure), so at every ``notice_every``-th boundary
the ranks exchange what each has heard in one small collective (:func:`signals.agree`). When
steps are shorter than ``notice_overlap_below`` seconds, that collective is started at one
boundary and waited for at the next (:func:`signals.start_agreement`), so the training step
hides its latency; the decision is then acted on one step later, identically on every rank.

Who calls what: ``Checkpointer.step`` calls :meth:`NoticeAgreement.agree` first and
:meth:`NoticeAgreement.overlap_next` last (after any save of the step); every collective of
the Checkpointer's group first calls :meth:`NoticeAgreement.settle`, so that an overlapped
agreement never interleaves with a save's collectives; ``close`` settles with ``on_close``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from trainer_sdk.loop._config import CheckpointerConfig
from trainer_sdk.loop._save_engine import SaveEngine
from trainer_sdk.loop.signals import (
    Agreement,
    LocalNotice,
    NoticeBoard,
    PendingAgreement,
    agree,
    agreement_buffer,
    start_agreement,
)
from trainer_sdk.staging import AsyncSaver

__all__ = ["NoticeAgreement"]

log = logging.getLogger("trainer_sdk.checkpointer")


class NoticeAgreement:
    """One rank's side of the boundary agreement (every rank builds one, with the same
    ``group``)."""

    def __init__(
        self,
        *,
        rank: int,
        group: Any | None,
        config: CheckpointerConfig,
        board: NoticeBoard,
        saver: AsyncSaver | None,
        engine: SaveEngine,
    ) -> None:
        self.rank, self.group, self.config = rank, group, config
        self.board, self.saver, self.engine = board, saver, engine
        self._pending: PendingAgreement | None = None
        """The overlapped notice agreement started at the last boundary (every rank has one,
        or none), waited for and acted on at the next."""
        self._last_boundary: float | None = None
        """Rank 0's monotonic clock at the last agreed boundary (identical on every rank)."""
        self._buffer = agreement_buffer()
        self._entered = 0.0
        """This rank's monotonic clock when the current boundary began."""
        self._overlap = False
        """Whether the current boundary decided to overlap the next agreement."""

    def agree(self, step: int) -> tuple[Agreement | None, LocalNotice | None]:
        """At the boundary after ``step``: the agreed answer and what this rank had heard, or
        ``(None, None)`` at a boundary that does not agree (``notice_every``)."""
        self._entered = time.monotonic()
        self._overlap = False
        if self.group is not None and step % self.config.notice_every != 0:
            return None, None
        pending, self._pending = self._pending, None
        if pending is not None:  # started at the last boundary; ran during this step
            local = pending.local
            agreement = pending.wait(self.config.timeout)
        else:
            local = self.local_notice()
            agreement = agree(local, rank=self.rank, group=self.group)
        self._overlap = self.group is not None and self._overlap_next(agreement)
        return agreement, local

    def overlap_next(self, step: int) -> None:
        """Last at a boundary, after any save: when this boundary decided to overlap, what
        this rank knows now goes to every rank during the next step, and every rank acts on
        it at the next boundary."""
        if not self._overlap:
            return
        self._overlap = False
        self._pending = start_agreement(
            self.local_notice(),
            step=step,
            rank=self.rank,
            group=self.group,
            boundary=self._entered,
            buffer=self._buffer,
        )

    def local_notice(self) -> LocalNotice:
        """What this rank has heard: a notice, a failed background save, the seconds policy."""
        handle = self.saver.in_flight if self.saver is not None else None
        due_seconds = (
            self.config.every_seconds is not None
            and self.engine.clock() - self.engine.last_save_time >= self.config.every_seconds
        )
        return self.board.local(
            background_failed=handle is not None and handle.exception() is not None,
            periodic_due=due_seconds,
        )

    def _overlap_next(self, agreement: Agreement) -> bool:
        """Whether to overlap the next agreement with the next step. Decided from agreed
        values only (rank 0's clock), so every rank decides the same."""
        previous, self._last_boundary = self._last_boundary, agreement.rank0_monotonic
        below = self.config.notice_overlap_below
        if below <= 0:
            return False
        return previous is None or agreement.rank0_monotonic - previous < below

    def settle(self, *, on_close: bool = False) -> None:
        """Finish an overlapped agreement before another collective uses the group (its
        answer is kept and acted on at the next boundary, as planned); on close, drop it and
        warn about a notice it carried that can no longer be served."""
        pending = self._pending
        if pending is None:
            return
        if not on_close:
            pending.wait(self.config.timeout)
            return
        self._pending = None
        try:
            agreement = pending.wait(self.config.timeout)
        except Exception as e:  # closing: the other ranks may be gone; never hang or mask
            log.warning(
                "rank %d: the last notice agreement (step %d) did not finish at close: %s",
                self.rank,
                pending.step,
                e,
            )
            return
        if agreement.notice:
            log.warning(
                "rank %d: a notice (%s) arrived during the last step and was not served: the "
                "Checkpointer was closed first",
                self.rank,
                ", ".join(sorted(agreement.sources)),
            )

"""How the controller writes: guarded status patches and best-effort Events.

Every status write is guarded by the ``resourceVersion`` the tick read (or its own last write
returned). If anyone else changed the job in between (a second operator, a user's edit, an
API-fault report), the API server answers 409 and :class:`errors.KubeConflictError` ends the
tick, which starts again from a fresh read and decides anew: a write that must not be lost
(an attempt increment, a committed step) is never applied on top of a status it never saw.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from baton_operator.client.kube import Kube, describe
from baton_operator.pure.jobstatus import StatusPatch
from baton_operator.pure.tick import Tick

__all__ = ["EventPoster", "StatusWriter"]

_log = logging.getLogger("baton_operator.writing")

EventPoster = Callable[[Mapping[str, Any], str, str, str], Awaitable[None]]
"""``post(job_body, type, reason, message)``: posts a Kubernetes Event about the job."""


class StatusWriter:
    """Writes a tick's status patches and Events."""

    def __init__(self, kube: Kube, post_event: EventPoster) -> None:
        self._kube = kube
        self._post = post_event

    async def patch(self, t: Tick, patch: StatusPatch) -> None:
        """Write ``patch``, guarded by the resourceVersion ``t`` holds; ``t`` follows it."""
        t.version = await self._kube.patch_job_status(
            t.spec.namespace, t.spec.name, patch.render(), resource_version=t.version
        )
        if t.version is not None:
            # The next tick must not read back less than this from the watch cache.
            t.memory.written_version = t.version
        phase = patch.new_phase
        if phase is not None:
            t.status = replace(t.status, phase=phase)

    async def event(self, job: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        """Post an Event (best effort: a failure is logged, never raised)."""
        _log.info("%s/%s: %s: %s", job["metadata"]["namespace"], job["metadata"]["name"],
                  reason, message)  # fmt: skip
        try:
            await self._post(job, kind, reason, message)
        except Exception as e:  # an Event is best effort; never let it stop the reconcile
            # The API server's reason and message (an RBAC refusal says which verb is
            # missing); never a traceback or headers, which can carry the token (kopf#305).
            _log.warning(
                "%s/%s: could not post Event %s: %s",
                job["metadata"]["namespace"], job["metadata"]["name"], reason, describe(e),
            )  # fmt: skip

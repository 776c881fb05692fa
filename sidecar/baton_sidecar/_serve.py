"""Run the sidecar: the HTTP server, the status watcher and the cloud pollers, until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
from datetime import datetime
from pathlib import Path

import aiohttp
from aiohttp import web

from baton_sidecar._clouds import AzurePoller, detect_clouds, make_pollers
from baton_sidecar._config import Cloud, SidecarConfig
from baton_sidecar._core import Sidecar
from baton_sidecar._errors import ConfigError
from baton_sidecar._replication import Replicator
from baton_sidecar._server import TokenFile, create_app
from trainer_sdk.replication import (
    BELL_FILE,
    FILL,
    OPS,
    Answer,
    read_request,
    request_path,
    write_answer,
)

__all__ = ["serve"]

log = logging.getLogger("baton_sidecar")

# Auto-detection tries again after these pauses: a metadata endpoint can be slow to answer
# right after a node boots.
_DETECT_RETRIES = (2.0, 10.0)


async def serve(config: SidecarConfig, *, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set or the process gets SIGTERM/SIGINT."""
    token = TokenFile(config.token_file)  # fails fast, before binding, if it is unusable
    sidecar = Sidecar(config)
    try:
        config.control_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create the control directory {config.control_dir}: {e.strerror}. Mount "
            "the baton-control emptyDir there or pass --control-dir / BATON_CONTROL_DIR"
        ) from e
    replicator: Replicator | None = None
    if config.fast_dir is not None:
        try:
            (config.fast_dir / "replicas").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"cannot create {config.fast_dir}/replicas: {e.strerror}. Mount the memory "
                "tier's emptyDir at BATON_FAST_DIR in the sidecar too"
            ) from e
        replicator = Replicator(config, token=token.current, metrics=sidecar.metrics)
        sidecar.replication = replicator.status
    app = create_app(sidecar, token, replicator)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession() as session:  # trust_env=False: never proxy link-local
        try:
            site = web.TCPSite(runner, config.host, config.port)
            await site.start()
            log.info(
                "baton-sidecar listening on %s:%d, control dir %s, cloud %s",
                config.host,
                config.port,
                config.control_dir,
                config.cloud.value,
            )
            tasks.append(asyncio.create_task(sidecar.watch_status(), name="status"))
            if replicator is not None:
                tasks.append(asyncio.create_task(_advertise(replicator), name="advert"))
                tasks.append(
                    asyncio.create_task(_serve_requests(config, replicator), name="replication")
                )
            tasks.append(
                asyncio.create_task(_run_clouds(config, sidecar, session, tasks), name="clouds")
            )
            await stop.wait()
            for task in tasks:  # no new notices: only the status is still worth serving
                if task.get_name() != "status":
                    task.cancel()
            await _linger(config, sidecar, loop)
            _write_final_report(config, sidecar)
            log.info("stopping")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await runner.cleanup()
            if replicator is not None:
                replicator.withdraw()


async def _advertise(replicator: Replicator) -> None:
    """Keep the advert fresh: the SDK asks for replication only while it is."""
    while True:
        try:
            replicator.advertise()
        except OSError as e:
            log.error("cannot write the replication advert in the control directory: %s", e)
        await asyncio.sleep(1.0)


async def _serve_requests(config: SidecarConfig, replicator: Replicator) -> None:
    """Take the SDK's replication requests and answer each.

    The SDK rings the bell (a FIFO, ``trainer_sdk.replication.BELL_FILE``) after writing a
    request; between bells the sidecar looks once every ``replication_poll_interval``. A look
    costs a ``stat`` per op, but 50 looks a second in each pod took about 2 % of a core from
    the training steps beside them, and the bell costs nothing while nothing happens.
    """
    bell = _Bell(config.control_dir, config.replication_poll_interval)
    try:
        while True:
            bell.clear()  # before looking: a bell during the look means look again
            for op in OPS:
                await _answer_request(config, replicator, op)
            await bell.wait(config.replication_poll_interval)
    finally:
        bell.close()


async def _answer_request(config: SidecarConfig, replicator: Replicator, op: str) -> None:
    if not request_path(config.control_dir, op).exists():
        return
    req = read_request(config.control_dir, op)
    if req is None:
        return
    try:
        if op == FILL:
            answer = await asyncio.to_thread(replicator.fill)
        elif req.step is None:
            answer = Answer(id=req.id, ok=False, error="a replicate request needs a step")
        else:
            answer = await asyncio.to_thread(replicator.replicate, req.step)
    except Exception as e:  # answered, never left unanswered
        log.exception("the %s request failed", op)
        answer = Answer(id=req.id, ok=False, step=req.step, error=f"{type(e).__name__}: {e}")
    try:
        write_answer(config.control_dir, op, dataclasses.replace(answer, id=req.id))
    except OSError as e:
        log.error("cannot answer the %s request in %s: %s", op, config.control_dir, e)


class _Bell:
    """The read end of the control directory's FIFO, as an event the loop can wait on.

    The sidecar holds a write end too, so that the read end never reports end-of-file (and
    wakes the loop for nothing) between the SDK's bells. Without a FIFO (a filesystem that
    cannot hold one) it only times out: the sidecar then looks once per wait.
    """

    def __init__(self, control_dir: Path, poll: float) -> None:
        self.path = control_dir / BELL_FILE
        self._rung = asyncio.Event()
        self._fds: list[int] = []
        self._loop = asyncio.get_running_loop()
        try:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # a previous sidecar's, or anything else in the way
            os.mkfifo(self.path, 0o600)
            # The trainer may run as another user (contracts.md); a bell rung by anyone else
            # in the pod only makes the sidecar look at its request files.
            os.chmod(self.path, 0o622)  # noqa: S103
            self._fds.append(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
            self._fds.append(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError as e:
            self.close()
            log.warning(
                "cannot make the replication bell %s (%s): looking for requests every %ss",
                self.path,
                e.strerror,
                poll,
            )
            return
        self._loop.add_reader(self._fds[0], self._drain)

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._fds[0], 4096):
                pass
        self._rung.set()

    def clear(self) -> None:
        self._rung.clear()

    async def wait(self, timeout: float) -> None:
        """Until a bell or ``timeout`` seconds, whichever comes first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._rung.wait(), timeout)

    def close(self) -> None:
        if self._fds:
            self._loop.remove_reader(self._fds[0])
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        with contextlib.suppress(OSError):
            self.path.unlink()


async def _linger(config: SidecarConfig, sidecar: Sidecar, loop: asyncio.AbstractEventLoop) -> None:
    """Keep serving while a checkpoint outcome is unread, up to ``config.linger_seconds``.

    The trainer exits right after its notice save and the kubelet stops this container at
    once; without this the operator could miss the ``committed`` it is polling for and fall
    back to an older step. A second SIGTERM or SIGINT ends the wait.
    """
    waiting = sidecar.unanswered() if config.linger_seconds > 0 else None
    if waiting is None:
        return
    again = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, again.set)
    log.info(
        "stopping after the checkpoint outcome is read (at most %.1fs more): %s",
        config.linger_seconds,
        waiting,
    )
    start = loop.time()
    end = start + config.linger_seconds
    while waiting is not None and not again.is_set() and loop.time() < end:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(again.wait(), timeout=0.1)
        waiting = sidecar.unanswered()
    if waiting is not None:
        log.warning(
            "stopping after %.1fs with %s (%s)",
            loop.time() - start,
            waiting,
            "a second signal" if again.is_set() else "the linger is over",
        )


def _write_final_report(config: SidecarConfig, sidecar: Sidecar) -> None:
    """The save's outcome into the container's termination message, which the kubelet keeps
    in the pod's status after this container ends: an operator that could not poll this
    sidecar before it stopped (a new leader, or one back from an API outage) reads the commit
    there. Best effort: a missing or unwritable file is logged."""
    if config.termination_log is None:
        return
    report = sidecar.final_report()
    if report is None:
        return
    try:
        config.termination_log.write_text(report)
    except OSError as e:
        log.warning("cannot write the final report to %s: %s", config.termination_log, e)


async def _run_clouds(
    config: SidecarConfig,
    sidecar: Sidecar,
    session: aiohttp.ClientSession,
    tasks: list[asyncio.Task[None]],
) -> None:
    if config.cloud is Cloud.NONE:
        sidecar.clouds = []
        log.info("cloud notices off (--cloud none): only the operator asks for checkpoints")
        return
    if config.cloud is Cloud.AUTO:
        clouds = await detect_clouds(config, session)
        for pause in _DETECT_RETRIES:
            if clouds:
                break
            await asyncio.sleep(min(pause, config.backoff_max))
            clouds = await detect_clouds(config, session)
        if not clouds:
            sidecar.clouds = []
            log.info(
                "no cloud metadata endpoint answered; cloud notices off. Set --cloud "
                "aws|gce|azure to watch one anyway"
            )
            return
        log.info("detected cloud(s): %s", ", ".join(c.value for c in clouds))
    else:
        clouds = [config.cloud]

    async def sink(source: str, deadline: datetime | None, reason: str) -> str:
        request, _ = await sidecar.request_checkpoint(
            deadline=deadline, reason=reason, source=source
        )
        return request.id

    sidecar.clouds = [c.value for c in clouds]
    pollers = make_pollers(
        clouds, config=config, session=session, sink=sink, metrics=sidecar.metrics
    )
    for poller in pollers:
        if isinstance(poller, AzurePoller):
            sidecar.add_listener(poller.on_status)
        tasks.append(asyncio.create_task(poller.run(), name=f"poll-{poller.name}"))

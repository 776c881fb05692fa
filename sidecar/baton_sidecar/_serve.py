"""Run the sidecar: the HTTP server, the status watcher and the cloud pollers, until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from datetime import datetime

import aiohttp
from aiohttp import web

from baton_sidecar._clouds import AzurePoller, detect_clouds, make_pollers
from baton_sidecar._config import Cloud, SidecarConfig
from baton_sidecar._core import Sidecar
from baton_sidecar._errors import ConfigError
from baton_sidecar._replication import Replicator
from baton_sidecar._server import TokenFile, create_app
from trainer_sdk.replication import FILL, OPS, Answer, read_request, request_path, write_answer

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
    """Take the SDK's replication requests (one ``stat`` per op and poll) and answer each."""
    while True:
        for op in OPS:
            if not request_path(config.control_dir, op).exists():
                continue
            req = read_request(config.control_dir, op)
            if req is None:
                continue
            try:
                if op == FILL:
                    answer = await asyncio.to_thread(replicator.fill)
                elif req.step is None:
                    answer = Answer(id=req.id, ok=False, error="a replicate request needs a step")
                else:
                    answer = await asyncio.to_thread(replicator.replicate, req.step)
            except Exception as e:  # answered, never left unanswered
                log.exception("the %s request failed", op)
                answer = Answer(
                    id=req.id, ok=False, step=req.step, error=f"{type(e).__name__}: {e}"
                )
            try:
                write_answer(config.control_dir, op, dataclasses.replace(answer, id=req.id))
            except OSError as e:
                log.error("cannot answer the %s request in %s: %s", op, config.control_dir, e)
        await asyncio.sleep(config.replication_poll_interval)


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

"""Start rank processes from a process that has already imported torch.

Each ``python -m baton_testing.trainer`` spends about 7 s of CPU importing torch, torch's
distributed and compile packages (DDP and FSDP2 import ``torch._dynamo``) and numpy, before
its first step; 3-4 ranks on 2 shared cores make that 10-15 s per launch, most of an
exactness test's time (``baton_testing.dist``'s ranks pay the same). :func:`start` forks
every rank from one ``multiprocessing`` forkserver that imported them once per pytest
session (:data:`PRELOAD`). A rank is still its own process with its own pid, environment,
working directory, output file and exit status: the tests send it real signals, and its
training and checkpointing code run exactly as in a cold start (the trainer seeds every RNG
itself, after the fork).

``BATON_TEST_COLD_RANKS=1`` makes :func:`baton_testing.trainer.launch` and
:func:`baton_testing.dist.start_ranks` start cold processes again (one ``python`` each).
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

__all__ = ["PRELOAD", "Rank", "WarmRank", "enabled", "start"]

PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch._inductor.config",  # torch.use_deterministic_algorithms imports it (and dynamo)
    "torch.nn.parallel",
    "torch.utils.data",
    "trainer_sdk",
    "baton_testing.dist",
    "baton_testing.throttled",
    "baton_testing.trainer",
]
"""Modules the forkserver imports once; what a rank imports beyond them it imports itself."""


class Rank(Protocol):
    """A started rank: a :class:`subprocess.Popen` (cold) or a :class:`WarmRank`."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


def enabled() -> bool:
    """False when ``BATON_TEST_COLD_RANKS`` asks for cold processes."""
    return os.environ.get("BATON_TEST_COLD_RANKS", "") in ("", "0")


@functools.cache
def _context() -> multiprocessing.context.ForkServerContext:
    """The forkserver, started on the first call (once per pytest session)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # The OpenMP runtime reads OMP_NUM_THREADS once, when torch loads it: in the forkserver,
    # as every cold rank has it (the ranks share 2 cores).
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return ctx


class WarmRank:
    """One forked rank, with the part of :class:`subprocess.Popen`'s interface the tests use
    (``pid``, ``poll``, ``wait``, ``returncode``: negative for a signal, as Popen's)."""

    def __init__(self, proc: BaseProcess) -> None:
        self._proc = proc
        pid = proc.pid
        assert pid is not None
        self._pid = pid

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"trainer rank pid {self.pid}", timeout or 0.0)
        return code

    def kill(self) -> None:
        """SIGKILL, if it still runs."""
        if self._proc.exitcode is None:
            os.kill(self._pid, signal.SIGKILL)


def _rank_main(
    env: dict[str, str], cwd: str, out_path: str, main: str, call_args: list[Any]
) -> None:
    """In the forked rank: the environment, working directory and output a cold start has,
    then the trainer's ``main`` (its return value is the exit status)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    module, _, name = main.rpartition(".")
    fn = getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name)
    sys.exit(fn(*call_args))


def start(
    main: str, call_args: Sequence[Any], *, env: Mapping[str, str], cwd: str, out_path: str
) -> WarmRank:
    """Fork one rank that runs ``main(*call_args)`` (``main`` as ``"module.function"``; its
    return value is the exit status) with exactly ``env`` as its environment, ``cwd`` as its
    directory, stdout and stderr to ``out_path``."""
    proc = _context().Process(
        target=_rank_main,
        args=(dict(env), cwd, out_path, main, list(call_args)),
        # daemon: a rank a failed test leaves running is terminated when pytest exits,
        # not waited for (a cold rank was left behind the same way, never waited for)
        daemon=True,
    )
    proc.start()
    return WarmRank(proc)

"""``torchrun`` jobs for tests: several workers in one "pod", as a user's container runs them.

One launcher for every test that runs a script or module under ``torch.distributed.run``
(the framework integrations through :mod:`baton_testing.hf_runs`, the writer processes, the
sidecar's torchrun tests). torchrun starts each worker in a session of its own, so a kill of
torchrun's process group misses them: :func:`kill` walks the process tree instead, workers'
children (writer processes, data loader workers) included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
"""Variables a launcher sets for its workers; a test run under one must not pass them on."""


def clean_env(**env: str) -> dict[str, str]:
    """This process's environment without Baton's, torchrun's and the launcher's variables
    (a test run inside a pod or under torchrun must not hand them on), one intra-op thread
    per worker, ``tests/`` and the repository importable; then ``env``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "PET_"))}
    for k in LAUNCHER_ENV:
        out.pop(k, None)
    out |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
    return out | env


def launch(
    target: Sequence[str],
    *,
    log: Path,
    nproc: int,
    env: Mapping[str, str],
    shutdown_timeout: int | None = None,
    cwd: Path = REPO,
) -> subprocess.Popen[bytes]:
    """``torchrun --standalone --nproc-per-node=nproc --max-restarts=0 [--shutdown-timeout=S]
    *target`` (``target``: a script and its arguments, or ``-m module ...``) in ``cwd``, in
    a session of its own, its output appended to ``log``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--max-restarts=0"]  # fmt: skip
    if shutdown_timeout is not None:
        cmd.append(f"--shutdown-timeout={shutdown_timeout}")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            [*cmd, *target], env=dict(env), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:]


def finish(proc: subprocess.Popen[bytes], log: Path, *, timeout: float) -> int:
    """torchrun's exit code; past ``timeout`` the job is killed and the test fails with its
    output."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        pytest.fail(f"torchrun ran past {timeout:g}s:\n{tail(log)}")


def kill(proc: subprocess.Popen[bytes], *, also: Iterable[int] = ()) -> None:
    """SIGKILL torchrun, every process under it and ``also`` (pids of workers that torchrun
    may no longer parent), children before parents are reaped; return once each is gone."""
    victims = [*descendants(proc.pid), *also]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    for pid in victims:  # a zombie is gone for our purposes: its parent reaps it
        while _state(pid) not in ("Z", ""):
            assert time.monotonic() < deadline, f"process {pid} survived SIGKILL"
            time.sleep(0.1)


@contextlib.contextmanager
def killed_at_end(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """Yield ``proc``; kill whatever of its job still runs when the block ends."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill(proc)


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (from ``/proc``), parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = _ppid(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def wait_until(
    what: str,
    ready: Callable[[], bool],
    proc: subprocess.Popen[bytes],
    log: Path,
    *,
    timeout: float,
) -> None:
    """Poll ``ready`` until it holds; fail with the job's output if torchrun exits first or
    ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"torchrun exited ({proc.returncode}) before {what}:\n{tail(log)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} in {timeout:g}s:\n{tail(log)}")
        time.sleep(0.1)


def _stat(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return []


def _state(pid: int) -> str:
    """The process's state letter ("Z": a zombie), "" once it is gone."""
    fields = _stat(pid)
    return fields[0] if fields else ""


def _ppid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if len(fields) > 1 else None

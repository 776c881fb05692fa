"""Run a test function on N ranks as real processes with a real gloo process group.

    from baton_testing.dist import run_ranks

    def _body(tmp: str) -> int:            # module level, in a test file or a helper module
        import torch.distributed as dist
        return dist.get_rank()

    assert run_ranks(_body, 2, args=(str(tmp_path),)) == [0, 1]

Each rank is a process of its own, forked from a forkserver that imported torch once per
session (``baton_testing.warm_start``; ``BATON_TEST_COLD_RANKS=1``: a fresh ``python`` each),
with nothing of the test process in it: the function is found again by its file and name,
its arguments and return value travel as JSON. The process group is
initialised before the function runs (``init_pg=False`` to skip) and destroyed after it.
Every rank's exception comes back with its traceback; :class:`RanksFailedError` lists them all.
A run that exceeds ``timeout`` is killed (every rank, SIGKILL), so a hang fails the test
instead of blocking the suite. :func:`start_ranks` gives a handle for fault tests (poll for a
condition, SIGKILL one rank, then collect the others' results).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton_testing import warm_start
from baton_testing.ports import free_port
from baton_testing.warm_start import Rank

__all__ = ["RankGroup", "RankResult", "RanksFailedError", "run_ranks", "start_ranks"]

_TESTS_DIR = str(Path(__file__).resolve().parent.parent)
_REPO_DIR = str(Path(_TESTS_DIR).parent)


@dataclass(frozen=True, kw_only=True)
class RankResult:
    rank: int
    returncode: int | None
    """Exit status (negative: killed by that signal; None: still running when collected)."""
    value: Any = None
    """The function's return value (JSON round-tripped) when it returned."""
    error: str | None = None
    """The traceback when the function raised."""
    error_type: str | None = None
    """The exception's class name when the function raised."""
    output: str = ""
    """The rank's stdout and stderr (tail)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None


class RanksFailedError(AssertionError):
    """At least one rank failed or the run timed out; the message holds every rank's story."""

    def __init__(self, results: Sequence[RankResult], note: str = "") -> None:
        self.results = list(results)
        parts = [note] if note else []
        for r in results:
            if not r.ok:
                parts.append(
                    f"--- rank {r.rank}: exit {r.returncode}, {r.error_type or 'no exception'}\n"
                    f"{r.error or ''}\n{r.output[-4000:]}"
                )
        super().__init__("\n".join(parts))


class RankGroup:
    """Handle on running ranks (from :func:`start_ranks`)."""

    def __init__(self, procs: list[Rank], workdir: str, deadline: float):
        self.procs = procs
        self._workdir = workdir
        self._deadline = deadline

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one rank (SIGKILL by default)."""
        proc = self.procs[rank]
        if proc.poll() is None:
            os.kill(proc.pid, sig)

    def alive(self, rank: int) -> bool:
        return self.procs[rank].poll() is None

    def wait(self, timeout: float | None = None) -> list[RankResult]:
        """Wait for every rank (killing all of them at the deadline) and collect the results."""
        deadline = self._deadline if timeout is None else time.monotonic() + timeout
        timed_out = False
        for proc in self.procs:
            remaining = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(remaining, 0.01))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        if timed_out:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in self.procs:
                proc.wait()
        return [self._result(r, timed_out) for r in range(len(self.procs))]

    def _result(self, rank: int, timed_out: bool) -> RankResult:
        out_path = Path(self._workdir, f"rank{rank}.out")
        output = out_path.read_text(errors="replace")[-20000:] if out_path.exists() else ""
        res_path = Path(self._workdir, f"rank{rank}.result.json")
        rc = self.procs[rank].returncode
        if timed_out and rc is not None and rc < 0:
            output += "\n[baton_testing.dist: killed at the timeout]"
        if res_path.exists():
            data = json.loads(res_path.read_text())
            return RankResult(
                rank=rank,
                returncode=rc,
                value=data.get("value"),
                error=data.get("error"),
                error_type=data.get("error_type"),
                output=output,
            )
        return RankResult(rank=rank, returncode=rc, output=output)


def start_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    init_pg: bool = True,
    pg_timeout: float = 60.0,
) -> RankGroup:
    """Start ``fn(*args, **kwargs)`` on ``world_size`` ranks; returns at once."""
    code = getattr(fn, "__code__", None)
    if code is None or fn.__qualname__ != fn.__name__:
        raise TypeError("run_ranks needs a module-level function (it is re-imported by file)")
    workdir = tempfile.mkdtemp(prefix="baton-ranks-")
    spec = {
        "file": code.co_filename,
        "name": fn.__name__,
        "args": list(args),
        "kwargs": dict(kwargs or {}),
        "init_pg": init_pg,
        "pg_timeout": pg_timeout,
        "workdir": workdir,
    }
    spec_path = Path(workdir, "spec.json")
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs: list[Rank] = []
    for rank in range(world_size):
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env.update((rank_env or {}).get(rank, {}))
        child_env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONPATH": os.pathsep.join(
                    [_TESTS_DIR, _REPO_DIR, child_env.get("PYTHONPATH", "")]
                ).rstrip(os.pathsep),
                # small thread pools: the ranks share a few cores with each other
                "OMP_NUM_THREADS": child_env.get("OMP_NUM_THREADS", "1"),
            }
        )
        out_path = Path(workdir, f"rank{rank}.out")
        if warm_start.enabled():
            procs.append(
                warm_start.start(
                    "baton_testing.dist._child_main",
                    [str(spec_path)],
                    env=child_env,
                    cwd=_REPO_DIR,
                    out_path=str(out_path),
                )
            )
            continue
        out = open(out_path, "wb")  # noqa: SIM115 - closed below
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "baton_testing.dist", str(spec_path)],
                env=child_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=_REPO_DIR,
            )
        )
        out.close()
    return RankGroup(procs, workdir, time.monotonic() + timeout)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    init_pg: bool = True,
    pg_timeout: float = 60.0,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks and return each rank's return value, in rank order.

    Raises :class:`RanksFailedError` (an AssertionError, so pytest shows it well) if any rank
    raised, exited non-zero, or the run took longer than ``timeout`` seconds.
    """
    group = start_ranks(
        fn,
        world_size,
        args=args,
        kwargs=kwargs,
        timeout=timeout,
        env=env,
        rank_env=rank_env,
        init_pg=init_pg,
        pg_timeout=pg_timeout,
    )
    results = group.wait()
    if not all(r.ok for r in results):
        raise RanksFailedError(results, note=f"{fn.__name__} on {world_size} ranks failed")
    return [r.value for r in results]


def _child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    result_path = Path(spec["workdir"], f"rank{rank}.result.json")
    pg_started = False
    try:
        mod_spec = importlib.util.spec_from_file_location(
            f"_baton_rank_{Path(spec['file']).stem}", spec["file"]
        )
        assert mod_spec is not None
        assert mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_spec.name] = module
        mod_spec.loader.exec_module(module)
        fn = getattr(module, spec["name"])
        if spec["init_pg"]:
            from datetime import timedelta

            import torch.distributed as dist

            dist.init_process_group("gloo", timeout=timedelta(seconds=spec["pg_timeout"]))
            pg_started = True
        value = fn(*spec["args"], **spec["kwargs"])
        payload = {"value": value}
    except BaseException as e:  # report everything, including SystemExit and KeyboardInterrupt
        payload = {
            "error": traceback.format_exc(),
            "error_type": type(e).__name__,
        }
        result_path.write_text(json.dumps(payload, default=repr))
        sys.stdout.flush()
        # skip the process-group teardown: peers may be gone, and a clean exit must not hang
        os._exit(1)
    result_path.write_text(json.dumps(payload, default=repr))
    sys.stdout.flush()
    sys.stderr.flush()
    if pg_started:
        # Tear down in a helper thread with a bound: after a fault test a collective may still
        # be pending in the backend, and destroying the group would then wait for it forever.
        import threading

        import torch.distributed as dist

        t = threading.Thread(target=dist.destroy_process_group, daemon=True)
        t.start()
        t.join(timeout=10.0)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))

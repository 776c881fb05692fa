"""``trainer_sdk.run(main)`` leaves as ``sys.exit(main())`` does, without the module teardown.

Each test runs a real script in its own interpreter (the teardown, ``atexit`` and exit statuses
exist only at a process's end) and reads what the process left: its status, its output, the
files its handlers wrote. One script uses DDP over gloo at 3 ranks and loses a peer for real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from baton_testing.ports import free_port

_PRELUDE = """
import atexit, sys, threading, time
from pathlib import Path
import trainer_sdk
out = Path(sys.argv[1])

class Teardown:
    # a module global's finalizer runs in the teardown that run() skips
    def __del__(self):
        (out / "teardown").write_text("ran")

KEEP = Teardown()
atexit.register(lambda: (out / "atexit").write_text("ran"))
"""


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_returned_status_is_the_exit_status_after_threads_atexit_and_flushes(
    tmp_path: Path,
) -> None:
    proc = _run(
        tmp_path,
        """
        def finish_later():
            time.sleep(0.3)
            (out / "thread").write_text("finished")

        def main():
            threading.Thread(target=finish_later).start()  # not a daemon: the exit waits
            log = open(out / "unclosed.log", "w")  # left open, its write still buffered
            log.write("the last line")
            print("to a pipe, buffered")
            return 75

        trainer_sdk.run(main)
        """,
    )
    assert proc.returncode == 75, proc.stderr
    assert proc.stdout == "to a pipe, buffered\n"
    assert (tmp_path / "thread").read_text() == "finished"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "unclosed.log").read_text() == "the last line"
    # the teardown itself is what is skipped
    assert not (tmp_path / "teardown").exists()


def test_threads_that_wait_for_the_interpreters_shutdown_are_released(tmp_path: Path) -> None:
    """A ``ThreadPoolExecutor`` left open (its workers are not daemons: they wait on a queue
    until threading's shutdown callback stops them) and a thread that runs until the main thread
    has stopped: a plain join of the non-daemon threads would wait forever on both."""
    proc = _run(
        tmp_path,
        """
        from concurrent.futures import ThreadPoolExecutor

        def watch():
            while threading.main_thread().is_alive():
                time.sleep(0.02)
            (out / "watcher").write_text("saw the main thread stop")

        def main():
            pool = ThreadPoolExecutor(2)  # never shut down
            pool.submit(lambda: (out / "pooled").write_text("done"))
            threading.Thread(target=watch).start()
            return 0

        trainer_sdk.run(main)
        """,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "pooled").read_text() == "done"
    assert (tmp_path / "watcher").read_text() == "saw the main thread stop"
    assert not (tmp_path / "teardown").exists()


def test_the_same_script_under_sys_exit_runs_the_teardown(tmp_path: Path) -> None:
    """The control for the test above: the finalizer is a real sign of the teardown."""
    proc = _run(tmp_path, "sys.exit(75)\n")
    assert proc.returncode == 75, proc.stderr
    assert (tmp_path / "teardown").read_text() == "ran"


@pytest.mark.parametrize(
    ("body", "status", "stderr"),
    [
        ("return None", 0, ""),
        ("sys.exit(3)", 3, ""),
        ("sys.exit(None)", 0, ""),
        ("sys.exit('stopped: no data')", 1, "stopped: no data\n"),
        ("raise RuntimeError('Connection closed by peer')", 1, "Connection closed by peer"),
    ],
)
def test_exit_statuses_match_sys_exit(tmp_path: Path, body: str, status: int, stderr: str) -> None:
    proc = _run(tmp_path, f"def main():\n    {body}\n\ntrainer_sdk.run(main)\n")
    assert proc.returncode == status, proc.stderr
    assert (tmp_path / "atexit").read_text() == "ran"
    if body.startswith("raise"):
        assert "Traceback (most recent call last)" in proc.stderr
        assert "RuntimeError: Connection closed by peer" in proc.stderr
    else:
        assert proc.stderr == stderr


def test_exit_now_refuses_a_thread_other_than_the_main_one(tmp_path: Path) -> None:
    proc = _run(
        tmp_path,
        """
        errors = []
        def other():
            try:
                trainer_sdk.exit_now(0)
            except RuntimeError as err:
                errors.append(str(err))
        t = threading.Thread(target=other)
        t.start()
        t.join()
        print(errors[0])
        trainer_sdk.exit_now(4)
        """,
    )
    assert proc.returncode == 4, proc.stderr
    assert "must be called from the main thread" in proc.stdout


_DDP_RANK = """
import datetime, os, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import trainer_sdk
from pathlib import Path

out = Path(sys.argv[1])

def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (out / f"ready-{dist.get_rank()}").write_text("ready")
    while True:
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.02)

trainer_sdk.run(main)
"""


def test_ddp_ranks_whose_peer_is_killed_exit_with_1_and_the_collectives_error(
    tmp_path: Path,
) -> None:
    """3 ranks of DDP over gloo; rank 2 is SIGKILLed mid-training. The other two fail in their
    next allreduce and leave through ``run``: status 1, gloo's error in their output."""
    script = tmp_path / "rank.py"
    script.write_text(_DDP_RANK)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "3",
        "OMP_NUM_THREADS": "1",
    }
    logs = [tmp_path / f"rank{r}.log" for r in range(3)]
    ranks = []
    for r in range(3):
        with logs[r].open("w") as log:
            ranks.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(tmp_path)],
                    env={**env, "RANK": str(r)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{r}").exists() for r in range(3)):
            assert all(p.poll() is None for p in ranks), [log.read_text() for log in logs]
            assert time.monotonic() < deadline, "the ranks never started training"
            time.sleep(0.1)
        time.sleep(0.5)  # a few steps
        ranks[2].send_signal(signal.SIGKILL)
        codes = [p.wait(timeout=60) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [1, 1, -signal.SIGKILL], [log.read_text() for log in logs]
    for r in (0, 1):
        text = logs[r].read_text()
        assert "Traceback (most recent call last)" in text
        assert "RuntimeError" in text, text

"""The writer process of async saves (``writer_process=True``): the shard file is written by a
child process from the staged copy in shared memory (``trainer_sdk.saveload._writer_process``).

Real processes throughout: the child is the real ``python -m trainer_sdk.saveload._writer_process``,
its death is a real SIGKILL, another writer's commit during the write is a real manifest file
appearing while the child is stopped (SIGSTOP), and the 3-rank case is 3 gloo processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.dist import run_ranks

import trainer_sdk
from trainer_sdk import api
from trainer_sdk.errors import CheckpointError
from trainer_sdk.saveload import _writer_process
from trainer_sdk.staging import AsyncSaveHandle, AsyncSaver, stage_and_commit
from trainer_sdk.storage import open_storage

MIB = 1 << 20


def _state(seed: int) -> dict[str, object]:
    """24 MiB in float32, bf16, int64, a scalar and an empty tensor (above the 16 MiB that a
    save needs to go to the writer process), and a JSON value."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(5)},
        "half": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (4096,), generator=g),
        "scalar": torch.tensor(seed),
        "empty": torch.zeros(0, 3),
        "note": {"seed": seed},
    }


def _zeros_like(state: dict[str, object]) -> dict[str, object]:
    def z(v: object) -> object:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        return v

    return {k: z(v) for k, v in state.items()}


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _submit(
    saver: AsyncSaver, state: dict[str, object], uri: str, step: int
) -> AsyncSaveHandle[trainer_sdk.SaveInfo]:
    """Start an async save of ``state`` as rank 0 of 1; the handle, not waited for."""
    flat = api.flatten(state)
    plan = api.plan_save(flat, 0, 1)
    return stage_and_commit(saver, flat, plan, open_storage(uri), step=step, trigger="manual")


def _save(saver: AsyncSaver, state: dict[str, object], uri: str, step: int) -> trainer_sdk.SaveInfo:
    return _submit(saver, state, uri, step).wait(timeout=120)


def _assert_loads(uri: str, step: int, state: dict[str, object]) -> None:
    """Step ``step`` under ``uri`` loads back into zeros as exactly ``state``."""
    into = _zeros_like(state)
    trainer_sdk.load(into, uri, step=step)
    assert _equal(into, state)


def _shard(root: Path, step: int) -> bytes:
    (shard,) = (root / f"step-{step:012d}").glob("rank-*.safetensors")
    return shard.read_bytes()


def test_the_child_writes_the_bytes_the_thread_writes_and_they_load_back(tmp_path: Path) -> None:
    state = _state(1)
    thread = AsyncSaver(normal_priority_below=16 * MIB)
    proc = AsyncSaver(normal_priority_below=16 * MIB, writer_process=True)
    try:
        _save(thread, state, str(tmp_path / "thread"), 3)
        _save(proc, state, str(tmp_path / "proc"), 3)
        assert proc.writer is not None
        assert proc.writer.pid is not None  # the child wrote it
        assert proc.writer.descriptors == 1  # one memfd for all 9 buffers, not one each
        assert _shard(tmp_path / "proc", 3) == _shard(tmp_path / "thread", 3)
        # the buffers are reused by the next save, through the same mappings
        state["model"]["w0"].add_(1.0)  # type: ignore[index]
        _save(proc, state, str(tmp_path / "proc"), 4)
        assert proc.buffers.allocations == 9
    finally:
        thread.close()
        proc.close()
    _assert_loads(str(tmp_path / "proc"), 4, state)


def test_a_reshaped_tensor_gets_a_new_shared_buffer_and_the_child_maps_it(tmp_path: Path) -> None:
    state = _state(2)
    saver = AsyncSaver(normal_priority_below=16 * MIB, writer_process=True)
    try:
        _save(saver, state, str(tmp_path), 1)
        state["model"]["w1"] = torch.randn(512, 2048)  # type: ignore[index]
        del state["ids"]
        _save(saver, state, str(tmp_path), 2)
        assert saver.buffers.allocations == 10
        assert saver.writer is not None
        assert saver.writer.descriptors == 2  # the first arena is still in use, and the new one
    finally:
        saver.close()
    _assert_loads(str(tmp_path), 2, state)


def _held_save(
    saver: AsyncSaver, state: dict[str, object], uri: str, step: int, mp: pytest.MonkeyPatch
) -> tuple[AsyncSaveHandle[trainer_sdk.SaveInfo], int]:
    """Stop the writer process (SIGSTOP), start a save of ``step`` and return once its write
    request is in the child's socket, unread: the handle and the child's pid."""
    assert saver.writer is not None
    child = saver.writer.pid
    assert child is not None
    os.kill(child, signal.SIGSTOP)
    sent = threading.Event()
    real = _writer_process._send

    def send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
        real(sock, obj, fds)
        if obj.get("op") == "write":
            sent.set()

    mp.setattr(_writer_process, "_send", send)
    handle = _submit(saver, state, uri, step)
    assert sent.wait(timeout=60), "the save never sent its write request"
    assert not handle.done()
    return handle, child


def test_a_writer_killed_mid_save_fails_that_save_and_the_next_one_starts_a_new_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = str(tmp_path)
    state = _state(3)
    saver = AsyncSaver(normal_priority_below=16 * MIB, writer_process=True)
    try:
        _save(saver, state, uri, 1)
        handle, first = _held_save(saver, state, uri, 2, monkeypatch)
        os.kill(first, signal.SIGKILL)
        with pytest.raises(CheckpointError, match=r"writer process exited \(code -9\).*previous"):
            saver.wait_previous()  # the saver's own wait: raised there once, then forgotten
        assert handle.done()
        assert trainer_sdk.latest_step(uri) == 1
        state["scalar"] = torch.tensor(33)
        _save(saver, state, uri, 3)
        assert saver.writer is not None
        assert saver.writer.pid not in (None, first)
    finally:
        saver.close()
    _assert_loads(uri, 3, state)


def test_a_writer_that_cannot_start_fails_that_save_with_the_fix_and_the_next_starts_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = str(tmp_path)
    state = _state(4)
    thread = AsyncSaver(normal_priority_below=16 * MIB)
    try:
        _save(thread, state, uri, 1)  # the previous checkpoint, written from a thread
    finally:
        thread.close()
    saver = AsyncSaver(normal_priority_below=16 * MIB, writer_process=True)
    try:
        missing = str(tmp_path / "no-such-python")
        monkeypatch.setattr(sys, "executable", missing)  # the first save starts the child
        handle = _submit(saver, state, uri, 2)
        with pytest.raises(CheckpointError) as failed:
            saver.wait_previous()  # raised there once, then forgotten
        assert handle.done()
        message = str(failed.value)
        assert f"could not start the checkpoint writer process ({missing} -m" in message
        assert "previous checkpoint stands" in message
        assert "writer_process=False" in message
        assert trainer_sdk.latest_step(uri) == 1
        monkeypatch.undo()
        state["scalar"] = torch.tensor(44)
        _save(saver, state, uri, 3)
        assert saver.writer is not None
        assert saver.writer.pid is not None
    finally:
        saver.close()
    _assert_loads(uri, 3, state)


def test_a_step_committed_by_another_writer_during_the_write_is_not_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = str(tmp_path)
    state = _state(4)
    saver = AsyncSaver(normal_priority_below=16 * MIB, writer_process=True)
    try:
        _save(saver, state, uri, 1)
        handle, child = _held_save(saver, state, uri, 2, monkeypatch)
        # another trainer on the same uri commits step 2 while this child is held
        other = tmp_path / "step-000000000002"
        other.mkdir(exist_ok=True)
        (other / "manifest.json").write_text("{}")
        os.kill(child, signal.SIGCONT)
        with pytest.raises(CheckpointError, match=r"committed by another writer"):
            saver.wait_previous()
        assert handle.done()
        assert not list(other.glob("rank-*.safetensors")), "the child published into it"
    finally:
        saver.close()


def test_the_child_imports_no_torch() -> None:
    code = (
        "import sys, trainer_sdk.saveload._writer_process as w; "
        "assert callable(w.main); print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"


def _three_ranks(root: str) -> list[str]:
    """A 3-rank DDP job of ~60 MiB saving in the background through writer processes, then a
    restore in fresh objects on every rank."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(5)))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    ckpt = trainer_sdk.Checkpointer(
        uri=root, model=ddp, optimizer=opt, every_steps=2, async_save=True, writer_process=True,
        handle_sigterm=False,
    )  # fmt: skip
    ckpt.restore()
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(1, 7):
        loss = ddp(torch.randn(8, 1024, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(step)
    ckpt.wait()
    pid = ckpt._saver.writer.pid if ckpt._saver and ckpt._saver.writer else None
    ckpt.close()
    assert pid is not None, "the saves did not go through a writer process"
    torch.manual_seed(1)  # other weights: the restore must bring the saved ones back
    fresh = DistributedDataParallel(
        torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(5)))
    )
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    again = trainer_sdk.Checkpointer(
        uri=root, model=fresh, optimizer=fresh_opt, handle_sigterm=False
    )
    assert again.restore() == 6
    again.close()
    pairs = list(zip(model.parameters(), fresh.parameters(), strict=True))
    same = all(torch.equal(a, b) for a, b in pairs)
    moments = all(
        torch.equal(opt.state[a]["exp_avg"], fresh_opt.state[b]["exp_avg"]) for a, b in pairs
    )
    return [str(same), str(moments)]


@pytest.mark.timeout(600)
def test_three_ranks_save_through_writer_processes_and_restore_bitwise(tmp_path: Path) -> None:
    results = run_ranks(_three_ranks, 3, args=(str(tmp_path / "ckpt"),), timeout=480)
    assert results == [["True", "True"]] * 3
    assert trainer_sdk.latest_step(str(tmp_path / "ckpt")) == 6


_TRAINER = """
import sys, torch
from trainer_sdk import api
from trainer_sdk.staging import AsyncSaver, stage_and_commit
from trainer_sdk.storage import open_storage
saver = AsyncSaver(normal_priority_below=16 << 20, writer_process=True)
state = {"w": torch.randn(6 << 20)}
flat = api.flatten(state)
handle = stage_and_commit(
    saver, flat, api.plan_save(flat, 0, 1), open_storage(sys.argv[1]), step=1, trigger="manual"
)
handle.wait(timeout=120)
print(saver.writer.pid, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_trainer_killed_takes_its_writer_process_with_it(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None
            child = int(proc.stdout.readline())
            assert _alive(child)
        finally:
            proc.kill()
            proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the writer process outlived its trainer"


_SIGNALLED = """
import signal, sys, torch
from trainer_sdk import api
from trainer_sdk.staging import AsyncSaver, stage_and_commit
from trainer_sdk.storage import open_storage
signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM", flush=True))  # the trainer's handler
saver = AsyncSaver(normal_priority_below=16 << 20, writer_process=True)
state = {"w": torch.randn(6 << 20)}
def save(step):
    flat = api.flatten(state)
    plan = api.plan_save(flat, 0, 1)
    stage_and_commit(
        saver, flat, plan, open_storage(sys.argv[1]), step=step, trigger="manual"
    ).wait(timeout=120)
    print(saver.writer.pid, flush=True)
save(1)
sys.stdin.readline()  # the test signals this process's group, then writes a line
save(2)  # what a SIGTERM's save does next
saver.close()
"""


def test_a_sigterm_to_the_trainers_process_group_leaves_its_writer_process_alone(
    tmp_path: Path,
) -> None:
    """torchrun's agent stops a worker with ``killpg(SIGTERM)``, and a terminal's Ctrl-C goes to
    its whole foreground group. The worker's handler then saves: through the same writer
    process, which the signal must not have ended (it was in the worker's group once, and a
    save being written when the signal came failed with it)."""
    with subprocess.Popen(
        [sys.executable, "-c", _SIGNALLED, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            assert proc.stdin is not None
            assert proc.stdout is not None
            first = int(proc.stdout.readline())
            os.killpg(proc.pid, signal.SIGTERM)  # the trainer's group, as torchrun sends it
            assert proc.stdout.readline().strip() == "SIGTERM"
            proc.stdin.write("go\n")
            proc.stdin.flush()
            second = proc.stdout.readline().strip()
            code = proc.wait(timeout=120)
        finally:
            proc.kill()
            proc.wait(timeout=60)
    assert code == 0
    assert second == str(first), "the writer process died with the signal to its trainer's group"
    assert trainer_sdk.list_steps(str(tmp_path)) == [1, 2]


def test_an_arena_whose_buffers_all_left_the_state_is_released(tmp_path: Path) -> None:
    saver = AsyncSaver(normal_priority_below=16 * MIB, writer_process=True)
    try:
        first = {"a": torch.randn(5 << 20)}
        _save(saver, first, str(tmp_path), 1)
        second = {"b": torch.randn(5 << 20)}
        _save(saver, second, str(tmp_path), 2)
        assert saver.writer is not None
        assert saver.writer.descriptors == 1  # a's arena went when a left the state
    finally:
        saver.close()
    into = {"b": torch.zeros(5 << 20)}
    trainer_sdk.load(into, str(tmp_path), step=2)
    assert torch.equal(into["b"], second["b"])

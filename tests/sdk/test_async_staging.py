"""Staging copies into reusable host buffers; background work is one at a time and never silent."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest
import torch

from trainer_sdk.errors import CheckpointError
from trainer_sdk.staging import BACKGROUND_NICE, AsyncSaver, HostBuffers


def test_buffers_are_allocated_once_and_decoupled_from_the_source() -> None:
    bufs = HostBuffers()
    a = torch.arange(1000, dtype=torch.float32)
    b = torch.ones(3, 4, dtype=torch.bfloat16).t()  # not contiguous: staged copy is
    staged = bufs.stage({"a": a, "b": b})
    assert bufs.allocations == 2
    assert torch.equal(staged["a"], a)
    assert torch.equal(staged["b"], b)
    assert staged["b"].is_contiguous()
    first_ptrs = {k: v.data_ptr() for k, v in staged.items()}
    a.add_(1)  # mutation after staging does not reach the copy
    assert staged["a"][0].item() == 0.0
    again = bufs.stage({"a": a, "b": b})
    assert bufs.allocations == 2  # reused
    assert {k: v.data_ptr() for k, v in again.items()} == first_ptrs
    assert again["a"][0].item() == 1.0
    assert bufs.nbytes == 1000 * 4 + 12 * 2
    # a shape change reallocates that buffer only; a vanished name frees its buffer
    bufs.stage({"a": torch.zeros(10)})
    assert bufs.allocations == 3
    assert bufs.nbytes == 40


def test_staging_refuses_non_tensors_with_a_fix() -> None:
    with pytest.raises(CheckpointError, match="only tensors are staged"):
        HostBuffers().stage({"x": [1, 2]})  # type: ignore[dict-item]


def test_background_work_sees_staged_values_and_one_save_at_a_time() -> None:
    saver = AsyncSaver()
    src = torch.zeros(100)
    gate = threading.Event()
    seen: list[float] = []
    running = threading.Semaphore(1)

    def work(tensors: dict[str, torch.Tensor], tree: Any) -> str:
        assert running.acquire(blocking=False), "two saves ran at once"
        try:
            gate.wait(5)
            time.sleep(0.05)
            seen.append(float(tensors["w"].sum()))
            return f"step {tree['step']}"
        finally:
            running.release()

    tree = {"step": 1}
    h1 = saver.submit(step=1, tensors={"w": src}, json_tree=tree, work=work)
    tree["step"] = 99  # the JSON tree was copied at staging time
    src.fill_(7.0)  # so were the tensors
    assert not h1.done()
    assert h1.exception() is None
    gate.set()
    # the second submit waits for the first (its buffers are being read)
    h2 = saver.submit(step=2, tensors={"w": src}, json_tree={"step": 2}, work=work)
    assert h1.done()
    assert h1.wait() == "step 1"
    assert h2.wait() == "step 2"
    assert seen == [0.0, 700.0]
    assert h1.staged_bytes == 400
    saver.close()
    with pytest.raises(CheckpointError, match="closed"):
        saver.submit(step=3, tensors={}, json_tree={}, work=work)


def test_a_background_failure_is_raised_by_the_next_wait_and_by_close() -> None:
    def boom(tensors: dict[str, torch.Tensor], tree: Any) -> None:
        raise OSError(28, "No space left on device")

    saver = AsyncSaver()
    h = saver.submit(step=5, tensors={"w": torch.ones(3)}, json_tree={}, work=boom)
    with pytest.raises(OSError, match="No space left"):
        h.wait()
    assert isinstance(h.exception(), OSError)
    with pytest.raises(OSError, match="No space left"):
        saver.close()

    saver2 = AsyncSaver()
    saver2.submit(step=5, tensors={"w": torch.ones(3)}, json_tree={}, work=boom)
    # the next save raises the previous failure instead of silently starting over
    with pytest.raises(OSError, match="No space left"):
        saver2.submit(step=6, tensors={"w": torch.ones(3)}, json_tree={}, work=boom)
    saver2.close()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_the_background_writer_and_its_helper_threads_yield_the_cpu_to_training() -> None:
    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    main = nice()
    saver = AsyncSaver()
    try:

        def work(staged: dict[str, torch.Tensor], tree: Any) -> tuple[int, int]:
            seen: list[int] = []
            helper = threading.Thread(target=lambda: seen.append(nice()))  # as the hashers
            helper.start()
            helper.join()
            return nice(), seen[0]

        handle = saver.submit(step=1, tensors={"t": torch.ones(4)}, json_tree={}, work=work)
        writer, helper = handle.wait(timeout=60)
    finally:
        saver.close()
    expected = min(main + BACKGROUND_NICE, 19)
    assert (writer, helper) == (expected, expected)
    assert nice() == main  # the training thread keeps its priority


def test_small_saves_and_every_commit_run_at_normal_priority() -> None:
    """At background priority a loaded machine starved a 4 MiB save's commit for seconds
    (bench/commit_latency.py): a save up to ``normal_priority_below`` runs at normal priority,
    and a larger one hands its commit to a normal-priority thread."""

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    main = nice()
    saver = AsyncSaver(normal_priority_below=1 << 20)
    try:

        def work(staged: dict[str, torch.Tensor], tree: Any) -> tuple[int, int]:
            return nice(), saver.at_normal_priority(nice)

        small = saver.submit(step=1, tensors={"t": torch.ones(1024)}, json_tree={}, work=work)
        assert small.wait(timeout=60) == (main, main)
        big = saver.submit(step=2, tensors={"t": torch.ones(1 << 19)}, json_tree={}, work=work)
        assert big.wait(timeout=60) == (min(main + BACKGROUND_NICE, 19), main)
    finally:
        saver.close()


def test_an_async_save_above_the_bound_commits_from_the_normal_thread(tmp_path: Any) -> None:
    """The real path: stage_and_commit writes at background priority and commits through
    at_normal_priority; the step is committed and loads back."""
    import trainer_sdk
    from trainer_sdk import api
    from trainer_sdk.staging import stage_and_commit
    from trainer_sdk.storage import open_storage

    saver = AsyncSaver(normal_priority_below=1024)
    commits: list[int] = []
    real = saver.at_normal_priority

    def counting(fn: Any) -> Any:
        commits.append(1)
        return real(fn)

    saver.at_normal_priority = counting  # type: ignore[method-assign]
    state = {"w": torch.randn(64, 64), "step": 3}
    flat = api.flatten(state)
    try:
        handle = stage_and_commit(
            saver, flat, api.plan_save(flat, 0, 1), open_storage(tmp_path), step=3,
            trigger="periodic",
        )  # fmt: skip
        assert handle.wait(timeout=60).step == 3
    finally:
        saver.close()
    assert commits == [1]
    out: dict[str, Any] = {}
    trainer_sdk.load(out, tmp_path)
    assert torch.equal(out["w"], state["w"])

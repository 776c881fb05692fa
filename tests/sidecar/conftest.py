"""Fixtures for the sidecar tests: real ``baton-sidecar`` processes, stopped cleanly at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from baton_testing.sidecar_process import TOKEN, SidecarProcess


@pytest.fixture
def sidecar_factory(tmp_path: Path) -> Iterator[Callable[..., SidecarProcess]]:
    """Start sidecars; each is stopped (SIGTERM) at the end and must exit cleanly."""
    started: list[SidecarProcess] = []

    def make(**kwargs: Any) -> SidecarProcess:
        sub = tmp_path / f"s{len(started)}"
        sub.mkdir()
        proc = SidecarProcess(sub, **kwargs)
        started.append(proc)
        return proc.start()

    yield make
    for proc in started:
        was_alive = proc.alive()
        code = proc.stop()
        if was_alive:
            assert code == 0, f"sidecar did not exit cleanly on SIGTERM ({code}):\n{proc.log()}"
        assert TOKEN not in proc.log(), "the bearer token appeared in the sidecar's log"


@pytest.fixture
def sidecar(sidecar_factory: Callable[..., SidecarProcess]) -> SidecarProcess:
    """A sidecar with cloud pollers off."""
    return sidecar_factory()


@pytest.fixture(scope="module")
def shared_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    """One sidecar for a module's tests that leave no request behind (starting one costs ~1 s)."""
    proc = SidecarProcess(tmp_path_factory.mktemp("shared")).start()
    yield proc
    assert proc.stop() == 0, proc.log()
    assert TOKEN not in proc.log(), "the bearer token appeared in the sidecar's log"

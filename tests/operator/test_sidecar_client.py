"""The operator's sidecar client against the real ``baton-sidecar`` process."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from baton_operator.client.sidecars import SidecarClient
from baton_operator.pure.errors import SidecarUnreachableError
from baton_operator.pure.vocabulary import EMERGENCY_TRIGGERS, SaveState, Trigger
from baton_testing.ports import free_port
from baton_testing.sidecar_process import TOKEN, SidecarProcess, wait_for

from trainer_sdk import control
from trainer_sdk.control import ControlChannel, State, Status


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(tmp_path).start()
    try:
        yield proc
    finally:
        proc.stop()
        assert TOKEN not in proc.log()


def test_request_then_status_follows_the_sdk_report(sidecar: SidecarProcess) -> None:
    async def scenario() -> None:
        async with SidecarClient(port=sidecar.port, timeout_seconds=5) as client:
            deadline = datetime.now(tz=UTC) + timedelta(seconds=60)
            rid = await client.request_checkpoint(
                "127.0.0.1", TOKEN, deadline=deadline, reason="aws: spot interruption"
            )
            assert rid
            again = await client.request_checkpoint(
                "127.0.0.1", TOKEN, deadline=deadline, reason="second notice"
            )
            assert again == rid, "a second request merges into the pending one"
            channel = ControlChannel(sidecar.control_dir)
            request = channel.read_request()
            assert request is not None
            assert request.id == rid
            # What the SDK writes after committing the requested save.
            channel.write_status(
                Status(state=State.COMMITTED, request_id=rid, step=17, seconds=0.4,
                       uri="/ckpt/step-000000000017", trigger="notice",
                       last_committed_step=17)
            )  # fmt: skip

            async def committed() -> bool:
                s = await client.status("127.0.0.1", TOKEN)
                return s.state == "committed"

            for _ in range(100):
                if await committed():
                    break
                await asyncio.sleep(0.1)
            status = await client.status("127.0.0.1", TOKEN)
            assert status.state == "committed"
            assert status.step == 17
            assert status.request_id == rid
            assert status.committed_step == 17
            assert status.trigger == "notice"

    asyncio.run(scenario())


def test_the_operators_save_vocabulary_is_the_sdks_through_the_real_sidecar(
    sidecar: SidecarProcess,
) -> None:
    # The operator cannot import the SDK, so it mirrors the values it compares; they must be
    # the SDK's exactly, value for value.
    assert [s.value for s in SaveState] == [s.value for s in control.State]
    assert [t.value for t in Trigger] == [t.value for t in control.Trigger]
    assert set(control.Trigger) - control.ROUTINE_TRIGGERS == EMERGENCY_TRIGGERS
    # And on the wire: every state and trigger the SDK writes reaches the operator's client
    # through the real sidecar as the operator's own value.
    channel = ControlChannel(sidecar.control_dir)
    triggers = list(control.Trigger)

    async def scenario() -> None:
        async with SidecarClient(port=sidecar.port, timeout_seconds=5) as client:
            for i, state in enumerate(control.State):
                trigger = triggers[i % len(triggers)]
                channel.write_status(Status(state=state, step=i + 1, trigger=trigger))
                for _ in range(200):
                    seen = await client.status("127.0.0.1", TOKEN)
                    if seen.step == i + 1:
                        break
                    await asyncio.sleep(0.1)
                assert seen.step == i + 1, f"the sidecar never relayed {state}"
                assert SaveState(seen.state) is SaveState(state.value)
                assert seen.trigger is not None
                assert Trigger(seen.trigger) is Trigger(trigger.value)

    asyncio.run(scenario())


def test_a_notice_past_its_deadline_still_asks_for_a_save(sidecar: SidecarProcess) -> None:
    # The sidecar refuses deadlines in the past (422); the client moves them just ahead, and
    # the SDK then decides from its estimate whether a save fits.
    async def scenario() -> None:
        async with SidecarClient(port=sidecar.port, timeout_seconds=5) as client:
            late = datetime.now(tz=UTC) - timedelta(seconds=30)
            rid = await client.request_checkpoint("127.0.0.1", TOKEN, deadline=late, reason="late")
            assert rid

    before = datetime.now(tz=UTC)
    asyncio.run(scenario())
    request = ControlChannel(sidecar.control_dir).read_request()
    assert request is not None
    assert request.deadline is not None
    assert request.deadline > before


def test_wrong_token_and_dead_sidecar_raise_without_the_token(sidecar: SidecarProcess) -> None:
    async def scenario() -> None:
        async with SidecarClient(port=sidecar.port, timeout_seconds=2) as client:
            with pytest.raises(SidecarUnreachableError, match="HTTP 401") as bad:
                await client.status("127.0.0.1", "not-the-token")
            assert "not-the-token" not in str(bad.value)
        async with SidecarClient(port=free_port(), timeout_seconds=2) as client:
            with pytest.raises(SidecarUnreachableError, match="is the pod running") as dead:
                await client.status("127.0.0.1", TOKEN)
            assert TOKEN not in str(dead.value)

    asyncio.run(scenario())
    wait_for(sidecar.alive, what="the sidecar still serving")

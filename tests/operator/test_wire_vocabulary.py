"""The operator's mirror of the wire vocabulary is the SDK's, value for value.

The operator may not import the SDK (import-linter contract: it talks HTTP and its image has
no torch), so ``baton_operator.pure.vocabulary`` repeats the values of ``trainer_sdk.wire`` that it
compares. A value added on one side only (a new tier, state or trigger) fails here, before a
job meets a word the other side does not know. ``test_sidecar_client.py`` checks the same
values through the real sidecar.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import pytest
from baton_operator.pure import crd, lifecycle, notices, settings, vocabulary

from trainer_sdk import wire

SHARED: list[tuple[type[StrEnum], type[StrEnum]]] = [
    (wire.State, vocabulary.SaveState),
    (wire.Trigger, vocabulary.Trigger),
    (wire.Tier, vocabulary.Tier),
]


@pytest.mark.parametrize(("sdk", "operator"), SHARED, ids=lambda e: e.__name__)
def test_each_shared_vocabulary_is_spelled_the_same_on_both_sides(
    sdk: type[StrEnum], operator: type[StrEnum]
) -> None:
    # Names and values, in order: a value on one side only, or one spelled differently, fails.
    assert [(m.name, m.value) for m in operator] == [(m.name, m.value) for m in sdk]


def test_the_emergency_triggers_are_the_sdks_non_routine_ones() -> None:
    emergency = {t.value for t in wire.Trigger} - {t.value for t in wire.ROUTINE_TRIGGERS}
    assert {t.value for t in vocabulary.EMERGENCY_TRIGGERS} == emergency


def test_the_operators_exit_code_after_a_notice_is_the_sdks() -> None:
    assert settings.EMERGENCY_EXIT_CODE == wire.EXIT_STOPPED_AFTER_NOTICE


def _schema_at(schema: dict[str, Any], *path: str) -> dict[str, Any]:
    for key in path:
        schema = schema["properties"][key]
    return schema


def test_the_crd_accepts_exactly_the_sdks_tiers() -> None:
    version = crd.crd_manifest()["spec"]["versions"][0]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    tier = _schema_at(status, "lastCheckpoint", "tier")
    assert tier["enum"] == [t.value for t in wire.Tier]
    assert all(type(v) is str for v in tier["enum"])  # plain strings in the generated YAML


def test_notice_sources_and_the_suspend_source_are_interruption_sources() -> None:
    assert notices.SOURCES == vocabulary.NOTICE_SOURCES
    assert set(vocabulary.NOTICE_SOURCES) <= set(vocabulary.InterruptionSource)
    assert lifecycle.SUSPEND_SOURCE is vocabulary.InterruptionSource.SUSPEND


def test_enum_values_serialise_as_their_plain_strings() -> None:
    # Status patches and sidecar requests are JSON: an enum member must write its value.
    values = [
        *vocabulary.SaveState, *vocabulary.Trigger, *vocabulary.Tier,
        *vocabulary.RestartKind, *vocabulary.InterruptionSource,
    ]  # fmt: skip
    assert json.dumps({"v": values}) == json.dumps({"v": [v.value for v in values]})
    assert [f"{v}" for v in values] == [v.value for v in values]

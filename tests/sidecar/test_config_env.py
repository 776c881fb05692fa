"""The sidecar's settings from the environment: numbers parse as their type, and a value that is
not a number stops start-up with an error that names the variable and the fix."""

from __future__ import annotations

import pytest
from baton_sidecar import ConfigError, parse_config


def test_numbers_from_the_environment_take_the_type_of_their_setting() -> None:
    config = parse_config(
        [],
        {
            "BATON_SIDECAR_PORT": "9441",
            "BATON_SIDECAR_SILENT_AFTER": "2.5",
            "BATON_SIDECAR_ABSENT_AFTER": "30",
            "BATON_SIDECAR_GCE_WAIT": "30",
            "BATON_SIDECAR_LINGER": "",
        },
    )
    assert config.port == 9441
    assert isinstance(config.port, int)
    assert config.silent_after == 2.5
    assert config.absent_after == 30.0
    assert isinstance(config.absent_after, float)
    assert config.gce_wait_seconds == 30
    assert config.linger_seconds == 5.0  # empty means unset: the default


def test_a_port_that_is_not_an_integer_names_the_variable_and_the_fix() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config([], {"BATON_SIDECAR_PORT": "9440.5"})
    assert str(e.value) == (
        "BATON_SIDECAR_PORT='9440.5' is not an integer: set it to a number like 9440"
    )


def test_seconds_that_are_not_a_number_name_the_variable_and_the_fix() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config([], {"BATON_SIDECAR_BACKOFF_MAX": "soon"})
    assert str(e.value) == (
        "BATON_SIDECAR_BACKOFF_MAX='soon' is not a number: set it to seconds like 30.0"
    )

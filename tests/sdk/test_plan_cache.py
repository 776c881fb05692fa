"""PlanCache: a save of the same layout reuses the plan; any change of layout plans anew,
and the plan is always the one plan_save makes for that state."""

from __future__ import annotations

import torch

from trainer_sdk import api
from trainer_sdk.format.planning import PlanCache, plan_save


def _flat(state: dict[str, torch.Tensor]) -> api.FlatState:
    return api.flatten({"model": state})


def test_same_layout_reuses_the_plan_and_any_change_replans() -> None:
    cache = PlanCache()
    a = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    first = cache.plan(_flat(a), 0, 2)
    assert first == plan_save(_flat(a), 0, 2)
    # new values, new tensor objects, same layout: the same plan object
    again = {"w": torch.ones(4, 3), "b": torch.full((3,), 7.0)}
    assert cache.plan(_flat(again), 0, 2) is first

    changed = [
        ({"w": torch.zeros(5, 3), "b": torch.zeros(3)}, 0, 2),  # a shape
        ({"w": torch.zeros(4, 3, dtype=torch.float64), "b": torch.zeros(3)}, 0, 2),  # a dtype
        ({"b": torch.zeros(3), "w": torch.zeros(4, 3)}, 0, 2),  # the order
        ({"w": torch.zeros(4, 3), "c": torch.zeros(3)}, 0, 2),  # a key
        (a, 1, 2),  # the rank
        (a, 0, 3),  # the world size
    ]
    for state, rank, world in changed:
        got = cache.plan(_flat(state), rank, world)
        assert got == plan_save(_flat(state), rank, world), (list(state), rank, world)
        assert got is not first

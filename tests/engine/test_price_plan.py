"""Plan validation (each bad option named) and JSON round trips."""

from __future__ import annotations

import pytest

from engine.hardware.devices import DeviceSpec
from engine.planning.plan import Plan
from spec.errors import CarveError

GIB = 1 << 30


def devs(n: int) -> tuple[DeviceSpec, ...]:
    return tuple(DeviceSpec(i, "g", 24 * GIB, 23 * GIB, simulated=True) for i in range(n))


@pytest.mark.parametrize(
    ("kw", "option"),
    [
        ({"split": (0, 14, 10, 48)}, "--split"),  # out of order
        ({"split": (0, 14, 14, 48)}, "--split"),  # empty stage
        ({"split": (2, 14, 29, 48)}, "--split"),  # does not start at 0
        ({"split": (0, 14, 48)}, "--split"),  # wrong count
        ({"ctx": 0}, "--ctx"),
        ({"ctx": -5}, "--ctx"),
        ({"kv_type": "q4_0"}, "--kv"),
        ({"arena": "chunked:abc"}, "--arena"),
        ({"prefill_chunk": 0}, "--prefill-chunk"),
        ({"cache_reserve": -1}, "--cache-reserve"),
        ({"act_dtype": "f8"}, "act_dtype"),
        ({"logits_rows": 0}, "logits_rows"),
        ({"devices": ()}, "--gpus"),
    ],
)
def test_bad_plans_name_the_option(kw: dict, option: str) -> None:
    args = {"model": "m.gguf", "devices": devs(3), "split": (0, 14, 29, 48), "ctx": 4096} | kw
    with pytest.raises(CarveError) as err:
        Plan(**args)
    assert str(err.value).startswith(option)
    assert "\n" not in str(err.value)


def test_cpu_does_not_mix_with_gpus() -> None:
    cpu = DeviceSpec(-1, "cpu", 64 * GIB, 60 * GIB)
    with pytest.raises(CarveError, match="--gpus"):
        Plan("m.gguf", (cpu, *devs(1)), (0, 4, 8), ctx=256)


def test_plan_json_round_trip_and_bad_json() -> None:
    plan = Plan(
        "m.gguf",
        devs(2),
        [0, 3, 8],
        ctx=8192,
        kv_type="q8_0",
        prefill_chunk=256,
        cache_reserve=123,
        arena="chunked:512",
        act_dtype="bf16",
        logits_rows=5,
    )
    assert plan.split == (0, 3, 8) and isinstance(plan.devices, tuple)
    assert Plan.from_json(plan.to_json()) == plan
    import json

    assert Plan.from_json(json.dumps(plan.to_json())) == plan
    with pytest.raises(CarveError, match="plan: not valid JSON"):
        Plan.from_json("{")
    with pytest.raises(CarveError, match="plan: missing"):
        Plan.from_json({"model": "m"})
    assert plan.stages() == [(0, 3), (3, 8)]

"""prefer="auto", the default of `default_plan` (window, `carve plan`, `carve chat`): a model that
fits on one GPU with the requested context stays on one; one too big for one spreads."""

from __future__ import annotations

import pytest

from engine.gguf.reader import GGUFModel
from engine.hardware.rigs import parse_rig
from engine.planning.defaults import default_plan
from engine.planning.price import price
from engine.planning.split import auto_split
from engine.synth.header import HeaderModel
from engine.synth.shapes import Shape

GIB = 1 << 30
# a 13B-class llama: about 7 GiB of Q4_K_M weights; 32k of f16 context is 25 GiB of KV more
LLAMA13 = HeaderModel(Shape("llama", 40, 5120, 40, 40, 13824, 32000, n_ctx=32768),
                      name="llama13.gguf")


def test_the_demo_model_stays_on_one_of_two_24_gib_cards(demo_model_path):
    model = GGUFModel.open(demo_model_path)
    rig = parse_rig("2x24GiB")
    plan = default_plan(model, rig, ctx=32768)
    assert [d.index for d in plan.devices] == [0] and plan.split == (0, 24)
    assert price(plan, model).fits
    spread = default_plan(model, rig, ctx=32768, prefer="spread")
    assert [d.index for d in spread.devices] == [0, 1] and len(spread.split) == 3


def test_the_card_with_the_most_room_takes_it_alone():
    rig = parse_rig("rtx4090,a6000,rtx4090")
    plan = auto_split(LLAMA13, rig, prefer="auto", ctx=4096)
    assert [d.name for d in plan.devices] == ["NVIDIA RTX A6000"]
    assert plan.split == (0, 40)


@pytest.mark.parametrize("ctx, n_devices", [(4096, 1), (32768, 2)])
def test_a_model_too_big_for_one_card_with_its_context_spreads(ctx, n_devices):
    rig = parse_rig("2x24GiB")
    plan = default_plan(LLAMA13, rig, ctx=ctx)
    assert len(plan.devices) == n_devices
    assert price(plan, LLAMA13).fits
    if n_devices == 2:  # the single card could not hold it with that context
        assert not price(default_plan(LLAMA13, rig[:1], ctx=ctx), LLAMA13).fits


def test_the_cache_reserve_decides_what_fits_on_one():
    # auto asks one card to keep the cache reserve free, as `fewest` does
    rig = parse_rig("2x24GiB")
    one = default_plan(LLAMA13, rig[:1], ctx=16384, cache_reserve=0)
    layout = price(one, LLAMA13)
    need = layout.devices[0].total - layout.devices[0].terms["dequant_cache"]
    left = rig[0].free - need  # what the one card has beyond the model and its context
    assert left > 0
    assert len(default_plan(LLAMA13, rig, ctx=16384, cache_reserve=left - GIB).devices) == 1
    assert len(default_plan(LLAMA13, rig, ctx=16384, cache_reserve=left + GIB).devices) == 2

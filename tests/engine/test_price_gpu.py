"""On a real GPU: the allocator model equals torch's caching allocator, a Layout's arenas
allocate exactly `allocated`, and NVML's devices map to CUDA indices. Skipped without CUDA."""

from __future__ import annotations

import os
import random

import pytest

from engine.hardware.devices import DeviceSpec, NvmlMonitor
from engine.planning.arena import CachingAllocatorModel
from engine.planning.plan import Plan
from engine.planning.price import price
from engine.synth.header import HeaderModel
from engine.synth.shapes import Shape

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MIB = 1 << 20


def fresh_reserved() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(0)


@pytest.mark.parametrize("seed", range(12))
def test_allocator_model_equals_torch(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [
        rng.choice(
            [
                rng.randint(1, 4096),
                rng.randint(1, MIB),
                rng.randint(MIB, 12 * MIB),
                rng.randint(10 * MIB, 300 * MIB),
            ]
        )
        for _ in range(rng.randint(1, 60))
    ]
    base = fresh_reserved()
    model = CachingAllocatorModel()
    held = []
    for n in sizes:
        held.append(torch.empty(n, dtype=torch.uint8, device="cuda:0"))
        model.malloc(n)
        assert torch.cuda.memory_reserved(0) - base == model.reserved, (seed, len(held), n)
    assert torch.cuda.memory_allocated(0) >= sum(sizes)
    del held


SHAPES = {
    "dense": Shape("qwen2", 6, 1024, 8, 2, 2816, 32000, n_ctx=8192),
    # experts in the weights arena, MoE buffers, a NextN layer left out
    "moe": Shape("glm4moe", 6, 1024, 8, 2, 2816, 32000, head_dim=128, n_ctx=8192, n_expert=32,
                 n_expert_used=4, n_ff_exp=512, n_expert_shared=1, n_layer_dense_lead=1,
                 n_nextn=1, rope_dim=64),
}


@pytest.mark.parametrize("shape", ["dense", "moe"])
@pytest.mark.parametrize("arena", ["packed", "per-tensor", "chunked:64"])
def test_layout_arenas_allocate_exactly_what_was_priced(arena: str, shape: str) -> None:
    model = HeaderModel(SHAPES[shape])
    dev = DeviceSpec(0, torch.cuda.get_device_name(0), 8 << 30, 8 << 30)
    layout = price(Plan("m", (dev,), (0, 6), ctx=2048, arena=arena, act_dtype="bf16"), model)
    d = layout.devices[0]
    base = fresh_reserved()
    held = [torch.empty(a.nbytes, dtype=torch.uint8, device="cuda:0") for a in d.arenas]
    assert torch.cuda.memory_reserved(0) - base == d.allocated
    del held


def test_nvml_devices_map_to_cuda_indices_by_uuid() -> None:
    if os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        pytest.skip("run with CUDA_DEVICE_ORDER=PCI_BUS_ID (as the engine is launched)")
    snaps = NvmlMonitor().snapshot()
    assert len(snaps) >= torch.cuda.device_count()
    for s in snaps:
        if s.cuda_index >= 0:
            props = torch.cuda.get_device_properties(s.cuda_index)
            assert str(props.uuid) in s.uuid
            # CUDA's total is NVML v2's total less the driver reserve (H200: 615 MiB)
            assert s.total - s.reserved == props.total_memory
            assert s.free + s.used + s.reserved == s.total

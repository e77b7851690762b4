"""KV cache: ring buffers for sliding-window layers and q8_0 storage give the same attention as
a full history with an explicit window mask."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.kv_cache import KVCache, LayerKV, _mask
from engine.runtime.kv_quant import dequantize_q8_0, q8_0_nbytes, quantize_q8_0
from engine.runtime.models.ops import attention

KVH, D, H = 2, 32, 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")



def _cache(cells: int, ctx: int, window: int, kv: str) -> KVCache:
    if kv == "f16":
        k = torch.zeros(cells, KVH, D, dtype=torch.float16)
        v = torch.zeros(cells, KVH, D, dtype=torch.float16)
    else:
        k = torch.zeros(cells, q8_0_nbytes(KVH * D), dtype=torch.uint8)
        v = torch.zeros_like(k)
    layer = LayerKV(k, v, cells, bool(window) and cells < ctx, window, KVH, D, D)
    return KVCache({0: layer}, ctx)


def _stored(x: torch.Tensor, kv: str) -> torch.Tensor:
    if kv == "f16":
        return x.half().float()
    raw = quantize_q8_0(x.reshape(x.shape[0], -1))
    return dequantize_q8_0(raw.reshape(-1), x.shape)


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
@pytest.mark.parametrize(
    "window,cells,chunks",
    [
        (0, 64, [5, 17, 1, 1, 1, 20]),  # full context
        (8, 8, [5, 17, 1, 1, 1, 3, 9, 1]),  # ring: chunks longer than the ring, wrap in decode
        (8, 8, [3, 3, 3, 1, 7]),  # ring: chunks straddling the wrap point
        (8, 64, [5, 17, 1, 1, 12]),  # window without a ring (cells >= ctx): masked reads
    ],
)
def test_cache_attention_equals_full_history(kv: str, window: int, cells: int, chunks: list[int]) -> None:
    ctx = 64
    cache = _cache(cells, ctx, window, kv)
    g = torch.Generator().manual_seed(len(chunks) + cells)
    ks, vs, pos0 = [], [], 0
    for t in chunks:
        q = torch.randn(t, H, D, generator=g)
        k, v = torch.randn(t, KVH, D, generator=g), torch.randn(t, KVH, D, generator=g)
        keys, values, mask = cache.store_and_fetch(0, k, v, pos0)
        got = attention(q, keys, values, mask, 0.2)
        ks.append(_stored(k, kv))
        vs.append(_stored(v, kv))
        end = pos0 + t
        ref_mask = _mask(torch.arange(pos0, end), torch.arange(0, end), window)
        ref = attention(q, torch.cat(ks), torch.cat(vs), ref_mask, 0.2)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        if cache.layers[0].ring:
            assert keys.shape[0] <= cells + t  # never more than the ring plus the chunk
        pos0 = end
        cache.n_past = end


def test_context_overflow_is_a_carve_error() -> None:
    from spec.errors import CarveError

    cache = _cache(16, 16, 0, "f16")
    k = torch.zeros(17, KVH, D)
    with pytest.raises(CarveError, match="context is full"):
        cache.store_and_fetch(0, k, k, 0)


def test_rewind_only_while_rings_are_intact() -> None:
    cache = _cache(8, 64, 8, "f16")
    cache.n_past = 8
    assert cache.can_rewind_to(5)
    cache.n_past = 9  # position 8 overwrote position 0's cell
    assert not cache.can_rewind_to(5)

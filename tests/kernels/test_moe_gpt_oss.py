"""gpt-oss's attention and RoPE on the GPU kernels against their references: attention sinks
(one more logit per head in each softmax, no value) in split-K decode (merged by the last
program or by a second launch) and in flash prefill, and YaRN's per-pair frequencies with its
cos/sin scale in the rotation and in the decode rotation fused with the cache store."""

from __future__ import annotations

import pytest
import torch
from reference_check import DEVICE, generator, nerr, poison

from carve_kernels import attention, kv_cache, rope


def _cache(cells: int, kvh: int, d: int, g) -> torch.Tensor:
    c = torch.empty(cells, kvh, d, dtype=torch.float16, device=DEVICE)
    src = torch.randn(cells, kvh, d, generator=g, device=DEVICE)
    kv_cache.kv_store(src, c, torch.arange(cells, dtype=torch.int32, device=DEVICE), cells)
    return c


@pytest.mark.parametrize("fused", [False, True])
def test_attn_decode_with_sinks(fused, seed):
    g = generator(seed)
    nh, kvh, d, cells = 4, 2, 32, 128
    k, v = _cache(cells, kvh, d, g), _cache(cells, kvh, d, g)
    q = torch.randn(nh, d, generator=g, device=DEVICE)
    sinks = torch.randn(nh, generator=g, device=DEVICE) + 3  # a share of ~10-40 % of 64 keys
    pos = torch.tensor([100], dtype=torch.int32, device=DEVICE)
    out = poison((nh, d))
    counter = torch.zeros(kvh, 64, dtype=torch.int32, device=DEVICE) if fused else None
    attention.attn_decode(q, k, v, pos, kvh, cells, 64, d**-0.5, out=out, counter=counter,
                          sinks=sinks)
    ref = attention.attn_decode_ref(q, k, v, pos, kvh, cells, 64, d**-0.5, sinks=sinks)
    assert nerr(out, ref) < 5e-3  # f16 operands, as without sinks
    plain = attention.attn_decode_ref(q, k, v, pos, kvh, cells, 64, d**-0.5)
    assert nerr(plain, ref) > 2e-2  # the sinks take their share


def test_attn_prefill_with_sinks(seed):
    g = generator(seed)
    t, nh, kvh, d, cells = 20, 4, 2, 32, 128
    k, v = _cache(cells, kvh, d, g), _cache(cells, kvh, d, g)
    q = torch.randn(t, nh, d, generator=g, device=DEVICE)
    kn = torch.randn(t, kvh, d, generator=g, device=DEVICE)
    vn = torch.randn(t, kvh, d, generator=g, device=DEVICE)
    sinks = torch.randn(nh, generator=g, device=DEVICE) * 3
    out = poison((t, nh, d))
    attention.attn_prefill(q, kn, vn, k, v, 30, cells, 16, d**-0.5, out=out, sinks=sinks)
    ref = attention.attn_prefill_ref(q, kn, vn, k, v, 30, cells, 16, d**-0.5, sinks=sinks)
    assert nerr(out, ref) < 5e-3


def test_rope_with_yarn_frequencies(seed):
    g = generator(seed)
    t, nh, d = 3, 4, 64
    freqs = torch.rand(d // 2, generator=g, device=DEVICE)
    pos = torch.tensor([5, 900, 4000], dtype=torch.int32, device=DEVICE)
    x = torch.randn(t, nh, d, generator=g, device=DEVICE)
    ref = rope.rope_ref(x.clone(), pos, 1e4, True, freqs=freqs, mscale=1.3)
    rope.rope(x, pos, 1e4, True, freqs=freqs, mscale=1.3)
    assert nerr(x, ref) < 1e-5
    # decode's fused rotation and store: q and k rotated, k and v in the cache
    cells, kvh = 8, 2
    qk = torch.randn(1, nh + kvh, d, generator=g, device=DEVICE)
    vv = torch.randn(1, kvh, d, generator=g, device=DEVICE)
    kc = torch.zeros(cells, kvh, d, dtype=torch.float16, device=DEVICE)
    vc = torch.zeros_like(kc)
    ref = rope.rope_ref(qk.clone(), pos[1:2], 1e4, True, freqs=freqs, mscale=1.3)
    rope.rope_store(qk, vv, pos[1:2], 1e4, True, 1.0, nh, kc, vc, cells, freqs=freqs,
                    mscale=1.3)
    assert nerr(qk, ref) < 1e-5
    assert nerr(kc[900 % cells].float(), ref[0, nh:]) < 1e-3  # f16 cache

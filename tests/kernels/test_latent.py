"""The latent-attention kernels (carve_kernels/latent.py) against their plain-torch twins: the
per-head matrices (attn_k_b / attn_v_b, and a legacy attn_kv_b's blocks read transposed), the
cache store of a padded chunk (f16, and q8_0 to the byte of the KV cache's own quantization),
and attention over the latent rows of either cache in decode (split-K, then the merge) and
prefill, with Mistral Large 3's temperature. Fresh random inputs each run, outputs
poisoned first; tiny shapes under the interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch
from reference_check import DEVICE, generator, nerr, poison

from carve_kernels import kv_cache, latent


@pytest.mark.parametrize("t", [1, 5, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_matmul_matches_reference(t, dtype, seed):
    g = generator(seed)
    h, k, j = 3, 48, 80
    a = torch.randn(t, h, 2 * k, generator=g, device=DEVICE).to(dtype)[..., :k]  # strided rows
    w = torch.randn(h, j, k, generator=g, device=DEVICE).to(dtype)
    out = poison((t, h, j), dtype)
    latent.head_matmul(a, w, out)
    ref = latent.head_matmul_ref(a, w, torch.empty(t, h, j, device=DEVICE))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert nerr(out.float(), ref) < tol
    # a legacy attn_kv_b: per head [nope + v, C] rows; k_b^T is the first nope rows, read as
    # [h, C, nope] through strides, v_b the next v rows as they lie
    nope, v, c = 16, 24, 40
    kv_b = torch.randn(h * (nope + v), c, generator=g, device=DEVICE).to(dtype)
    blocks = kv_b.view(h, nope + v, c)
    q = torch.randn(t, h, nope, generator=g, device=DEVICE).to(dtype)
    out = poison((t, h, c), dtype)
    latent.head_matmul(q, blocks[:, :nope].transpose(1, 2), out)
    ref = torch.einsum("thn,hnc->thc", q.float(), blocks[:, :nope].float())
    assert nerr(out.float(), ref) < tol
    o_lat = torch.randn(t, h, c, generator=g, device=DEVICE).to(dtype)
    out = poison((t, h, v), dtype)
    latent.head_matmul(o_lat, blocks[:, nope:], out)
    ref = torch.einsum("thc,hvc->thv", o_lat.float(), blocks[:, nope:].float())
    assert nerr(out.float(), ref) < tol


def test_head_matmul_refuses_shapes_that_disagree():
    a = torch.zeros(2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="head_matmul"):
        latent.head_matmul(a, torch.zeros(3, 5, 9, device=DEVICE), torch.zeros(2, 3, 5,
                                                                               device=DEVICE))


def test_latent_store_skips_a_padded_chunks_repeats(seed):
    g = generator(seed)
    cells, w = 16, 72
    cache = torch.zeros(cells, 1, w, dtype=torch.float16, device=DEVICE)
    rows = torch.randn(6, w, generator=g, device=DEVICE)
    pos = torch.tensor([3, 4, 5, 6, 6, 6], device=DEVICE)  # 4 rows, padded to 6
    rows[4:] = 99.0  # padding must not land
    latent.latent_store(rows, cache, pos, cells)
    want = torch.zeros(cells, w, dtype=torch.float16, device=DEVICE)
    want[3:7] = rows[:4].half()
    assert torch.equal(cache[:, 0], want)


def test_latent_store_q8_0_is_the_kv_caches_quantization(seed):
    g = generator(seed)
    cells, w = 16, 96 + 32  # 4 blocks of latent, 1 of rotated key
    rows = torch.randn(5, w, generator=g, device=DEVICE) * 3
    pos = torch.tensor([2, 3, 4, 9, 9], device=DEVICE)
    cache = torch.full((cells * w // 32 * 34,), 7, dtype=torch.uint8, device=DEVICE)
    want = cache.clone()
    latent.latent_store(rows, cache, pos, cells)
    kv_cache.kv_store_ref(rows.unsqueeze(1), want, pos, cells)
    assert torch.equal(cache, want)
    with pytest.raises(ValueError, match="q8_0 latent cache"):
        latent.latent_store(rows[:, :40], cache, pos, cells)


def _case(seed, t, h, c, r, cells, dtype=torch.float32, q8=False):
    g = generator(seed)
    q_all = torch.randn(t, h, 2 * (c + r), generator=g, device=DEVICE).to(dtype)
    q_lat, q_pe = q_all[..., :c], q_all[..., c + r:c + 2 * r]  # strided heads, as the stage's
    rows = torch.randn(cells, c + r, generator=g, device=DEVICE) * 0.5
    if not q8:
        return q_lat, q_pe, rows.half().view(cells, 1, c + r)
    cache = torch.zeros(cells * (c + r) // 32 * 34, dtype=torch.uint8, device=DEVICE)
    kv_cache.kv_store_ref(rows.unsqueeze(1), cache, torch.arange(cells, device=DEVICE), cells)
    return q_lat, q_pe, cache


@pytest.mark.parametrize("pos", [0, 40, 190])
@pytest.mark.parametrize("h,q8", [(5, False), (16, True), (20, False)])
def test_latent_decode_matches_reference(pos, h, q8, seed):
    c, r, cells = 48, 16, 200
    q_lat, q_pe, cache = _case(seed, 1, h, c, r, cells, q8=q8)
    positions = torch.tensor([pos], device=DEVICE)
    ws = (poison((h, 4, latent.workspace_width(c))), poison((h, 4)))
    out = poison((1, h, c))
    latent.latent_attention(q_lat, q_pe, cache, positions, cells, 0.3, out, workspace=ws)
    ref = latent.latent_attention_ref(q_lat, q_pe, cache, positions, cells, 0.3,
                                      torch.empty(1, h, c, device=DEVICE))
    assert nerr(out, ref) < 2e-3  # f16 products, as the attention kernels'


@pytest.mark.parametrize("temperature,q8", [(None, False), ((0.5, 8), False), (None, True)])
def test_latent_prefill_matches_reference(temperature, q8, seed):
    h, c, r, cells, t = 6, 48, 16, 128, 21
    q_lat, q_pe, cache = _case(seed, t, h, c, r, cells, torch.bfloat16, q8)
    positions = torch.arange(30, 30 + t, device=DEVICE)
    out = poison((t, h, c), torch.bfloat16)
    latent.latent_attention(q_lat, q_pe, cache, positions, cells, 0.2, out,
                            temperature=temperature)
    ref = latent.latent_attention_ref(q_lat, q_pe, cache, positions, cells, 0.2,
                                      torch.empty(t, h, c, device=DEVICE), temperature=temperature)
    assert nerr(out.float(), ref) < 1e-2
    if temperature is not None:  # it changes the result (positions past one length)
        plain = latent.latent_attention_ref(q_lat, q_pe, cache, positions, cells, 0.2,
                                            torch.empty(t, h, c, device=DEVICE))
        assert nerr(plain, ref) > 1e-2

"""engine.runtime.kv_quant against gguf.quants' Q8_0 (documented there as bit-exact with ggml-quants.c).

Bound: bit-equal bytes and bit-equal floats, on fresh random data each run (the `seed` fixture,
printed with every failure).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from carve_kernels.dequant import dequantize
from engine.runtime.kv_quant import dequantize_q8_0, q8_0_nbytes, quantize_q8_0
from spec import quant_types as qt

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _values(seed: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, salt])
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 2, (*shape[:-1], 1))
    x = torch.from_numpy(x.astype(np.float32))
    flat = x.view(-1, 32)
    flat[0] = 0  # an all-zero block: d = 0, and 1/d must not be taken
    flat[-1] = torch.arange(-16, 16) / 127 * 2  # many values on the .5 rounding boundary
    return x


@pytest.mark.parametrize("shape", [(32,), (5, 2, 64), (3, 128)])
def test_quantize_bytes_equal_gguf(shape: tuple[int, ...], seed: int) -> None:
    x = _values(seed, shape, len(shape))
    got = quantize_q8_0(x)
    want = gguf.quants.quantize(x.numpy(), Q8_0)
    assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape
    assert np.array_equal(got.numpy(), want)


def test_dequantize_equal_gguf_and_engine_dequant(seed: int) -> None:
    x = _values(seed, (6, 4, 64), 7)  # [cells, n_head_kv, head_dim]
    raw = quantize_q8_0(x)
    want = gguf.quants.dequantize(raw.numpy(), Q8_0)
    got = dequantize_q8_0(raw, x.shape)
    assert tuple(got.shape) == (6, 4, 64)
    assert np.array_equal(got.numpy(), want)
    assert torch.equal(got, dequantize(raw.reshape(-1), qt.Q8_0, (64, 4, 6)))
    # q8_0 error: half a step of d = amax / 127, plus up to 127 times d's own f16 rounding
    # (half an ulp: relative 2^-11, or 2^-25 absolute once d is an f16 subnormal), since values
    # are rebuilt with the stored f16 d
    step = x.view(-1, 32).abs().amax(1, keepdim=True) / 127
    d_err = torch.clamp(step * 2**-11, min=2**-25)
    bound = (0.5 * step + 127 * d_err) * 1.001
    assert ((got - x).view(-1, 32).abs() <= bound).all()


def test_half_inputs_quantize_as_their_float32_values(seed: int) -> None:
    x = _values(seed, (4, 96), 9)
    for dtype in (torch.bfloat16, torch.float16):
        h = x.to(dtype)
        want = gguf.quants.quantize(h.float().numpy(), Q8_0)
        assert np.array_equal(quantize_q8_0(h).numpy(), want), dtype
    assert dequantize_q8_0(quantize_q8_0(x), x.shape, torch.bfloat16).dtype == torch.bfloat16


def test_writes_into_a_priced_span_in_place(seed: int) -> None:
    cells, heads, dim = 8, 2, 64
    span = torch.zeros(q8_0_nbytes(cells * heads * dim), dtype=torch.uint8)  # as priced
    assert span.numel() == cells * heads * dim // 32 * 34
    rows = span.view(cells, heads * dim // 32 * 34)
    x = _values(seed, (3, heads * dim), 11)
    assert quantize_q8_0(x, out=rows[2:5]).data_ptr() == rows[2].data_ptr()
    assert np.array_equal(rows[2:5].numpy(), gguf.quants.quantize(x.numpy(), Q8_0))
    assert int(rows[:2].count_nonzero()) == 0 and int(rows[5:].count_nonzero()) == 0


def test_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.zeros(3, 48))
    with pytest.raises(ValueError, match="68 uint8 bytes"):
        dequantize_q8_0(torch.zeros(67, dtype=torch.uint8), (64,))


def test_reads_cells_gathered_at_any_offset(seed: int) -> None:
    x = _values(seed, (5, 64), 13)
    raw = quantize_q8_0(x).reshape(-1)
    buf = torch.zeros(raw.numel() + 1, dtype=torch.uint8)
    buf[1:] = raw  # an odd address: d cannot be viewed in place
    want = gguf.quants.dequantize(raw.numpy(), Q8_0).reshape(5, 64)
    assert np.array_equal(dequantize_q8_0(buf[1:], (5, 64)).numpy(), want)

"""carve_kernels.dequant against gguf.quants.dequantize (numpy, written by the gguf authors).

Error bound: **bit-equal** in float32 for every type. carve_kernels.dequant does the same float32
ops in the same order as the reference (d*scale first, then *q, then -min), and every integer step
is exact, so there is no rounding difference to allow for. bf16/f16 output is the float32 result
rounded once, so it must equal the reference cast to that dtype (again exact equality).

Inputs are fresh random blocks each run (the `seed` fixture, printed with every failure): raw
random bytes for every block type with finite, small f16 d/dmin fields (real files never hold
inf/nan scales; IQ1_M's d is spread over four nibbles, MXFP4's e8m0 exponent byte is finite for
every value), plus, for the 32-blocks, values that gguf.quants.quantize produced from random
floats. The lookup types (IQ family, MXFP4) are compared with every table index drawn: grid rows,
sign patterns and value lists come from random bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import torch

from carve_kernels.dequant import SUPPORTED_TYPES, dequantize, dequantize_to
from spec import quant_types as qt
from spec.errors import CarveError

# types whose values come from the format's tables (grids, sign patterns, value lists)
LOOKUP_TYPES = [
    qt.IQ4_NL,
    qt.IQ4_XS,
    qt.IQ2_XXS,
    qt.IQ2_XS,
    qt.IQ2_S,
    qt.IQ3_XXS,
    qt.IQ3_S,
    qt.IQ1_S,
    qt.IQ1_M,
    qt.MXFP4,
]
BLOCK_TYPES = [
    qt.Q4_0,
    qt.Q4_1,
    qt.Q5_0,
    qt.Q5_1,
    qt.Q8_0,
    qt.Q2_K,
    qt.Q3_K,
    qt.Q4_K,
    qt.Q5_K,
    qt.Q6_K,
    *LOOKUP_TYPES,
]


def _rng(seed: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([seed, salt])


def _raw_blocks(ggml_type: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    q = qt.QUANT[ggml_type]
    b = rng.integers(0, 256, size=(n_blocks, q.type_size), dtype=np.uint8)
    for off in qt.f16_fields(ggml_type):
        # magnitudes from 1e-6 to 1, signs both ways: subnormal-ish to large f16 scales
        f = rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-6, 0, n_blocks)
        b[:, off : off + 2] = f.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if ggml_type == qt.IQ1_M:
        # d's 16 bits are the top nibbles of the four u16 scales at 48 (bytes 49, 51, 53, 55)
        f = rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-6, 0, n_blocks)
        d = f.astype(np.float16).view(np.uint16)
        for k in range(4):
            nibble = ((d >> (4 * k)) & 0xF).astype(np.uint8)
            b[:, 49 + 2 * k] = (b[:, 49 + 2 * k] & 0x0F) | (nibble << 4)
    return b


def _reference(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """gguf.quants.dequantize on the bytes laid out as gguf does: [..., ne1, row bytes]."""
    q = qt.QUANT[ggml_type]
    rows = raw.reshape(*shape[:0:-1], shape[0] // q.block_size * q.type_size)
    with np.errstate(over="ignore"):  # MXFP4's top exponents times 6 or 12 are inf, here and ours
        return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(ggml_type))


def _shape(ggml_type: int, rng: np.random.Generator) -> tuple[int, ...]:
    """A random GGUF shape (ne0 first) with whole blocks per row, 1 to 3 dims."""
    bs = qt.QUANT[ggml_type].block_size
    ne0 = bs * int(rng.integers(1, 5))
    return (ne0, *[int(x) for x in rng.integers(1, 7, size=int(rng.integers(0, 3)))])


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=qt.type_name)
def test_random_blocks_bit_equal_to_gguf(ggml_type: int, seed: int) -> None:
    rng = _rng(seed, ggml_type)
    for _ in range(4):
        shape = _shape(ggml_type, rng)
        n_blocks = int(np.prod(shape)) // qt.QUANT[ggml_type].block_size
        raw = _raw_blocks(ggml_type, n_blocks, rng).reshape(-1)
        want = _reference(raw, ggml_type, shape)
        got = dequantize(torch.from_numpy(raw), ggml_type, shape)
        assert got.dtype == torch.float32
        assert tuple(got.shape) == shape[::-1] == want.shape
        assert np.array_equal(got.numpy(), want), f"shape {shape}"


def test_many_blocks_span_several_chunks(seed: int) -> None:
    """Long tensors go through the chunk loop (including a short last chunk)."""
    rng = _rng(seed, 1000)
    for ggml_type in (qt.Q5_0, qt.Q6_K, qt.IQ2_XXS, qt.IQ1_M):
        shape = (qt.QUANT[ggml_type].block_size * 3, 701)
        raw = _raw_blocks(ggml_type, 3 * 701, rng).reshape(-1)
        got = dequantize(raw, ggml_type, shape)  # numpy input, as GGUFModel.tensor_data gives
        assert np.array_equal(got.numpy(), _reference(raw, ggml_type, shape))


@pytest.mark.parametrize("ggml_type", LOOKUP_TYPES, ids=qt.type_name)
def test_lookup_types_one_row_many_rows_long_rows(ggml_type: int, seed: int) -> None:
    """One block, one row of several blocks, several rows, and rows of many blocks."""
    rng = _rng(seed, 6000 + ggml_type)
    bs = qt.QUANT[ggml_type].block_size
    for shape in ((bs,), (bs * 5,), (bs, 7), (bs * 3, 4), (bs * 16, 2, 3)):
        n_blocks = int(np.prod(shape)) // bs
        raw = _raw_blocks(ggml_type, n_blocks, rng).reshape(-1)
        want = _reference(raw, ggml_type, shape)
        got = dequantize(torch.from_numpy(raw), ggml_type, shape)
        assert tuple(got.shape) == shape[::-1] == want.shape
        assert np.array_equal(got.numpy(), want), f"shape {shape}"


@pytest.mark.parametrize(
    "ggml_type", [qt.Q4_0, qt.Q4_1, qt.Q5_0, qt.Q5_1, qt.Q8_0], ids=qt.type_name
)
def test_quantized_floats_bit_equal_to_gguf(ggml_type: int, seed: int) -> None:
    rng = _rng(seed, 2000 + ggml_type)
    x = (rng.standard_normal((5, 96)) * rng.uniform(0.01, 3, (5, 1))).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType(ggml_type))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type))
    got = dequantize(torch.from_numpy(raw.reshape(-1)), ggml_type, (96, 5))
    assert np.array_equal(got.numpy(), want)
    # and it is a quantization of x, not just the same bytes read twice
    assert np.abs(got.numpy() - x).max() < 0.2 * np.abs(x).max()


@pytest.mark.parametrize("ggml_type", [qt.F32, qt.F16, qt.BF16], ids=qt.type_name)
def test_float_types(ggml_type: int, seed: int) -> None:
    rng = _rng(seed, 3000 + ggml_type)
    x = rng.standard_normal((3, 4, 10)).astype(np.float32)
    if ggml_type == qt.F32:
        raw, want = x.view(np.uint8), x
    elif ggml_type == qt.F16:
        raw = x.astype(np.float16).view(np.uint8)
        want = gguf.quants.dequantize(raw.view(np.float16), gguf.GGMLQuantizationType.F16)
    else:
        raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.BF16)
    src = torch.from_numpy(raw.reshape(-1).copy())
    got = dequantize(src, ggml_type, (10, 4, 3))
    assert tuple(got.shape) == (3, 4, 10)
    assert got.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()  # a copy
    assert np.array_equal(got.numpy(), want.reshape(3, 4, 10))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ggml_type", [qt.Q4_K, qt.Q8_0, qt.F32, *LOOKUP_TYPES], ids=qt.type_name)
def test_half_output_is_reference_rounded_once(
    ggml_type: int, dtype: torch.dtype, seed: int
) -> None:
    rng = _rng(seed, 4000 + ggml_type)
    bs = qt.QUANT[ggml_type].block_size
    shape = (bs * 2 if bs > 1 else 64, 9)
    if ggml_type == qt.F32:
        raw = rng.standard_normal(shape[0] * shape[1]).astype(np.float32).view(np.uint8)
    else:
        raw = _raw_blocks(ggml_type, shape[0] * shape[1] // bs, rng).reshape(-1)
    want = torch.from_numpy(np.ascontiguousarray(_reference(raw, ggml_type, shape))).to(dtype)
    got = dequantize_to(torch.from_numpy(raw), ggml_type, shape, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    out = torch.full(shape[::-1], 7.0, dtype=dtype)  # an arena span, say
    assert dequantize_to(torch.from_numpy(raw), ggml_type, shape, dtype, out=out) is out
    assert torch.equal(out, want)


def test_unknown_and_unsupported_types_name_the_type() -> None:
    with pytest.raises(CarveError, match="TQ1_0"):
        dequantize(torch.zeros(54, dtype=torch.uint8), 34, (256,))
    with pytest.raises(CarveError, match="type 99"):
        dequantize(torch.zeros(18, dtype=torch.uint8), 99, (32,))
    assert set(BLOCK_TYPES) | {qt.F32, qt.F16, qt.BF16} == set(SUPPORTED_TYPES)


def test_wrong_byte_count_and_partial_blocks_are_errors() -> None:
    with pytest.raises(CarveError, match="needs 36 bytes but 35"):
        dequantize(torch.zeros(35, dtype=torch.uint8), qt.Q4_0, (32, 2))
    with pytest.raises(CarveError, match="whole blocks of 256"):
        dequantize(torch.zeros(144, dtype=torch.uint8), qt.Q4_K, (128, 2))


@pytest.mark.parametrize("ggml_type", LOOKUP_TYPES, ids=qt.type_name)
def test_partial_blocks_of_lookup_types_name_the_type(ggml_type: int) -> None:
    q = qt.QUANT[ggml_type]
    raw = torch.zeros(2 * q.type_size, dtype=torch.uint8)
    with pytest.raises(
        CarveError, match=rf"^{q.name} tensor .* whole blocks of {q.block_size}"
    ) as e:
        dequantize(raw, ggml_type, (q.block_size + q.block_size // 2, 2))
    assert "\n" not in str(e.value)


@pytest.mark.demo
def test_demo_model_tensors_match_gguf(demo_model_path) -> None:
    """Real tensors of every type in the demo model, and the first rows of its two
    [151936, 896] matrices, against gguf.quants.dequantize of the same bytes. (Where the bytes
    lie is engine.gguf.reader's job, held equal to gguf.GGUFReader in its own tests; the reader
    itself takes ~10 s to parse this vocabulary.)"""
    from engine.gguf.reader import GGUFModel

    with GGUFModel.open(demo_model_path) as model:
        seen: set[int] = set()
        for info in model.tensors:
            data = model.tensor_data(info)
            shape = info.shape
            if info.name in ("token_embd.weight", "output.weight"):
                rows = 64  # all 151,936 rows take the numpy reference ~a minute
                data = data[: data.size // shape[1] * rows]
                shape = (shape[0], rows)
            elif info.ggml_type in seen or info.n_elements > 5_000_000:
                continue
            seen.add(info.ggml_type)
            got = dequantize(data, info.ggml_type, shape)
            want = _reference(np.asarray(data), info.ggml_type, shape)
            assert np.array_equal(got.numpy(), want), info.name
    assert {qt.F32, qt.Q5_0, qt.Q8_0, qt.Q4_K, qt.Q6_K} <= seen


_PEAK_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from carve_kernels.dequant import dequantize_to
    rows, cols = 151936, 896  # the demo model's token_embd / output
    raw = torch.randint(0, 256, (rows * cols // 32, 34), dtype=torch.uint8)
    raw[:, 0:2] = torch.full((rows * cols // 32,), 0.01, dtype=torch.float16).view(-1, 1).view(torch.uint8)
    out = torch.empty(rows, cols, dtype=torch.bfloat16).fill_(0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, input and output touched
    dequantize_to(raw.view(-1), 8, (cols, rows), torch.bfloat16, out=out)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(grew)
    """
)


def test_embedding_sized_tensor_dequantizes_in_bounded_memory() -> None:
    """A [151936, 896] Q8_0 matrix into a preallocated bf16 span: the peak grows by chunk-sized
    scratch only, never by an output-sized float32 or int64 intermediate (~545 MB / 1 GB)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT],
        check=False,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert res.returncode == 0, res.stderr
    grew_kib = int(res.stdout.split()[-1])
    assert grew_kib < 32 * 1024, f"peak RSS grew by {grew_kib / 1024:.0f} MiB"


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=qt.type_name)
def test_bytes_at_odd_and_unaligned_offsets(ggml_type: int, seed: int) -> None:
    """A loader may slice a tensor out of a larger byte buffer at any offset: fields that are
    read as f16 or int64 words must not depend on the address."""
    rng = _rng(seed, 5000 + ggml_type)
    shape = (qt.QUANT[ggml_type].block_size, 3)
    raw = _raw_blocks(ggml_type, 3, rng).reshape(-1)
    want = _reference(raw, ggml_type, shape)
    for offset in (1, 2, 4, 8):
        buf = torch.zeros(raw.size + offset, dtype=torch.uint8)
        buf[offset:] = torch.from_numpy(raw)
        got = dequantize(buf[offset:], ggml_type, shape)
        assert np.array_equal(got.numpy(), want), f"offset {offset}"

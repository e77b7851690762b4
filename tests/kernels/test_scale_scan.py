"""The scan for blocks whose scale is not finite (carve_kernels/scale_scan.py): the kernel and its
torch twin find an inf or NaN d (or dmin) in any block of random well-formed weights, and nothing in
finite ones, however large; the lookup buffer holds every IQ table the kernels read."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from reference_check import DEVICE, generator

from carve_kernels import lowbit_blocks, quant_matmul, scale_scan
from carve_kernels.random_blocks import random_weight
from spec import launch
from spec import quant_types as qt

SCANNED = [qt.Q4_0, qt.Q4_1, qt.Q5_1, qt.Q8_0, qt.Q2_K, qt.Q3_K, qt.Q4_K, qt.Q6_K, qt.IQ2_XXS,
           qt.IQ3_S, qt.IQ4_XS, qt.IQ1_S, qt.IQ1_M]
INF, NAN, MAX = 0x7C00, 0xFE00, 0x7BFF  # f16 bits: +inf, a negative NaN, the largest finite


def _set_scale(w: torch.Tensor, ggml_type: int, block: int, bits: int, field: int) -> None:
    q = qt.QUANT[ggml_type]
    b = w.view(-1, q.type_size)[block]
    if ggml_type == qt.IQ1_M:  # d's nibbles are the tops of bytes 49, 51, 53, 55
        for j in range(4):
            b[49 + 2 * j] = (int(b[49 + 2 * j]) & 15) | (((bits >> (4 * j)) & 15) << 4)
        return
    off = qt.f16_fields(ggml_type)[field]
    b[off], b[off + 1] = bits & 255, bits >> 8


@pytest.mark.parametrize("ggml_type", SCANNED, ids=qt.type_name)
def test_a_non_finite_scale_is_found(ggml_type, seed):
    g = generator(seed)
    rows = int(torch.randint(1, 6, (1,), generator=g, device=DEVICE))
    w = random_weight(ggml_type, rows, 512, DEVICE, g)
    flags = torch.zeros(launch.LOOKUP_FLAGS, dtype=torch.int32, device=DEVICE)
    assert scale_scan.first_bad_block(w, ggml_type) is None
    _set_scale(w, ggml_type, 0, MAX, 0)  # finite, however large: not a damaged block
    scale_scan.scan(w, ggml_type, flags, 3)
    assert int(flags[0]) == 0 and scale_scan.first_bad_block(w, ggml_type) is None
    nblk = w.numel() // qt.QUANT[ggml_type].type_size
    bad = int(torch.randint(0, nblk, (1,), generator=g, device=DEVICE))
    fields = len(qt.f16_fields(ggml_type)) or 1
    _set_scale(w, ggml_type, bad, INF if bad % 2 else NAN, bad % fields)
    assert not torch.isfinite(quant_matmul.dequantize_ref(w, ggml_type, torch.float32)).all()
    scale_scan.scan(w, ggml_type, flags, 3)
    scale_scan.scan(random_weight(ggml_type, 2, 256, DEVICE, g), ggml_type, flags, 7)
    assert int(flags[0]) == 3  # the largest tag of a damaged tensor; the clean one left it
    assert scale_scan.first_bad_block(w, ggml_type) == bad


def test_types_without_scale_fields_are_not_scanned():
    assert not scale_scan.scanned(qt.F16) and not scale_scan.scanned(qt.BF16)
    assert all(scale_scan.scanned(t) for t in SCANNED)


def test_the_lookup_buffer_holds_every_table():
    buf = torch.zeros(launch.LOOKUP_BYTES, dtype=torch.uint8, device=DEVICE)
    try:
        flags = lowbit_blocks.install_tables(buf)
        assert flags.dtype == torch.int32 and flags.numel() == launch.LOOKUP_FLAGS
        end = buf.data_ptr() + buf.numel() - 4 * launch.LOOKUP_FLAGS
        for t in lowbit_blocks.TABLE_TYPES:
            view = lowbit_blocks.lookup_table(t, DEVICE)
            assert buf.data_ptr() <= view.data_ptr() and view.data_ptr() + view.numel() <= end
            own = torch.from_numpy(lowbit_blocks._table_values(*lowbit_blocks._TABLES[t]))
            assert torch.equal(view.cpu(), own)
    finally:
        lowbit_blocks.uninstall_tables(buf)
    # afterwards no view into the buffer is kept (a closed stage's arena can be freed)
    for t in lowbit_blocks.TABLE_TYPES:
        view = lowbit_blocks.lookup_table(t, DEVICE)
        assert view.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()


_COMPILE_SCANS = """
from benchmarks.ptx_count import _compile_sm90
from carve_kernels import scale_scan
from spec import quant_types as qt
for t in sorted(qt.QUANT):
    if scale_scan.scanned(t):
        o0, o1, iq1m = scale_scan._fields(t)
        _compile_sm90(scale_scan._scan_kernel,
                      {"w_ptr": "*u8", "nblk": "i64", "flag_ptr": "*i32", "tag": "i32"},
                      dict(TS=qt.QUANT[t].type_size, O0=o0, O1=o1, IQ1M=iq1m,
                           SC=scale_scan._IQ1M_SCALES, BLOCK=1024), 4)
        print(qt.type_name(t))
"""


def test_the_scan_compiles_for_the_gpu_for_every_scanned_type():
    # the interpreter runs what a GPU compile refuses (a kernel reading a plain global of its
    # module failed every IQ1_M load on the GPU): every type's scan compiled for sm_90 here
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_SCANS], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    names = out.stdout.split()
    assert "IQ1_M" in names and "Q4_K" in names and len(names) == sum(
        scale_scan.scanned(t) for t in qt.QUANT)

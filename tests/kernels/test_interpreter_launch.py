"""tests/conftest.py has a launch under the Triton interpreter patch triton.language once, not
again in every @triton.jit helper the kernel calls (over half of an interpreted GEMV's time).
Where there is no GPU: the kernel still computes what it should, and the scan runs once a
launch, so a Triton whose interpreter no longer matches what the conftest expects shows here."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton interpreter runs only where there is no GPU")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _plus_one_twice(x):
    return _twice(x) + 1


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    for _ in tl.static_range(3):
        x = _plus_one_twice(x)
    tl.store(out_ptr + offs, x, mask=mask)


def test_helpers_inside_a_launch_compute_without_patching_the_language_again(monkeypatch):
    from triton.runtime import interpreter as interp

    scans = []
    real = interp._patch_lang
    monkeypatch.setattr(interp, "_patch_lang", lambda fn: scans.append(fn.__name__) or real(fn))
    x = torch.arange(40, dtype=torch.float32)
    out = torch.empty_like(x)
    _helpers_kernel[(3,)](x, out, 40, BLOCK=16)
    want = x.clone()
    for _ in range(3):
        want = want * 2 + 1
    assert torch.equal(out, want)
    # the launch's own scan, none for the 3 x 3 programs' 18 helper calls
    assert scans == ["_helpers_kernel"], scans
    # outside a launch nothing is left patched: a builtin called on host values says so
    with pytest.raises(ValueError):
        tl.arange(0, 16)
